"""The open-loop scheduler keeps its schedule against a deliberately slow server and reports lag;
a closed loop (one request at a time) against the same server falls behind and is marked invalid.
The server is a tiny local HTTP server started here that streams OpenAI-style SSE slowly."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.router.core import DecodeCoeffs, PrefillCoeffs, PullCoeffs, TimeModel
from loadtests.live.http_user import (
    Sent,
    completion_body,
    post_completion,
    split_latency,
    split_whole,
    stream_completion,
)
from loadtests.live.openloop import OpenLoop
from loadtests.live.runner import shift_tokens
from loadtests.live.search import Probe, SearchError, check_range, goodput, next_rate
from loadtests.live.target import TargetError, store_counters
from loadtests.report.metrics import meets, run_metrics
from loadtests.report.records import ClassTarget, RequestRecord, RunResult

pytestmark = pytest.mark.unit

FIRST_TOKEN_DELAY_S = 0.3
TOKEN_GAP_S = 0.02
TIMINGS_MS = {
    "prefill_queue_ms": 100.0,
    "lookup_ms": 5.0,
    "prefill_pull_ms": 15.0,
    "prefill_compute_ms": 150.0,
    "decode_queue_ms": 10.0,
    "decode_pull_ms": 5.0,
}


class SlowHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"][0] == 0:  # the test's marker for "refuse this one"
            msg = b'{"error": {"message": "overloaded", "type": "rate_limited"}}'
            self.send_response(429)
            self.send_header("Content-Length", str(len(msg)))
            self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(msg)
            return
        if body.get("stream") is False:  # a whole answer, the split in its body
            time.sleep(FIRST_TOKEN_DELAY_S + TOKEN_GAP_S * body["max_tokens"])
            whole = {
                "choices": [{"index": 0, "text": "t", "token_ids": [5] * body["max_tokens"]}],
                "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]},
                "strata_timings": {**TIMINGS_MS, "decode_ms": 60.0},
            }
            if body["prompt"][0] == 1:  # the test's marker for "another server": no split
                del whole["strata_timings"]
            data = json.dumps(whole).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(FIRST_TOKEN_DELAY_S)
        n = body["max_tokens"]
        for i in range(n):
            chunk: dict[str, object] = {
                "choices": [{"index": 0, "text": f"t{i}", "token_ids": [5 + i]}]
            }
            if i == n - 1:  # as a Strata router does: the workers' split on the last chunk
                chunk["strata_timings"] = TIMINGS_MS
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(TOKEN_GAP_S)
        prompt = body["prompt"]
        cached = 2 if len(prompt) <= 3 else (len(prompt) // 2) // 16 * 16
        usage = {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": n,
                # 2 of the tests' 3-token prompts; of a longer one, its first half's pages
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def slow_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def run_schedule(
    base: str, times: list[float], *, closed_loop: bool, refuse: set[int] = frozenset()
):
    records: dict[int, RequestRecord] = {}
    lock = threading.Lock()
    http = httpx.Client()

    def fire(i: int, intended: float, sent: float) -> None:
        prompt = [0, 1, 2] if i in refuse else [7, 8, 9]
        body = completion_body("m", prompt, 4)
        rec = stream_completion(
            http, base, body, Sent(f"r{i}", "c", intended, sent, 3, 4), loop.now, timeout_s=10
        )
        with lock:
            records[i] = rec

    def inline(fn):  # a closed loop: the next request waits for this one
        fn()

    kwargs = {"spawn": inline} if closed_loop else {}
    # This machine is shared and noisy (a thread start can take a while), so with a real server
    # the open loop is judged as "lag stays bounded" against the closed loop's lag that keeps
    # growing; the exact schedule is checked on a virtual clock below.
    loop = OpenLoop(times, fire, max_lag_s=1.0, **kwargs)
    schedule = loop.run()
    deadline = time.monotonic() + 20
    while len(records) < schedule.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    http.close()
    return schedule, [records[i] for i in sorted(records)]


def test_open_loop_keeps_its_schedule_against_a_slow_server(slow_server: str) -> None:
    times = [i * 0.05 for i in range(30)]  # 20/s for 1.5 s; each answer takes ≥ 0.38 s
    schedule, records = run_schedule(slow_server, times, closed_loop=False, refuse={4})
    assert schedule.sent == 30 and not schedule.behind
    assert len(records) == 30
    for rec in records:
        assert rec.sent_s - rec.intended_s < 1.0
        if rec.request_id == "r4":
            assert rec.status == "refused" and rec.http_status == 429
            continue
        assert rec.status == "ok", rec.error
        assert rec.output_tokens == 4 and len(rec.token_gaps_s) == 3
        assert rec.ttft_s >= FIRST_TOKEN_DELAY_S - 0.01
        assert sum(rec.token_gaps_s) == pytest.approx(rec.finish_s - rec.first_token_s)
        assert rec.hit("unknown") == 2
        b = rec.breakdown
        assert (b.queue_s, b.prefill_s) == pytest.approx((0.1, 0.15))
        decode_total = rec.finish_s - rec.first_token_s
        if decode_total >= 0.015:  # a loaded client may read the chunks in one burst
            assert (b.pull_s, b.decode_queue_s) == pytest.approx((0.025, 0.01))
        assert b.pull_s + b.decode_queue_s + b.decode_s == pytest.approx(0.02 + decode_total)
        parts = b.queue_s + b.prefill_s + b.pull_s + b.decode_queue_s + b.decode_s + b.other_s
        assert parts == pytest.approx(rec.finish_s - rec.intended_s)
        assert b.other_s == pytest.approx(rec.ttft_s - 0.27)
    # With 30 requests in 1.5 s and 0.38 s each, many overlapped: the client did not wait.
    starts = sorted(r.sent_s for r in records)
    assert starts[-1] - starts[0] < 1.6


def test_closed_loop_falls_behind_and_the_run_is_marked_invalid(slow_server: str) -> None:
    times = [i * 0.05 for i in range(8)]
    schedule, records = run_schedule(slow_server, times, closed_loop=True)
    assert schedule.behind
    assert schedule.max_lag_s > 1.5  # the sixth request left ~5 x 0.38 s late
    # latencies count from the intended send time, so the lag shows in TTFT
    assert records[-1].ttft_s > records[-1].lag_s + FIRST_TOKEN_DELAY_S - 0.01
    run = RunResult("closed", "live", "w", 20.0, 0.3, (ClassTarget("c", 1.0, 0.1),), tuple(records))
    assert not run_metrics(run).valid
    run_ok = RunResult(
        "open",
        "live",
        "w",
        20.0,
        0.3,
        (ClassTarget("c", 1.0, 0.1),),
        tuple(
            RequestRecord(
                r.request_id,
                r.slo_class,
                r.status,
                r.intended_s,
                r.intended_s,
                r.first_token_s,
                r.finish_s,
                3,
                4,
                4,
            )
            for r in records
        ),
    )
    assert run_metrics(run_ok).valid


def test_an_unsorted_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        OpenLoop([1.0, 0.5], lambda i, t, s: None)


class VirtualClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_on_a_virtual_clock_the_open_loop_sends_exactly_on_schedule() -> None:
    clock = VirtualClock()
    times = [i * 0.05 for i in range(40)]
    pending: list[object] = []  # a server that never answers: nothing ever completes
    sent: list[tuple[int, float, float]] = []
    loop = OpenLoop(
        times,
        lambda i, t, s: sent.append((i, t, s)),
        spawn=pending.append,
        clock=clock,
        sleep=clock.sleep,
    )
    schedule = loop.run()
    assert schedule.sent == 40 and schedule.max_lag_s < 1e-9 and not schedule.behind
    assert len(pending) == 40  # every request left although none was answered


def test_on_a_virtual_clock_a_closed_loop_lags_by_the_service_time() -> None:
    clock = VirtualClock()
    times = [i * 0.05 for i in range(10)]

    def slow_fire(i: int, t: float, s: float) -> None:
        clock.sleep(0.4)  # each answer takes 0.4 s and the next send waits for it

    loop = OpenLoop(times, slow_fire, spawn=lambda fn: fn(), clock=clock, sleep=clock.sleep)
    schedule = loop.run()
    assert schedule.lags_s == pytest.approx([i * 0.35 for i in range(10)])
    assert schedule.behind and schedule.max_lag_s == pytest.approx(3.15)


def test_latency_split_of_co_located_and_other_servers() -> None:
    # co-located: only the decode worker reports; its queue and pull come before the first token
    b = split_latency({"decode_queue_ms": 40.0, "decode_pull_ms": 10.0}, 0.2, 0.5)
    assert (b.queue_s, b.pull_s, b.prefill_s, b.decode_s) == pytest.approx((0.04, 0.01, 0.15, 0.5))
    # a report larger than the TTFT itself is clipped, never a negative part
    b = split_latency({"decode_queue_ms": 400.0}, 0.2, 0.5)
    assert (b.queue_s, b.prefill_s) == pytest.approx((0.2, 0.0))
    # another server: TTFT and decode only
    b = split_latency({}, 0.2, 0.5)
    assert (b.queue_s, b.prefill_s, b.decode_s, b.other_s) == (0.0, 0.2, 0.5, 0.0)


def test_store_counters_sum_bytes_and_evictions_from_prometheus_text() -> None:
    text = (
        b"# HELP strata_bytes_total Payload bytes moved\n"
        b"# TYPE strata_bytes_total counter\n"
        b'strata_bytes_total{path="shm",direction="in",io_class="foreground"} 1024.0\n'
        b'strata_bytes_total{path="tcp",direction="out",io_class="background"} 2048.0\n'
        b'strata_evictions_total{tier="dram"} 3.0\n'
        b'strata_evictions_total{tier="ssd"} 4.0\n'
        b"strata_lookups_total 99.0\n"
    )

    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            ok = self.path == "/metrics"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(text) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(text)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert store_counters(f"{base}/metrics") == (3072, 7)
        with pytest.raises(TargetError, match="metrics"):
            store_counters(f"{base}/nothing")
    finally:
        server.shutdown()
        server.server_close()


def test_non_streamed_requests_record_the_split_from_the_body(slow_server: str) -> None:
    http = httpx.Client()
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    body = completion_body("m", [7, 8, 9], 4, stream=False)
    assert body["stream"] is False and "stream_options" not in body
    rec = post_completion(http, slow_server, body, Sent("r", "c", 0.0, 0.0, 3, 4), now)
    assert rec.status == "ok" and rec.output_tokens == 4
    assert math.isnan(rec.first_token_s) and rec.e2e_s >= FIRST_TOKEN_DELAY_S
    b = rec.breakdown
    assert (b.queue_s, b.prefill_s, b.decode_queue_s, b.decode_s) == pytest.approx(
        (0.1, 0.15, 0.01, 0.06)
    )
    assert b.pull_s == pytest.approx(0.005 + 0.015 + 0.005)
    parts = b.queue_s + b.prefill_s + b.pull_s + b.decode_queue_s + b.decode_s + b.other_s
    assert parts == pytest.approx(rec.e2e_s) and b.other_s > 0
    # another server: no split in the body, the whole time is "other"
    other = post_completion(
        http,
        slow_server,
        completion_body("m", [1, 8, 9], 4, stream=False),
        Sent("r", "c", 0.0, 0.0, 3, 4),
        now,
    )
    assert other.status == "ok" and other.breakdown.other_s == pytest.approx(other.e2e_s)
    refused = post_completion(
        http,
        slow_server,
        completion_body("m", [0, 1], 4, stream=False),
        Sent("r", "c", 0.0, 0.0, 2, 4),
        now,
    )
    assert refused.status == "refused" and refused.http_status == 429
    http.close()
    # judged on end to end against both budgets; no TTFT or TPOT in the metrics
    assert meets(rec, 1.0, 0.1) and not meets(rec, 0.1, 0.01)
    run = RunResult("x", "live", "w", 1.0, 1.0, (ClassTarget("c", 1.0, 0.1),), (rec,))
    m = run_metrics(run).overall
    assert m.ok == 1 and math.isnan(m.ttft.p50) and m.e2e.p50 == pytest.approx(rec.e2e_s)
    assert m.attainment == 1.0


def test_split_whole_clips_a_report_longer_than_the_request() -> None:
    b = split_whole({"prefill_compute_ms": 500.0, "decode_queue_ms": 100.0}, 0.2)
    assert (b.prefill_s, b.decode_queue_s, b.decode_s, b.other_s) == pytest.approx((0.2, 0, 0, 0))


def _probes(limit: float, low: float, high: float, steps: int, invalid: float = -1.0):
    done: list[Probe] = []
    while (rate := next_rate(low, high, steps, done)) is not None:
        done.append(Probe(rate, 1.0 if rate <= limit else 0.5, rate != invalid))
    return done


def test_goodput_search_bisects_between_the_bounds_in_a_fixed_count_of_steps() -> None:
    done = _probes(3.0, 0.5, 8.0, 5)
    assert [p.rate for p in done] == pytest.approx([0.5, 8.0, 4.25, 2.375, 3.3125])
    assert goodput(done) == pytest.approx(2.375)
    # the low bound misses: one step, goodput 0; the high bound meets: two steps, goodput high
    assert [p.rate for p in _probes(0.1, 0.5, 8.0, 5)] == [0.5] and goodput(
        _probes(0.1, 0.5, 8.0, 5)
    ) == 0
    assert [p.rate for p in _probes(9.0, 0.5, 8.0, 5)] == [0.5, 8.0]
    # a run whose client fell behind cannot vouch for its rate: it counts as missing
    done = _probes(3.0, 0.5, 8.0, 4, invalid=2.375)
    assert goodput(done) == 0.5 and not done[-1].passed()
    for bad in ((0.0, 8.0, 5), (8.0, 0.5, 5), (0.5, 8.0, 1)):
        with pytest.raises(SearchError):
            check_range(*bad)


def test_fresh_prefixes_shift_ids_as_a_bijection() -> None:
    ids = [3, 4, 511, 100, 0]
    shifted = shift_tokens(ids, 100, 3, 512)
    assert shifted[4] == 0 and all(3 <= t < 512 for t in shifted[:4])
    assert shifted[:4] != ids[:4] and len(set(shifted[:4])) == 4
    assert shift_tokens(ids, 509, 3, 512) == ids  # a full turn
    back = shift_tokens(shifted, 509 - 100, 3, 512)
    assert back == ids


def test_calibration_measures_a_server_through_the_http_user(slow_server: str) -> None:
    # the slow server: 0.3 s to a first token, 0.02 s per token after it, and its strata_timings
    # say the prefill computed 150 ms, so 150 ms of every TTFT is the serving path
    from loadtests.live.calibrate import CalibrationPlan, fit, measure

    plan = CalibrationPlan(
        prompt_lengths=(8, 24, 40),
        cached_tokens=16,
        decode_contexts=(8, 16),
        decode_batches=(1, 2),
        decode_tokens=8,
        contention_tokens=12,
        contention_prefills=2,
        contention_rounds=1,
        reps=1,
        idle_s=0.25,
    )
    http = httpx.Client()
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def send(prompt: list[int], n: int, on_first_token=None) -> RequestRecord:
        t = now()
        return stream_completion(
            http,
            slow_server,
            completion_body("m", prompt, n),
            Sent("c", "", t, t, len(prompt), n),
            now,
            timeout_s=10,
            on_first_token=on_first_token,
        )

    lines: list[str] = []
    idled: list[float] = []
    m = measure(send, plan, lines.append, idle=idled.append)
    # every measured request (or group) after the live run's gap: 6 prefills, 4 decode groups,
    # 1 contention round
    assert idled == [0.25] * 11
    http.close()
    assert len(m.prefill) == 6 and [b for b, _ in m.decode] == [1, 2, 1, 2]
    assert all(len(s) == b for b, s in m.decode) and len(m.contention) == 1
    stream, prefills = m.contention[0]
    assert stream.output_tokens == 12 and len(prefills) == 2
    # the prefills started once the stream had its first token
    assert all(p.sent_s >= stream.first_token_s for p in prefills)
    assert len(lines) == 3
    profile = TimeModel(
        PrefillCoeffs(0.0, 0.0, 0.0, 0.0),
        DecodeCoeffs(0.0, 0.0, 0.0),
        (PullCoeffs("dram", True, 0.0, 0.0),),
    )
    cal = fit(m, profile, page_tokens=16, page_bytes=1024)
    assert cal.model.prefill_s(16, 0) == pytest.approx(0.15, rel=0.05)
    assert cal.request_overhead_s == pytest.approx(FIRST_TOKEN_DELAY_S - 0.15, abs=0.05)
    assert cal.model.decode_step_s(1, 20) == pytest.approx(TOKEN_GAP_S, abs=0.01)
    assert cal.handoff_s < 0.02  # the fake server hands nothing off
