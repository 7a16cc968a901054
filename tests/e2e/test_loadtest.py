"""`strata loadtest --up` end to end: a fresh `strata up --preset tiny`, a short open-loop run,
and a complete report (every request, Markdown, plots), then nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.router.core import DecodeCoeffs, PrefillCoeffs, TimeModel
from loadtests.report.files import load_runs
from loadtests.report.metrics import run_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_loadtest_against_a_fresh_strata_up_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    # A time model given to `strata up` (explicit coefficients) skips its first-run profiling:
    # this test is about the load test, and the router only needs some model to price with.
    profile = tmp_path / "profile.json"
    TimeModel(
        prefill=PrefillCoeffs(0.01, 1e-4, 0.0, 0.0), decode=DecodeCoeffs(0.002, 0.002, 1e-7)
    ).save(profile)
    up_args = f"--preset tiny --port 0 --max-context 1024 --ssd 0 --profile {profile}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata_cli.main",
            "loadtest",
            str(ROOT / "loadtests/workloads/tiny.toml"),
            "--up",
            f"--up-args={up_args}",  # "=": the value starts with a dash
            "--duration",
            "6",
            "--rates",
            "1",
            "--out",
            str(out),
            "--progress-s",
            "2",
            "--request-timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "Strata is up at" in log and "no process or shared-memory segment left" in log
    assert "sent " in log and "in flight" in log  # progress lines
    runs = load_runs(out / "report.json")
    assert len(runs) == 1
    run = runs[0]
    doc = json.loads((out / "report.json").read_text())
    assert len(doc["runs"][0]["records"]) == len(run.records) > 0
    assert all(r.status in ("ok", "refused", "timeout", "failed") for r in run.records)
    ok = [r for r in run.records if r.status == "ok"]
    assert ok, [r.error for r in run.records]
    for r in ok:
        assert r.intended_s <= r.sent_s <= r.first_token_s <= r.finish_s
        assert r.output_tokens == r.max_tokens
        assert len(r.token_gaps_s) == r.output_tokens - 1
        # the router's strata_timings split the latency: the parts add up to the end-to-end
        b = r.breakdown
        parts = b.queue_s + b.prefill_s + b.pull_s + b.decode_queue_s + b.decode_s + b.other_s
        assert parts == pytest.approx(r.finish_s - r.intended_s, rel=1e-6, abs=1e-6)
    assert any(r.breakdown.prefill_s > 0 and r.breakdown.other_s > 0 for r in ok)
    assert run.bytes_moved > 0  # the store daemon's counters over the run (its pages came in)
    m = run_metrics(run)
    assert m.overall.requests == len(run.records) and m.overall.ttft.p50 > 0
    md = (out / "report.md").read_text()
    assert "## Latency and SLOs per class" in md and "live @ 1/s" in md
    for png in ("latency_cdf", "hits", "queue"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 1000
