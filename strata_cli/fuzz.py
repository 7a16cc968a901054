"""`strata fuzz`: longer fuzzing campaigns than the test suite's short runs.

    strata fuzz page  [--seconds 600] [--runs N] [--corpus DIR] [--jobs N]
        the coverage-guided (atheris / libFuzzer) target over the page codec,
        tests/fuzz/page_target.py; crashes are written as crash-* files under --artifacts
    strata fuzz props [--examples 20000]
        the property-based (hypothesis) page-codec tests with more examples, randomized

Both run in the repository checkout (they need tests/); the exit code is the campaign's: 0 when
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
TARGET = REPO / "tests" / "fuzz" / "page_target.py"
PROPS = REPO / "tests" / "unit" / "test_page_fuzz.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata fuzz", description="Fuzz the page codec for longer.")
    sub = p.add_subparsers(dest="what", required=True)
    page = sub.add_parser("page", help="coverage-guided (atheris) run over the page codec")
    page.add_argument("--seconds", type=int, default=600, help="total time (default 600)")
    page.add_argument("--runs", type=int, default=0, help="stop after N inputs (0: no limit)")
    page.add_argument("--corpus", type=Path, default=Path("fuzz-corpus/page"))
    page.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"))
    page.add_argument("--jobs", type=int, default=1, help="parallel fuzzing processes")
    props = sub.add_parser("props", help="the hypothesis page-codec properties, more examples")
    props.add_argument("--examples", type=int, default=20000)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if not TARGET.exists():
        print("strata fuzz: needs the repository checkout (tests/fuzz is missing)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if ns.what == "props":
        env["STRATA_FUZZ_EXAMPLES"] = str(ns.examples)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROPS)]
        return subprocess.run(cmd, env=env, cwd=REPO).returncode
    ns.corpus.mkdir(parents=True, exist_ok=True)
    ns.artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(TARGET),
        f"-max_total_time={ns.seconds}",
        "-max_len=400",
        f"-artifact_prefix={ns.artifacts.resolve()}/",
        str(ns.corpus.resolve()),
    ]
    if ns.runs:
        cmd.insert(2, f"-runs={ns.runs}")
    if ns.jobs > 1:
        cmd.insert(2, f"-jobs={ns.jobs}")
        cmd.insert(2, f"-workers={ns.jobs}")
    print("strata fuzz:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode
