"""The serving-path calibration of `strata loadtest --validate` and the simulator terms it feeds:
`fit` recovers known terms from synthetic measurements of a system that has exactly them, and
the simulator's hand-off and contention terms have their known effect on one or two requests."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from engine.router.core import DecodeCoeffs, PrefillCoeffs, PullCoeffs, TimeModel
from loadtests.live.calibrate import (
    CalibrationError,
    Measurements,
    Prompts,
    fit,
    plan_for,
    token_times,
)
from loadtests.report.metrics import run_metrics
from loadtests.report.records import Breakdown, RequestRecord
from loadtests.sim.cluster import ClusterError, ClusterSpec
from loadtests.sim.simulator import simulate
from loadtests.workload import Request, Segment, parse_workload

pytestmark = pytest.mark.unit

PAGE_TOKENS, PAGE_BYTES = 16, 16 * 1024
PROFILE = TimeModel(  # only its pulls are used
    prefill=PrefillCoeffs(1.0, 1.0, 0.0, 0.0),
    decode=DecodeCoeffs(1.0, 0.0, 0.0),
    pulls=(PullCoeffs("dram", True, 1e-3, 1e-9),),
)
# the "true" system the synthetic measurements come from
PRE_FIXED, PRE_TOKEN = 0.010, 0.0005
STEP_FIXED, STEP_REQUEST = 0.015, 0.003
OVERHEAD, HANDOFF, DECODE_X, PREFILL_X = 0.007, 0.040, 2.0, 1.5


def compute(new: int) -> float:
    return PRE_FIXED + PRE_TOKEN * new


def pull(tokens: int) -> float:
    return 1e-3 + 1e-9 * (-(-tokens // PAGE_TOKENS) * PAGE_BYTES) if tokens else 0.0


def record(
    prompt: int,
    start: float,
    *,
    hit: int = 0,
    times: list[float] | None = None,
    compute_s: float | None = None,
) -> RequestRecord:
    c = compute(prompt - hit) if compute_s is None else compute_s
    first = start + pull(hit) + c + OVERHEAD
    ts = times or [first]
    gaps = tuple(b - a for a, b in itertools.pairwise(ts))
    return RequestRecord(
        "c",
        "",
        "ok",
        start,
        start,
        first_token_s=ts[0],
        finish_s=ts[-1],
        prompt_tokens=prompt,
        output_tokens=len(ts),
        max_tokens=len(ts),
        hit_tokens=(("unknown", hit),) if hit else (),
        token_gaps_s=gaps,
        breakdown=Breakdown(prefill_s=c),
    )


def stream(prompt: int, start: float, tokens: int, batch: int) -> RequestRecord:
    step = STEP_FIXED + STEP_REQUEST * batch
    first = start + compute(prompt) + OVERHEAD
    second = first + HANDOFF + pull(prompt) + (STEP_FIXED + STEP_REQUEST)
    times = [first, second] + [second + step * (i + 1) for i in range(tokens - 2)]
    return record(prompt, start, times=times)


def synthetic() -> Measurements:
    prefill = [record(n, 10.0 * i) for i, n in enumerate((32, 64, 128, 256))]
    prefill += [record(n + 64, 50.0 + 10.0 * i, hit=64) for i, n in enumerate((32, 64, 128))]
    decode = []
    for context in (100, 200):
        for batch in (1, 2, 4):
            # the streams start together (one first-token time: the prefill is not timed here)
            streams = tuple(
                stream(context, 100.0 * batch + context, 30, batch) for _ in range(batch)
            )
            decode.append((batch, streams))
    # contention: a lone stream whose steps take DECODE_X longer while a prefill computes
    step = STEP_FIXED + STEP_REQUEST
    t, times = 1000.0, [1000.0]
    t += HANDOFF
    times.append(t)
    windows = [(t + 0.1 + 0.3 * k, t + 0.1 + 0.3 * k + 0.15) for k in range(4)]
    for _ in range(60):
        mid = t + step / 2
        t += step * (DECODE_X if any(a <= mid <= b for a, b in windows) else 1.0)
        times.append(t)
    lone = record(100, 1000.0 - compute(100) - OVERHEAD, times=times)
    pres = tuple(
        RequestRecord(
            "p",
            "",
            "ok",
            a - 0.01,
            a - 0.01,
            first_token_s=b,
            finish_s=b,
            prompt_tokens=100,
            output_tokens=1,
            max_tokens=1,
            breakdown=Breakdown(prefill_s=b - a),
        )
        for a, b in windows
    )
    return Measurements(tuple(prefill), tuple(decode), ((lone, pres),))


def test_fit_recovers_the_terms_of_a_known_serving_path() -> None:
    cal = fit(synthetic(), PROFILE, page_tokens=PAGE_TOKENS, page_bytes=PAGE_BYTES)
    m = cal.model
    assert m.prefill.fixed_s == pytest.approx(PRE_FIXED, rel=0.05)
    assert m.prefill.per_token_s == pytest.approx(PRE_TOKEN, rel=0.05)
    assert m.decode_step_s(1, 115) == pytest.approx(STEP_FIXED + STEP_REQUEST, rel=0.05)
    assert m.decode_step_s(4, 460) == pytest.approx(STEP_FIXED + 4 * STEP_REQUEST, rel=0.05)
    assert cal.request_overhead_s == pytest.approx(OVERHEAD, abs=1e-3)
    assert cal.handoff_s == pytest.approx(HANDOFF, abs=2e-3)
    assert cal.token_overhead_s == 0.0  # the decode fit is end to end
    assert cal.decode_contention == pytest.approx(DECODE_X, rel=0.15)
    # the prefills of the contention phase took 0.15 s for 100 tokens: against the fit's 0.06 s
    assert cal.prefill_contention == pytest.approx(0.15 / compute(100), rel=0.05)
    assert m.pulls == PROFILE.pulls  # pulls stay the profile's
    assert set(cal.terms()) == {
        "request_overhead_s",
        "token_overhead_s",
        "handoff_s",
        "prefill_contention",
        "decode_contention",
        "prefill_jitter",
    }
    # an exact system: every prefill is where the fit puts it
    assert len(cal.prefill_jitter) == 7
    assert cal.prefill_jitter == pytest.approx([1.0] * 7, rel=0.05)


def test_jitter_keeps_the_measured_skew() -> None:
    m = synthetic()
    slow = tuple(
        dataclasses.replace(r, breakdown=Breakdown(prefill_s=3 * r.breakdown.prefill_s))
        if i in (1, 4)
        else r
        for i, r in enumerate(m.prefill)
    )
    cal = fit(
        Measurements(slow, m.decode, m.contention),
        PROFILE,
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
    )
    j = cal.prefill_jitter
    assert list(j) == sorted(j) and j[len(j) // 2] == pytest.approx(1.0, rel=0.2)
    assert j[-1] / j[0] > 2.5  # the two slow ones stay in, about 3x the others
    assert "p90" in cal.jitter_summary()


def test_fit_refuses_measurements_without_decode() -> None:
    m = synthetic()
    with pytest.raises(CalibrationError):
        fit(Measurements(m.prefill, (), ()), PROFILE, page_tokens=16, page_bytes=PAGE_BYTES)


def test_plan_takes_the_workload_lengths_and_prompts_are_fresh() -> None:
    plan = plan_for(list(range(10, 210)), 512, 16)
    assert plan.prompt_lengths[0] >= 10 and plan.prompt_lengths[-1] <= 209
    assert plan.cached_tokens % 16 == 0 and plan.cached_tokens > 0
    with pytest.raises(CalibrationError):
        plan_for([], 512, 16)
    a, b = Prompts(512), Prompts(512)
    pa, pb = a.fresh(64), a.fresh(64)
    assert pa != pb and all(3 <= t < 512 for t in pa + pb)
    assert a.fresh(64) != b.fresh(64)  # another calibration, other prompts
    r = record(10, 0.0, times=[1.0, 1.5, 1.75])
    assert token_times(r) == pytest.approx([1.0, 1.5, 1.75])


def _spec():
    return parse_workload(
        {
            "name": "t",
            "seed": 1,
            "duration_s": 10.0,
            "model": {"context_tokens": 8192, "vocab_size": 1000},
            "arrival": {"process": "poisson", "rate": 1.0},
            "classes": [
                {
                    "name": "c",
                    "ttft_s": 10.0,
                    "tpot_s": 10.0,
                    "generator": {"kind": "chat", "prompt": 64, "output": 11},
                }
            ],
        }
    )


def _req(i: int, t: float) -> Request:
    return Request(i, f"r{i}", t, "c", (Segment(1000 + i, 64),), 11)


def test_the_simulators_hand_off_and_contention_terms() -> None:
    spec = _spec()
    model = TimeModel(
        prefill=PrefillCoeffs(0.1, 0.0, 0.0, 0.0),
        decode=DecodeCoeffs(0.01, 0.0, 0.0),
        pulls=(PullCoeffs("dram", True, 0.0, 0.0),),
    )
    base = ClusterSpec(
        name="t", time_model="", prefill=1, decode=1, kv_bytes_per_token=1024, store="none"
    )
    one = [_req(0, 0.0)]
    plain = simulate(base, spec, model, one, rate=1.0).records[0]
    handed = simulate(base.with_(handoff_s=0.05), spec, model, one, rate=1.0).records[0]
    assert handed.first_token_s == pytest.approx(plain.first_token_s)
    assert handed.finish_s - plain.finish_s == pytest.approx(0.05)
    assert handed.breakdown.pull_s - plain.breakdown.pull_s == pytest.approx(0.05)
    # alone, contention changes nothing (no other engine of the host computes)
    lone = base.with_(prefill_contention=2.0, decode_contention=3.0)
    assert simulate(lone, spec, model, one, rate=1.0).records[0].finish_s == pytest.approx(
        plain.finish_s
    )
    # the second request's prefill starts while the first decodes (0.1 s + 10 steps of 0.01 s)
    two = [_req(0, 0.0), _req(1, 0.15)]
    a0, b0 = simulate(base, spec, model, two, rate=1.0).records
    a1, b1 = simulate(lone, spec, model, two, rate=1.0).records
    assert b0.ttft_s == pytest.approx(0.1) and b1.ttft_s == pytest.approx(0.2)  # x2 prefill
    # the first one's steps that started during that prefill took 3x: it ends later, by at most
    # (3 - 1) x the steps that fit into the contended prefill, and at least one such step
    assert a1.finish_s - a0.finish_s >= 2 * 0.01 - 1e-9
    assert a1.finish_s - a0.finish_s <= 2 * 0.01 * math.ceil(0.2 / 0.01) + 1e-9
    assert run_metrics(simulate(lone, spec, model, two, rate=1.0)).overall.ok == 2
    # jitter: every prefill's compute times a draw; one value is a plain multiplier
    doubled = simulate(base.with_(prefill_jitter=(2.0,)), spec, model, one, rate=1.0).records[0]
    assert doubled.ttft_s == pytest.approx(2 * plain.ttft_s)
    mixed = base.with_(prefill_jitter=(1.0, 3.0))
    many = [_req(i, 2.0 * i) for i in range(20)]
    ttfts = [r.ttft_s for r in simulate(mixed, spec, model, many, rate=0.5).records]
    assert set(round(t, 6) for t in ttfts) == {0.1, 0.3}  # both draws happen, nothing else
    again = [r.ttft_s for r in simulate(mixed, spec, model, many, rate=0.5).records]
    assert again == ttfts  # seeded: the same run twice
    with pytest.raises(ClusterError, match="jitter"):
        base.with_(prefill_jitter=(0.0,))
    with pytest.raises(ClusterError, match="contention"):
        base.with_(decode_contention=0.5)
    with pytest.raises(ClusterError, match="handoff"):
        base.with_(handoff_s=-1.0)
