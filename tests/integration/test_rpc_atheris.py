"""Short coverage-guided (atheris) runs of tests/fuzz/rpc_target.py against a live daemon, one
per way in: gRPC request bytes, same-host lane frames, TCP data-path frames. Each run starts
from seeds of well-formed calls, must finish its inputs without a finding (an unclean answer, a
hang, a daemon that stops answering or logs an error), and ends with the store's integrity
check, an audit of every page served and the legitimate tenant's pages read back (every
`STRATA_FUZZ_AUDIT_EVERY` inputs: the run's count is a multiple of it). A planted failure shows
the harness reports one. Longer campaigns: `strata fuzz --target rpc|lane|tcp --seconds N`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "fuzz" / "rpc_target.py"
# inputs per run, and whether the daemon checks principals (then lane and TCP inputs choose
# whether a HELLO with the fuzzer's token comes first): the rpc run covers the open daemon,
# the hypothesis run (test_rpc_fuzz.py) gRPC with principals
RUNS = {"rpc": (1200, False), "lane": (3000, True), "tcp": (3000, True)}
AUDIT_EVERY = 600


def fuzz(
    target: str, tmp: Path, *flags: str, auth: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # Through a small shell that forks it: on Linux a process keeps the peak RSS of the process
    # it was forked from across exec, so a fuzzer exec'd straight from this (large) test process
    # would start above libFuzzer's 2 GiB rss limit and report an out-of-memory at once.
    return subprocess.run(
        ["sh", "-c", '"$@"; status=$?; exit $status', "sh",
         sys.executable, str(TARGET), *flags, "-seed=1", "-max_len=2000",
         f"-artifact_prefix={tmp}/", str(tmp / "corpus")],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "STRATA_FUZZ_TARGET": target,
            "STRATA_FUZZ_AUDIT_EVERY": str(AUDIT_EVERY),
            "STRATA_FUZZ_AUTH": "1" if auth else "0",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip


@pytest.mark.parametrize("target", sorted(RUNS))
def test_a_bounded_atheris_run_finds_nothing(tmp_path: Path, target: str) -> None:
    runs, auth = RUNS[target]
    done = fuzz(target, tmp_path, f"-runs={runs}", auth=auth)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert f"Done {runs} runs" in done.stderr
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir())  # seeds were written


def test_the_harness_reports_a_planted_failure(tmp_path: Path) -> None:
    crashed = fuzz("rpc", tmp_path, "-runs=200", env={"STRATA_FUZZ_SELF_TEST": "1"})
    assert crashed.returncode != 0
    assert "self test: an answered NodeInfo counts as a failure" in crashed.stdout + crashed.stderr
    assert any(p.name.startswith("crash-") for p in tmp_path.iterdir())
