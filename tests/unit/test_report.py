"""Report metrics from hand-built records (known answers), the report files, `strata report`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtests.report import load_runs, run_metrics, write_report
from loadtests.report.compare import main as report_main
from loadtests.report.files import ReportError
from loadtests.report.metrics import goodput_rate, jain, percentile
from loadtests.report.records import Breakdown, ClassTarget, RequestRecord, RunResult, Sample
from loadtests.sim.validate import agreement, load_calibration, validation_table, verdict

pytestmark = pytest.mark.unit

CLASSES = (ClassTarget("fast", 0.5, 0.05), ClassTarget("slow", 2.0, 0.2))


def rec(
    i: int,
    cls: str,
    ttft: float,
    tpot: float,
    tokens: int = 11,
    status: str = "ok",
    lag: float = 0.0,
):
    t0 = float(i)
    first = t0 + ttft
    return RequestRecord(
        f"r{i}",
        cls,
        status,
        t0,
        t0 + lag,
        first_token_s=first if status == "ok" else math.nan,
        finish_s=first + tpot * (tokens - 1) if status == "ok" else math.nan,
        prompt_tokens=100,
        output_tokens=tokens if status == "ok" else 0,
        max_tokens=tokens,
        hit_tokens=(("dram", 64),) if status == "ok" else (),
        breakdown=Breakdown(queue_s=ttft / 2, prefill_s=ttft / 2, decode_s=tpot * (tokens - 1)),
        http_status=429 if status == "refused" else 200,
    )


def run(records, rate: float = 1.0, label: str = "run", duration: float = 10.0) -> RunResult:
    return RunResult(
        label,
        "sim",
        "w",
        rate,
        duration,
        CLASSES,
        tuple(records),
        samples=(Sample(0.0, 1, 2), Sample(1.0, 0, 3)),
        policy="p",
    )


def test_percentiles_and_jain() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50 and percentile(xs, 99) == 99 and percentile(xs, 100) == 100
    assert math.isnan(percentile([], 50))
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_metrics_per_class_and_overall() -> None:
    records = [
        rec(0, "fast", 0.2, 0.01),  # meets fast
        rec(1, "fast", 0.8, 0.01),  # TTFT too slow for fast
        rec(2, "fast", 0.1, 0.10),  # TPOT too slow for fast
        rec(3, "fast", 0.1, 0.0, status="refused"),
        rec(4, "slow", 1.5, 0.1),  # meets slow
        rec(5, "slow", 0.1, 0.0, status="timeout"),
        rec(6, "slow", 0.1, 0.0, status="failed"),
        rec(7, "slow", 1.0, 0.15),  # meets slow
    ]
    m = run_metrics(run(records))
    fast, slow = m.classes
    assert (fast.requests, fast.ok, fast.refused) == (4, 3, 1)
    assert (slow.timed_out, slow.failed) == (1, 1)
    assert fast.attainment == pytest.approx(1 / 4)  # refused ones count against attainment
    assert slow.attainment == pytest.approx(2 / 4)
    assert m.overall.attainment == pytest.approx(3 / 8)
    assert m.overall.goodput_rps == pytest.approx(3 / 10)
    assert fast.ttft.mean == pytest.approx((0.2 + 0.8 + 0.1) / 3)
    assert fast.tpot.p50 == pytest.approx(0.01)
    assert slow.e2e.p99 == pytest.approx(1.5 + 0.1 * 10)
    assert m.overall.hit_tokens["dram"] == 5 * 64 and m.overall.hit_ratio == pytest.approx(64 / 100)
    assert fast.breakdown["queue_s"] == pytest.approx(fast.ttft.mean / 2)
    assert m.fairness == pytest.approx(jain([0.25, 0.5]))
    assert m.valid


def test_a_client_that_fell_behind_makes_the_run_invalid() -> None:
    lagging = [rec(i, "fast", 0.1, 0.01, lag=0.5) for i in range(10)]
    assert not run_metrics(run(lagging)).valid
    late_sends = [rec(i, "fast", 0.1, 0.01, lag=0.0) for i in range(10)]
    assert run_metrics(run(late_sends)).valid


def test_goodput_of_a_sweep_is_the_highest_rate_meeting_the_goal() -> None:
    good = [rec(i, "fast", 0.1, 0.01) for i in range(10)]
    bad = [rec(i, "fast", 0.9, 0.01) for i in range(10)]
    sweep = [run(good, 1.0), run(good, 2.0), run(bad, 4.0)]
    assert goodput_rate(sweep) == 2.0
    assert goodput_rate([run(bad, 1.0)]) == 0.0


def test_report_files_round_trip_and_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = run([rec(i, "fast", 0.1 * (i % 3 + 1), 0.01) for i in range(10)], 1.0, "a")
    b = run([rec(i, "slow", 0.3, 0.02) for i in range(10)], 2.0, "b")
    paths = write_report([a, b], tmp_path / "one", "Title")
    back = load_runs(paths["json"])
    assert [r.to_json() for r in back] == [a.to_json(), b.to_json()]
    md = paths["markdown"].read_text()
    assert (
        md.startswith("# Title")
        and "| a |" in md
        and "Where the time went" in md
        and "Goodput" in md
    )
    for name in ("latency_cdf", "hits", "queue", "load", "goodput"):
        assert (tmp_path / "one" / "plots" / f"{name}.png").stat().st_size > 1000
    write_report([a], tmp_path / "two", "Other", plots=False)
    assert report_main([str(tmp_path / "one"), str(tmp_path / "two" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "a (one)" in out and "a (two)" in out and "| b |" in out
    assert report_main([str(tmp_path / "missing.json")]) == 2


def test_not_a_report_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ReportError, match="not a Strata report"):
        load_runs(p)
    p.write_text("{")
    with pytest.raises(ReportError, match="not JSON"):
        load_runs(p)


def test_validation_table_marks_each_point_and_counts_them(tmp_path: Path) -> None:
    live = [
        run([rec(i, "fast", 0.1, 0.02) for i in range(10)], 1.0, "live @ 1/s"),
        run([rec(i, "fast", 0.2, 0.02, lag=0.5) for i in range(10)], 2.0, "live @ 2/s"),
    ]
    sim = [
        run([rec(i, "fast", 0.12, 0.03) for i in range(10)], 1.0, "sim @ 1/s"),  # +20%, +50%
        run([rec(i, "fast", 0.1, 0.02) for i in range(10)], 2.0, "sim @ 2/s"),  # -50%, 0%
    ]
    points = agreement(live, sim)
    assert [(r, m, ok) for r, m, _, _, ok in points] == [
        (1.0, "TTFT p50", True),
        (1.0, "TPOT p50", False),
        (2.0, "TTFT p50", False),
        (2.0, "TPOT p50", True),
    ]
    assert verdict(live, sim) == (2, 4)
    table = validation_table(live, sim)
    assert table.count("| yes |") == 2 and table.count("| NO |") == 2
    assert "2 (live INVALID: client behind)" in table  # the lagging live run is marked
    assert "1 (live INVALID" not in table
    good = tmp_path / "calibration.json"
    entry = {"rate": 1.0, "terms": {"handoff_s": 0.04, "decode_contention": 1.5}, "model": "m.json"}
    good.write_text(json.dumps({"rates": [entry]}))
    (cal,) = load_calibration(good)
    assert cal.rate == 1.0 and cal.terms == {"handoff_s": 0.04, "decode_contention": 1.5}
    assert cal.model_path == str(tmp_path / "m.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rates": [{**entry, "terms": {"warp_factor": 9}}]}))
    with pytest.raises(ValueError, match="unknown terms"):
        load_calibration(bad)
    with pytest.raises(ValueError, match="not a calibration"):
        load_calibration(tmp_path / "missing.json")
