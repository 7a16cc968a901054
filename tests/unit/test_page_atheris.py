"""A short coverage-guided (atheris) run over the page codec, in a subprocess: 20 000 inputs
from seeds of valid headers and pages must finish without a crash (an exception other than the
codec's typed errors, or a broken property; see tests/fuzz/page_target.py). A planted failure
shows the harness reports one. Longer campaigns: `strata fuzz --seconds 600`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "fuzz" / "page_target.py"


def fuzz(
    corpus: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # Forked by a small shell, not by this test process: Linux carries a process's peak RSS
    # across exec, and libFuzzer would count this (large) process's against its 2 GiB limit.
    return subprocess.run(
        [
            "sh",
            "-c",
            '"$@"; status=$?; exit $status',
            "sh",
            sys.executable,
            str(TARGET),
            *flags,
            "-max_len=400",
            "-seed=1",
            str(corpus),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_bounded_atheris_run_over_the_page_codec_finds_no_crash(tmp_path: Path) -> None:
    done = fuzz(tmp_path / "corpus", "-runs=20000")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 20000 runs" in done.stderr
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir())[:3]  # seeds were written


def test_the_harness_reports_a_planted_failure(tmp_path: Path) -> None:
    crashed = fuzz(
        tmp_path / "corpus",
        "-runs=2000",
        f"-artifact_prefix={tmp_path}/",
        env={"STRATA_FUZZ_SELF_TEST": "1"},
    )
    assert crashed.returncode != 0
    assert "self test: a valid header counts as a failure" in crashed.stdout + crashed.stderr
    assert any(p.name.startswith("crash-") for p in tmp_path.iterdir())
