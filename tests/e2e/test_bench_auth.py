"""`strata bench auth` on a tiny size: both daemons (subprocesses) serve every page through the
SDK, with and without a token, and the JSON has a time and a ratio for each call kind. Timings
are only checked to be positive: whether the tokens cost anything measurable is the benchmark's
answer, not something a loaded CI machine can promise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench_auth import main

pytestmark = pytest.mark.e2e


def test_bench_auth_times_both_daemons(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "auth.json"
    assert main(["--pages", "2", "--rounds", "5", "--principals", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["pages"], report["rounds"], report["principals"]) == (2, 5, 3)
    for kind in ("lookup", "get"):
        for stat in ("", "_p10"):
            assert report[f"{kind}_open{stat}_us"] > 0 and report[f"{kind}_tokens{stat}_us"] > 0
            assert report[f"{kind}_tokens_over_open{stat}_ratio"] > 0
        assert report[f"{kind}_paired_ratio"] > 0
        for daemon in ("open", "tokens"):  # a percentile within the times, below the median
            assert 0 < report[f"{kind}_{daemon}_p10_us"] <= report[f"{kind}_{daemon}_us"]
    printed = capsys.readouterr().out
    assert "lookup median" in printed and "get    paired" in printed


def test_bench_auth_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
