"""RouterCore's pipeline, the dispatch ledger (bursts against stale reports) and the prediction tracker."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.router.core import (
    Admission,
    AdmissionConfig,
    DecodeCoeffs,
    DispatchLedger,
    Placement,
    PredictionTracker,
    PrefillCoeffs,
    PrefixHit,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
    error_kind_of,
    explain,
    headers,
)
from engine.router.core.errors import ErrorKind, UnknownSloClass
from engine.router.core.estimate import estimate_tpot

pytestmark = pytest.mark.unit

PAGE = 16
MODEL = TimeModel(
    prefill=PrefillCoeffs(fixed_s=0.005, per_token_s=5e-5, per_cached_token_s=0.0, attention_s=0.0),
    decode=DecodeCoeffs(fixed_s=0.008, per_request_s=5e-4, per_context_token_s=1e-7),
)


def prefill(worker_id: str, **load: float) -> WorkerView:
    return WorkerView(worker_id, Role.prefill, worker_id[0], "m", PAGE, **load)  # type: ignore[arg-type]


def decode(worker_id: str, **load: float) -> WorkerView:
    return WorkerView(worker_id, Role.decode, worker_id[0], "m", PAGE, **load)  # type: ignore[arg-type]


def req(rid: str, prompt: int = 1000, max_tokens: int = 20, slo: str = "") -> RequestView:
    return RequestView(rid, prompt, max_tokens, slo_class=slo, page_tokens=PAGE, page_bytes=1024)


def test_a_burst_against_stale_reports_spreads_with_the_ledger() -> None:
    # the last reports (0.5 s old) show a:1 slightly idler than the others
    workers = (
        [prefill("a:1", report_age_s=0.5)]
        + [
            prefill(f"{c}:1", queued_prefill_tokens=100, queued_requests=1, report_age_s=0.5)
            for c in "bcd"
        ]
        + [decode("x:1", report_age_s=0.5)]
    )
    policy = build_policy("least_load")
    without = Counter(
        policy.place(req(f"r{i}"), workers, MODEL, 0.0, random.Random(i)).prefill_id  # type: ignore[union-attr]
        for i in range(20)
    )
    assert without == Counter({"a:1": 20})  # every decision piles onto the stale idle worker
    core = RouterCore(build_policy("least_load"), Admission(), MODEL, DispatchLedger())
    rng = random.Random(3)
    with_ledger = Counter()
    for i in range(20):
        out = core.decide(req(f"r{i}"), workers, 0.0, rng)
        assert isinstance(out, Placement)
        with_ledger[out.prefill_id] += 1
    assert set(with_ledger) == {"a:1", "b:1", "c:1", "d:1"}
    assert max(with_ledger.values()) - min(with_ledger.values()) <= 1
    assert len(core.ledger) == 20


def test_a_newer_report_includes_the_dispatch() -> None:
    ledger = DispatchLedger()
    placement = Placement("a:1", "x:1", 0.2, 0.01, "test", hit_tokens_used=160)
    ledger.reserve(req("r"), placement, now=1.0)
    stale = ledger.apply(
        [prefill("a:1", report_age_s=0.5), decode("x:1", report_age_s=0.5)], now=1.1
    )
    assert stale[0].queued_prefill_tokens == 1000 - 160 and stale[0].queued_requests == 1
    assert [j.request_id for j in stale[1].pending_joins] == ["r"]
    assert stale[1].pending_joins[0].join_at_s == pytest.approx(1.2)
    # a prefill report taken after the dispatch already counts it; decode joins at 1.2
    fresh = ledger.apply(
        [prefill("a:1", report_age_s=0.0), decode("x:1", report_age_s=0.0)], now=1.1
    )
    assert fresh[0].queued_prefill_tokens == 0
    assert len(fresh[1].pending_joins) == 1
    after_join = ledger.apply([decode("x:1", report_age_s=0.0)], now=1.3)
    assert after_join[0].pending_joins == ()


def test_a_report_in_whole_prompts_gets_the_hits_of_its_dispatches_taken_out() -> None:
    ledger = DispatchLedger()
    ledger.reserve(req("r"), Placement("a:1", "x:1", 0.2, 0.01, "t", hit_tokens_used=896), 1.0)
    # the worker holds r and another request (500 tokens, not ours) and counts both prompts
    held = dict(queued_prefill_tokens=1000 + 500, queued_requests=2, report_age_s=0.0)
    (counted,) = ledger.apply([prefill("a:1", **held, queued_are_prompts=True)], now=1.1)
    assert counted.queued_prefill_tokens == 1500 - 896 and counted.queued_requests == 2
    # a report already in tokens to compute is left as it is
    (exact,) = ledger.apply([prefill("a:1", **held)], now=1.1)
    assert exact.queued_prefill_tokens == 1500
    # a report taken before the dispatch does not hold it: its tokens to compute are added
    (stale,) = ledger.apply(
        [prefill("a:1", queued_prefill_tokens=500, queued_requests=1, report_age_s=0.5,
                 queued_are_prompts=True)], now=1.1
    )  # fmt: skip
    assert stale.queued_prefill_tokens == 500 + 1000 - 896 and stale.queued_requests == 2
    # the first token came: r left the queue, nothing is taken out any more
    ledger.on_prefill_done("r", 1.3)
    (done,) = ledger.apply([prefill("a:1", **held, queued_are_prompts=True)], now=1.4)
    assert done.queued_prefill_tokens == 1500


def test_prefill_done_moves_the_dispatch_to_decode_then_release_forgets_it() -> None:
    ledger = DispatchLedger()
    ledger.reserve(req("r"), Placement("a:1", "x:1", 5.0, 0.01, "test"), now=0.0)
    ledger.on_prefill_done("r", now=0.3)
    views = ledger.apply(
        [prefill("a:1", report_age_s=10.0), decode("x:1", report_age_s=0.2)], now=0.4
    )
    assert views[0].queued_prefill_tokens == 0  # left the prefill queue
    assert views[1].pending_joins[0].join_at_s == 0.3  # the real join time, not the predicted 5.0
    ledger.release("r")
    ledger.release("unknown")  # ignored
    assert len(ledger) == 0
    assert ledger.apply([prefill("a:1", report_age_s=10.0)], now=0.5)[0].queued_requests == 0


def test_unreleased_entries_expire() -> None:
    ledger = DispatchLedger(max_age_s=10.0)
    ledger.reserve(req("r"), Placement("a:1", "x:1", 1.0, 0.01, "test"), now=0.0)
    assert ledger.expire(now=5.0) == 0
    assert ledger.expire(now=11.5) == 1 and len(ledger) == 0


def test_pending_joins_raise_the_predicted_tpot() -> None:
    ledger = DispatchLedger()
    for i in range(8):  # 8 long requests join at 0.1
        ledger.reserve(req(f"r{i}", max_tokens=1000), Placement("a:1", "x:1", 0.1, 0.01, "t"), 0.0)
    (view,) = ledger.apply([decode("x:1")], now=0.0)
    empty = estimate_tpot(req("n"), decode("x:1"), MODEL, 0.0, 0.2)
    busy = estimate_tpot(req("n"), view, MODEL, 0.0, 0.2)
    # its whole life overlaps theirs: a batch of 9 with their context and its own
    assert busy == pytest.approx(MODEL.decode_step_s(9, 8 * 1000 + 1000 + 10))
    assert busy > empty
    # a short request joining before them (at 0.05, done by 0.07) runs alone
    short = req("s", max_tokens=2)
    assert estimate_tpot(short, view, MODEL, 0.0, 0.05) == pytest.approx(
        estimate_tpot(short, decode("x:1"), MODEL, 0.0, 0.05)
    )
    # one that joins shortly before they finish: the batch at its join is a floor (under load
    # the departures during its life are replaced by newcomers), so it prices all of them
    their_end = 0.1 + 1000 * MODEL.decode_step_s(8, 8 * 1000)
    late = estimate_tpot(req("n"), view, MODEL, 0.0, their_end - 0.1)
    assert late == pytest.approx(busy)
    # and long after they are done, it runs alone again
    assert estimate_tpot(req("n"), view, MODEL, 0.0, 60.0) == pytest.approx(empty)


def test_decide_reserves_only_admitted_requests_and_scores_predictions() -> None:
    config = AdmissionConfig(
        classes=(SloClass("fast", ttft_s=0.2, tpot_s=1.0),), default_class="fast"
    )
    core = RouterCore(build_policy("strata"), Admission(config), MODEL)
    workers = [prefill("a:1"), decode("x:1")]
    ok = core.decide(req("r1", prompt=1000), workers, 0.0, random.Random(0))
    assert isinstance(ok, Placement) and len(core.ledger) == 1
    assert ok.predicted_ttft_s == pytest.approx(MODEL.prefill_s(1000, 0))
    too_long = core.decide(req("r2", prompt=8000), workers, 0.0, random.Random(0))
    assert isinstance(too_long, Refusal) and too_long.reason is RefusalReason.ttft_slo
    assert len(core.ledger) == 1 and core.open_requests == 1
    info = explain(too_long)
    assert info["reason"] == "ttft_slo" and "placement" in info
    assert error_kind_of(too_long.reason) is ErrorKind.rate_limited
    # the request runs: first token 10% later than predicted, then 11 tokens at 12 ms each
    err = core.on_first_token("r1", ok.predicted_ttft_s * 1.1)
    assert err == pytest.approx(1 / 1.1 - 1)
    first = ok.predicted_ttft_s * 1.1
    tpot_err = core.on_finish("r1", first + 10 * 0.012, output_tokens=11)
    assert tpot_err == pytest.approx((ok.predicted_tpot_s - 0.012) / 0.012)
    assert core.tracker.count("ttft") == 1 and core.tracker.count("tpot") == 1
    assert len(core.ledger) == 0 and core.open_requests == 0
    hdrs = headers(ok)
    assert hdrs["x-strata-prefill"] == "a:1" and float(hdrs["x-strata-predicted-ttft-ms"]) > 0


def test_a_failed_request_is_released_and_not_scored() -> None:
    core = RouterCore(build_policy("round_robin"), Admission(), MODEL)
    out = core.decide(req("r"), [prefill("a:1"), decode("x:1")], 0.0, random.Random(0))
    assert isinstance(out, Placement)
    core.on_failed("r", 0.5)
    assert len(core.ledger) == 0 and core.tracker.count("ttft") == 0
    assert core.on_first_token("r", 0.6) is None


def test_unknown_slo_class_is_an_invalid_request() -> None:
    core = RouterCore(build_policy("strata"), Admission(), MODEL)
    with pytest.raises(UnknownSloClass) as info:
        core.decide(req("r", slo="gold"), [prefill("a:1"), decode("x:1")], 0.0, random.Random(0))
    assert info.value.kind is ErrorKind.invalid_request and "gold" in info.value.message


def test_prediction_tracker_median_and_drift() -> None:
    tracker = PredictionTracker(window=50, threshold=0.25, min_samples=10, max_age_s=100.0)
    for i in range(9):
        tracker.record("ttft", 1.5, 1.0, now=float(i))  # +50%
    assert tracker.median_relative_error("ttft") == pytest.approx(0.5)
    assert not tracker.drifted("ttft")  # too few samples yet
    tracker.record("ttft", 1.5, 1.0, now=9.0)
    assert tracker.drifted("ttft")
    for i in range(40):  # accurate predictions push the old ones out of the window
        tracker.record("ttft", 1.02 if i % 2 else 0.98, 1.0, now=10.0 + i)
    assert abs(tracker.median_relative_error("ttft")) <= 0.021
    assert tracker.median_abs_relative_error("ttft") == pytest.approx(
        0.02
    )  # 20 x 0.02, 20 x -0.02, 10 x 0.5
    assert not tracker.drifted("ttft")
    assert tracker.count("ttft", now=200.0) == 0  # all older than max_age_s
    assert tracker.median_relative_error("tpot") == 0.0
    assert tracker.record("tpot", 1.0, 0.0, now=0.0) == 0.0 and tracker.count("tpot") == 0
    with pytest.raises(ValueError):
        tracker.record("e2e", 1.0, 1.0, now=0.0)


def test_prefix_hit_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="tiers"):
        PrefixHit(2, ("dram",), ("A", "A"))
    with pytest.raises(ValueError, match="tier"):
        PrefixHit(1, ("tape",), ("A",))
    with pytest.raises(ValueError, match="prompt_tokens"):
        RequestView("r", 0, 1)


def test_decode_load_window_matches_a_plain_sum() -> None:
    """The bisection over sorted ends equals summing each request's overlap with the window."""
    from engine.router.core.estimate import decode_load
    from engine.router.core.types import PendingJoin

    rng = random.Random(11)
    for case in range(200):
        running = rng.randrange(0, 12)
        remaining = tuple(rng.randrange(0, 400) for _ in range(rng.randrange(0, running + 1)))
        joins = tuple(
            PendingJoin(
                f"j{k}", rng.uniform(0.0, 3.0), rng.randrange(1, 3000), rng.randrange(1, 300)
            )
            for k in range(rng.randrange(0, 5))
        )
        view = WorkerView(
            "x:1",
            Role.decode,
            "x",
            "m",
            PAGE,
            running_requests=running,
            running_context_tokens=running * 700,
            report_age_s=rng.uniform(0.0, 0.5),
            running_remaining_tokens=remaining,
            pending_joins=joins,
        )
        now = 1.0
        load = decode_load(view, MODEL, now)
        step = MODEL.decode_step_s(max(running, 1), running * 700)
        reported = now - view.report_age_s
        members = [(reported, reported + r * step, 700.0) for r in remaining]
        members += [(reported, float("inf"), 700.0)] * (running - len(remaining))
        join_step = MODEL.decode_step_s(
            running + len(joins), running * 700 + sum(j.context_tokens for j in joins)
        )
        members += [
            (j.join_at_s, j.join_at_s + j.max_tokens * join_step, float(j.context_tokens))
            for j in joins
        ]
        start = now + rng.uniform(0.0, 2.0)
        end = start + (0.0 if case % 4 == 0 else rng.uniform(0.01, 3.0))
        want_n = want_ctx = 0.0
        for since, until, ctx in members:
            if end == start:
                share = 1.0 if since <= start < until else 0.0
            else:
                share = max(0.0, min(until, end) - max(since, start)) / (end - start)
            want_n += share
            want_ctx += share * ctx
        got_n, got_ctx = load.over(start, end)
        assert got_n == pytest.approx(want_n, abs=1e-9), case
        assert got_ctx == pytest.approx(want_ctx, rel=1e-9, abs=1e-6), case
