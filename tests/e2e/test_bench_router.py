"""`strata bench router` on the tiny preset with tiny sizes: the JSON has every field, the counts
that do not depend on the machine's speed are exact (every request of every policy answered, the
workload's request count, the decision rate measured over real decisions), and the timings are
positive. Which policy or path is faster is the benchmark's answer, not something a loaded CI
machine can promise, so no timing is compared here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtests.bench_router import Dist, main
from loadtests.router_latency import PATHS, Interval
from loadtests.workload import generate_requests, load_workload

pytestmark = pytest.mark.e2e

WORKLOAD = Path(__file__).resolve().parents[2] / "loadtests" / "workloads" / "router_bench.toml"


def test_dist_nearest_rank_and_empty() -> None:
    d = Dist.of([0.001 * i for i in range(1, 101)])
    assert (d.count, d.p50_ms, d.p90_ms, d.p99_ms) == (100, pytest.approx(50.5), 90.0, 99.0)
    assert math.isnan(Dist.of([]).p50_ms)


def test_interval_is_the_median_with_a_seeded_bootstrap_around_it() -> None:
    values = [float(v) for v in range(1, 102)]  # median 51
    a = Interval.of(values, seed=3)
    assert (a.median, a.samples) == (51.0, 101)
    assert 40 < a.low < 51 < a.high < 62  # the median's spread, far inside the data's
    assert Interval.of(values, seed=3) == a  # seeded: the same interval every time
    tight = Interval.of([5.0] * 50 + [5.5] * 51)
    assert 5.0 <= tight.low <= tight.median == 5.5 <= tight.high <= 5.5
    assert math.isnan(Interval.of([]).median) and Interval.of([]).samples == 0


def test_bench_router_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "--preset", "tiny", "--prefill", "1", "--decode", "1", "--reps", "3",
        "--duration", "2", "--rate", "2", "--decision-seconds", "0.2", "--profile-source", "workers", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "streamed TTFT p50" in printed and "p50 vs round_robin" in printed
    data = json.loads(out.read_text())
    assert set(data) == {
        "config", "profile", "decisions", "added_latency", "workload", "policies",
        "prediction", "targets",
    }  # fmt: skip
    sent = len(generate_requests(load_workload(WORKLOAD), rate=2, duration_s=2))
    assert sent > 0
    assert set(data["policies"]) == {"strata", "round_robin", "least_load"}
    for run in data["policies"].values():
        assert (run["requests"], run["ok"], run["failed"]) == (sent, sent, 0), run["failures"]
        assert run["ttft"]["count"] == sent and run["ttft"]["p50_ms"] > 0
        assert sum(run["placements"].values()) == sent
    assert data["policies"]["round_robin"]["ttft_p50_vs_round_robin"] == 1.0
    dec = data["decisions"]
    assert dec["workers"] == 16 and dec["policy_alone_per_s"] > 0 and dec["core_decide_per_s"] > 0
    assert dec["policy_alone_candidates"] >= 8  # the winner and the pairs it beat
    added = data["added_latency"]
    assert (added["reps"], added["output_tokens"]) == (3, 2)
    assert added["prompt_tokens"] >= 256  # the text prompt, as the router tokenized it
    assert set(added["paths"]) == set(PATHS)
    for path in added["paths"].values():
        assert path["full_p50_ms"] > path["ttft_p50_ms"] > 0 and path["leaves_out"]
    for samples in added["samples_ms"].values():
        assert len(samples) == 3 and min(samples) > 0
    for client in ("router_httpx", "router_raw"):
        for part in ("non_streamed_ms", "streamed_ttft_ms", "streamed_ttft_ratio"):
            got = added["added"][client][part]
            assert got["samples"] == 3 and got["low"] <= got["median"] <= got["high"]
        assert added["added"][client]["streamed_ttft_ratio"]["median"] > 0
    cpu = added["router_cpu_ms_per_request"]
    assert cpu is None or -50 < cpu < 1000  # tick-resolution noise over 3 rounds, not a hang
    load = added["load_average"]
    assert len(load["start"]) == len(load["end"]) == 3 and min(load["start"]) >= 0
    assert added["rounds_s"] > 0
    assert data["profile"]["source"].startswith("measured")
    assert data["profile"]["prefill"]["per_token_s"] >= 0
    assert data["prediction"]["samples"] == sent
    assert data["prediction"]["router_tracker_median"] is not None
    assert set(data["targets"]) == {
        "added_p50_ms_non_streamed", "ttft_ratio_streamed", "added_p50_ms_non_streamed_raw",
        "ttft_ratio_streamed_raw", "decisions_per_s", "prediction_median_abs",
    }  # fmt: skip
    assert all(isinstance(t["met"], bool) for t in data["targets"].values())
