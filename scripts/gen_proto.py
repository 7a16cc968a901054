"""Regenerate the `kvstore_pb` package from `proto/`.

Usage: python scripts/gen_proto.py [--out DIR]

The generated modules are committed; `tests/unit/test_proto_fresh.py` regenerates them into a
temporary folder and fails when the committed copy differs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every .proto under proto/kvstore_pb into out_dir; return the files written."""
    from grpc_tools import protoc  # dev dependency

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvstore_pb").glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    # the mypy plugins live next to this interpreter
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out_dir / "kvstore_pb").glob("*_pb2*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    ns = parser.parse_args()
    for path in generate(ns.out):
        print(path.relative_to(ns.out), file=sys.stderr)


if __name__ == "__main__":
    main()
