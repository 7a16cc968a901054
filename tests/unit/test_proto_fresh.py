"""The committed kvstore_pb/*_pb2* modules are exactly what scripts/gen_proto.py makes today."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED = REPO_ROOT / "kvstore_pb"
HOW_TO_FIX = "run `python scripts/gen_proto.py` and commit kvstore_pb/"


def _gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_proto", REPO_ROOT / "scripts" / "gen_proto.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*_pb2*") if p.suffix in (".py", ".pyi")}


def _stale(committed: Path, fresh: Path) -> list[str]:
    """Problems that make the committed folder differ from a fresh generation; [] when none."""
    committed_names = _generated_names(committed)
    fresh_names = _generated_names(fresh)
    problems = [
        f"kvstore_pb/{name} is not generated from proto/ any more"
        for name in sorted(committed_names - fresh_names)
    ]
    problems += [f"kvstore_pb/{name} is missing" for name in sorted(fresh_names - committed_names)]
    problems += [
        f"kvstore_pb/{name} is out of date"
        for name in sorted(committed_names & fresh_names)
        if (committed / name).read_bytes() != (fresh / name).read_bytes()
    ]
    return problems


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen_proto")
    path = os.environ.get("PATH", "")
    try:
        written = _gen_proto().generate(out_dir=out)
    finally:
        os.environ["PATH"] = path  # generate() prepends the venv's bin for the mypy plugins
    assert written, "gen_proto.generate wrote nothing"
    assert {p.name for p in written} == _generated_names(out / "kvstore_pb")
    return out / "kvstore_pb"


def test_generated_code_is_fresh(fresh: Path) -> None:
    names = _generated_names(fresh)
    assert {"store_pb2.py", "store_pb2.pyi", "store_pb2_grpc.py", "store_pb2_grpc.pyi"} <= names
    problems = _stale(COMMITTED, fresh)
    assert not problems, "; ".join(problems) + f": {HOW_TO_FIX}"


def test_a_stale_copy_is_reported(fresh: Path, tmp_path: Path) -> None:
    copy = tmp_path / "kvstore_pb"
    shutil.copytree(fresh, copy)
    assert _stale(copy, fresh) == []
    with (copy / "store_pb2.py").open("a") as fh:
        fh.write("# edited by hand\n")
    (copy / "store_pb2_grpc.pyi").unlink()
    (copy / "old_pb2.py").write_text("")
    assert _stale(copy, fresh) == [
        "kvstore_pb/old_pb2.py is not generated from proto/ any more",
        "kvstore_pb/store_pb2_grpc.pyi is missing",
        "kvstore_pb/store_pb2.py is out of date",
    ]


def test_every_proto_is_generated() -> None:
    protos = sorted(p.stem for p in (REPO_ROOT / "proto" / "kvstore_pb").glob("*.proto"))
    assert protos, "no .proto files under proto/kvstore_pb"
    for stem in protos:
        assert (COMMITTED / f"{stem}_pb2.py").is_file(), f"kvstore_pb/{stem}_pb2.py: {HOW_TO_FIX}"
