"""`strata bench decisions` (loadtests.router_decisions): a short real run, its table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.router_decisions import main, measure_one

pytestmark = pytest.mark.unit


def test_a_short_run_reports_wall_and_cpu_rates_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decisions.json"
    argv = ["--seconds", "0.02", "--rounds", "2", "--policies", "strata,round_robin"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per CPU second" in printed and "vs round_robin" in printed
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert set(rows) == {
        "strata/alone", "round_robin/alone", "strata/explain", "strata/decide", "strata/colocated",
    }  # fmt: skip
    for row in rows.values():
        assert len(row["rounds"]) == 2
        assert row["per_s"] > 0 and row["per_cpu_s"] > 0 and row["cpu_us_per_decision"] > 0
    assert rows["round_robin/alone"]["cpu_vs_round_robin"] == 1.0
    assert rows["round_robin/alone"]["candidates_per_decision"] == 1.0
    assert rows["strata/alone"]["candidates_per_decision"] >= 8  # the winner and those it beat
    assert set(data["targets"]) == {"strata_per_s", "strata_per_cpu_s"}
    assert all(isinstance(t["met"], bool) for t in data["targets"].values())


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--policies", "fastest"]) == 2
    assert "unknown policy fastest" in capsys.readouterr().err
    assert main(["--rounds", "0"]) == 2
    with pytest.raises(ValueError, match="unknown mode"):
        measure_one(mode="sideways")


def test_the_explain_mode_makes_the_same_decisions() -> None:
    """The explain mode turns every decision into its record, from the same seed and inputs
    as the policy alone: as many decisions, as many candidates each."""
    alone = measure_one(mode="alone", min_seconds=0.0, max_decisions=64)
    told = measure_one(mode="explain", min_seconds=0.0, max_decisions=64)
    assert alone.decisions == told.decisions == 64
    assert alone.candidates_per_decision == told.candidates_per_decision
    assert alone.cpu_seconds > 0 and told.cpu_seconds > 0
