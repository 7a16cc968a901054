"""`strata fuzz`: longer fuzzing campaigns than the test suite's short runs.

    strata fuzz [page] [--target page|rpc|lane|tcp] [--seconds 600] [--runs N] [--corpus DIR]
                [--jobs N] [--artifacts DIR] [--auth]
        a coverage-guided (atheris / libFuzzer) campaign; crashes are written as crash-* files
        under --artifacts. Targets: the page codec (tests/fuzz/page_target.py), or a live
        daemon's gRPC request bytes, same-host lane frames or TCP data-path frames
        (tests/fuzz/rpc_target.py; the daemon runs in the fuzzing process, on loopback; with
        --auth it checks principals, and lane / TCP inputs may start with a valid HELLO)
    strata fuzz props [--target page|rpc] [--examples 20000]
        the property-based (hypothesis) tests with more examples, randomized: the page codec
        (tests/unit/test_page_fuzz.py) or every RPC against a `strata serve` child
        (tests/integration/test_rpc_fuzz.py)

All run in the repository checkout (they need tests/); the exit code is the campaign's: 0 when
nothing was found.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = {
    "page": REPO / "tests" / "fuzz" / "page_target.py",
    "rpc": REPO / "tests" / "fuzz" / "rpc_target.py",
    "lane": REPO / "tests" / "fuzz" / "rpc_target.py",
    "tcp": REPO / "tests" / "fuzz" / "rpc_target.py",
}
PROPS = {
    "page": REPO / "tests" / "unit" / "test_page_fuzz.py",
    "rpc": REPO / "tests" / "integration" / "test_rpc_fuzz.py",
}
MAX_LEN = {"page": 400, "rpc": 4000, "lane": 4000, "tcp": 4000}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata fuzz", description="Fuzz the page codec or a live daemon for longer."
    )
    sub = p.add_subparsers(dest="what", required=True)
    page = sub.add_parser("page", help="a coverage-guided (atheris) campaign (the default)")
    page.add_argument("--target", choices=sorted(TARGETS), default="page")
    page.add_argument("--seconds", type=int, default=600, help="total time (default 600)")
    page.add_argument("--runs", type=int, default=0, help="stop after N inputs (0: no limit)")
    page.add_argument("--corpus", type=Path, default=None, help="default fuzz-corpus/<target>")
    page.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"))
    page.add_argument("--jobs", type=int, default=1, help="parallel fuzzing processes")
    page.add_argument(
        "--auth", action="store_true", help="rpc|lane|tcp: the daemon checks principals' tokens"
    )
    props = sub.add_parser("props", help="the hypothesis properties, more examples")
    props.add_argument("--target", choices=sorted(PROPS), default="page")
    props.add_argument("--examples", type=int, default=20000)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args.insert(0, "page")  # `strata fuzz --target rpc ...`
    ns = build_parser().parse_args(args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if ns.what == "props":
        if not PROPS[ns.target].exists():
            print("strata fuzz: needs the repository checkout (tests/ is missing)", file=sys.stderr)
            return 2
        env["STRATA_FUZZ_EXAMPLES"] = str(ns.examples)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s"]
        return subprocess.run([*cmd, str(PROPS[ns.target])], env=env, cwd=REPO).returncode
    target = TARGETS[ns.target]
    if not target.exists():
        print("strata fuzz: needs the repository checkout (tests/fuzz is missing)", file=sys.stderr)
        return 2
    env["STRATA_FUZZ_TARGET"] = ns.target
    env["STRATA_FUZZ_AUTH"] = "1" if ns.auth else "0"
    corpus = ns.corpus or Path("fuzz-corpus") / ns.target
    corpus.mkdir(parents=True, exist_ok=True)
    ns.artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(target),
        f"-max_total_time={ns.seconds}",
        f"-max_len={MAX_LEN[ns.target]}",
        f"-artifact_prefix={ns.artifacts.resolve()}/",
        str(corpus.resolve()),
    ]
    if ns.runs:
        cmd.insert(2, f"-runs={ns.runs}")
    if ns.jobs > 1:
        cmd.insert(2, f"-jobs={ns.jobs}")
        cmd.insert(2, f"-workers={ns.jobs}")
    print("strata fuzz:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode
