"""`strata loadtest --up` end to end: a fresh `strata up --preset tiny`, a short open-loop run,
and a complete report (every request, Markdown, plots), then nothing left running; and the
goodput search (`--search`) against a local fake server with a known capacity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class _Capacity:
    """A fake OpenAI server with a capacity: each request's first token takes longer the more
    requests are in flight (0.05 s + 0.06 s per other request), so a low rate meets the tiny
    workload's 1 s TTFT target and a high one does not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0


def _capacity_server() -> tuple[ThreadingHTTPServer, str]:
    state = _Capacity()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            data = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                others = state.in_flight
                state.in_flight += 1
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                time.sleep(0.05 + 0.06 * others)
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "text": "t", "token_ids": [5 + i]}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.002)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            finally:
                with state.lock:
                    state.in_flight -= 1
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_goodput_search_against_a_server_with_a_capacity(tmp_path: Path) -> None:
    server, url = _capacity_server()
    out = tmp_path / "search"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "strata_cli.main",
                "loadtest",
                str(ROOT / "loadtests/workloads/tiny.toml"),
                "--url",
                url,
                "--search",
                "--search-low",
                "1",
                "--search-high",
                "60",
                "--search-steps",
                "3",
                "--duration",
                "3",
                "--warmup",
                "0",
                "--max-lag-ms",
                "1000",
                "--request-timeout",
                "20",
                "--out",
                str(out),
                "--no-plots",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        server.shutdown()
        server.server_close()
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    steps = [line for line in log.splitlines() if line.startswith("search step ")]
    assert len(steps) == 3, log[-3000:]  # one progress line per step, never more than asked
    assert "1/s" in steps[0] and "meets" in steps[0]  # 1/s: a request or two in flight
    assert "60/s" in steps[1] and "misses" in steps[1]  # 60/s: the queue grows past 1 s
    assert "30.5/s" in steps[2]  # bisection between them
    runs = load_runs(out / "report.json")
    assert [r.target_rate for r in runs] == [1.0, 60.0, 30.5]
    best = max(r.target_rate for r in runs if run_metrics(r).overall.attainment >= 0.9)
    assert f"goodput {best:.3g}/s" in log
    assert "## Goodput search" in (out / "report.md").read_text()
