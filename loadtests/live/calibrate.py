"""The serving path measured through the API, just before a validation's live runs.

A time model measured in-process (`strata profile`) prices the model's compute; a request that
goes through `strata up` pays more: the router's HTTP hop and decision, sampling and the
workers' RPCs, the prefill → decode hand-off of the KV pages, the relay of every token (worker
→ router → SSE → client), and, on a machine whose processors every process shares, the slowdown
of one worker's compute while another computes. `measure(send, plan)` takes these from the
running system through the same HTTP user the load test uses (fresh prompts outside the
workload, so nothing it measures is cached for the runs after it), and `fit(...)` (pure) turns
the measurements into the simulator's terms:

- prefill: requests with one output token, alone, at the workload's prompt lengths, with and
  without a cached prefix; the prefill worker's own compute + sampling time (`strata_timings`)
  fits the prefill coefficients;
- request overhead: what such a request's TTFT adds to the fitted prefill and the modelled pull
  of its hit pages (queue, lookup, publish, router, HTTP), the median over them;
- decode: `batch` concurrent streamed requests; the time per token of each while all of them
  stream, as the client sees it, fits the decode coefficients end to end (the relay of each
  token included, so the token overhead is 0);
- hand-off: a lone stream's gap between its first and second token, less a decode step and the
  modelled pull of its prompt's pages (the decode RPC, the wait for the pages to publish);
- contention: a long stream while prefill-only requests run back to back: its time per token
  while a prefill computes over its time per token otherwise (`decode_contention`), and those
  prefills' compute over the fitted prefill (`prefill_contention`), each at least 1;
- idling: every measured request follows `idle_s` of idling (the live run's mean gap between
  arrivals, capped), since a system woken from idle answers slower than one kept busy, most of
  all on a machine shared with other work;
- jitter: each alone prefill's compute over the fit (`prefill_jitter`, sorted): on a machine
  shared with other work the same prefill takes from about the fit to several times it, and a
  p50 over a run is moved by that skew; the simulator draws each prefill's multiplier from it.

The pulls stay the profile's (measured against the store daemon by `strata up`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.router.core.timemodel import (
    DecodeSample,
    PrefillSample,
    Provenance,
    Samples,
    TimeModel,
)
from loadtests.report.records import RequestRecord

# send(prompt token ids, max_tokens, on_first_token=None) -> the record of that streamed request
# (run clock); on_first_token() is called as its first token arrives
Send = Callable[..., RequestRecord]
Progress = Callable[[str], None]


class CalibrationError(RuntimeError):
    """The serving path could not be measured (requests failed, nothing to fit)."""


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What to send: prompt lengths for the prefill fit (each alone and after a cached prefix
    of `cached_tokens` with `extension_lengths` new tokens: a hit leaves few to compute),
    decode batches at each context, streams of `decode_tokens` tokens,
    `contention_prefills` back-to-back prefills against a stream of `contention_tokens`."""

    prompt_lengths: tuple[int, ...]
    cached_tokens: int
    decode_contexts: tuple[int, ...]
    extension_lengths: tuple[int, ...] = ()
    decode_batches: tuple[int, ...] = (1, 2, 4)
    decode_tokens: int = 32
    contention_tokens: int = 64
    contention_prefills: int = 6
    contention_rounds: int = 2
    reps: int = 3
    idle_s: float = 0.0  # idle before each measured request: the live run's typical gap
    vocab_size: int = 512
    token_low: int = 3


def plan_for(
    prompt_tokens: Sequence[int],
    vocab_size: int,
    page_tokens: int,
    token_low: int = 3,
    idle_s: float = 0.0,
) -> CalibrationPlan:
    """A plan at the workload's own prompt lengths (quantiles of `prompt_tokens`), each measured
    request after `idle_s` of idling."""
    if not prompt_tokens:
        raise CalibrationError("the workload has no requests to take prompt lengths from")
    ordered = sorted(prompt_tokens)

    def q(f: float) -> int:
        return max(1, ordered[min(len(ordered) - 1, int(f * len(ordered)))])

    lengths = tuple(sorted({q(0.05), q(0.3), q(0.6), q(0.95)}))
    cached = max(page_tokens, (3 * q(0.5) // 4) // page_tokens * page_tokens)
    return CalibrationPlan(
        prompt_lengths=lengths,
        cached_tokens=cached,
        extension_lengths=tuple(sorted({page_tokens, 2 * page_tokens, lengths[0], lengths[1]})),
        decode_contexts=tuple(sorted({q(0.25), q(0.9)})),
        vocab_size=vocab_size,
        token_low=token_low,
        idle_s=idle_s,
    )


@dataclass(frozen=True, slots=True)
class Measurements:
    """Every calibration request, as the client recorded it (one clock for all)."""

    prefill: tuple[RequestRecord, ...]
    decode: tuple[tuple[int, tuple[RequestRecord, ...]], ...]  # (batch, its concurrent streams)
    contention: tuple[tuple[RequestRecord, tuple[RequestRecord, ...]], ...]  # (stream, prefills)


def merge(a: Measurements, b: Measurements) -> Measurements:
    """Two calibrations' measurements as one (each request keeps its own clock's times)."""
    return Measurements(a.prefill + b.prefill, a.decode + b.decode, a.contention + b.contention)


@dataclass(frozen=True, slots=True)
class Calibration:
    """The simulator's terms for this machine and serving path (seconds, factors)."""

    model: TimeModel  # prefill and decode fitted here, pulls from the profile
    request_overhead_s: float
    token_overhead_s: float
    handoff_s: float
    prefill_contention: float
    decode_contention: float
    prefill_jitter: tuple[float, ...]  # each alone prefill's compute over the fit, sorted
    requests: int  # calibration requests sent

    def terms(self) -> dict[str, float | tuple[float, ...]]:
        return {
            "request_overhead_s": self.request_overhead_s,
            "token_overhead_s": self.token_overhead_s,
            "handoff_s": self.handoff_s,
            "prefill_contention": self.prefill_contention,
            "decode_contention": self.decode_contention,
            "prefill_jitter": self.prefill_jitter,
        }

    def jitter_summary(self) -> str:
        j = self.prefill_jitter
        if not j:
            return "none"
        p10, p50, p90 = (j[min(len(j) - 1, int(q * len(j)))] for q in (0.1, 0.5, 0.9))
        return f"p10 {p10:.2f}, p50 {p50:.2f}, p90 {p90:.2f} ({len(j)} samples)"

    def model_summary(self) -> str:
        p, d = self.model.prefill, self.model.decode
        return (
            f"prefill {p.fixed_s * 1e3:.1f} ms + {p.per_token_s * 1e3:.3f} ms/token; decode step "
            f"{d.fixed_s * 1e3:.1f} ms + {d.per_request_s * 1e3:.2f} ms/request + "
            f"{d.per_context_token_s * 1e6:.2f} us/context token (end to end)"
        )

    def summary(self) -> str:
        return (
            f"{self.model_summary()}; request overhead {self.request_overhead_s * 1e3:.1f} ms; "
            f"hand-off {self.handoff_s * 1e3:.1f} ms; contention: prefill "
            f"x{self.prefill_contention:.2f}, decode x{self.decode_contention:.2f}; prefill "
            f"jitter {self.jitter_summary()} ({self.requests} requests)"
        )


class Prompts:
    """Fresh prompts (a random stream of token ids per calibration, nothing shared with the
    workload's content blocks or another calibration)."""

    def __init__(self, vocab_size: int, token_low: int = 3) -> None:
        self.vocab = vocab_size
        self.low = token_low
        self.salt = uuid.uuid4().int % 1_000_003
        self.count = itertools.count(1)

    def fresh(self, length: int) -> list[int]:
        n = next(self.count)
        span = self.vocab - self.low
        return [
            self.low + (self.salt * 7919 + n * 104729 + i * 15485863 + n * i * 31) % span
            for i in range(length)
        ]


def measure(
    send: Send,
    plan: CalibrationPlan,
    progress: Progress = lambda _: None,
    idle: Callable[[float], None] = time.sleep,
) -> Measurements:
    """Send the plan's requests (bounded: a fixed count, each bounded by `send`'s timeout).
    Each measured request (or group) follows `plan.idle_s` of idling, as a live request follows
    the gap since the one before: a system woken from idle answers slower than one kept busy
    back to back, most of all on a loaded machine."""
    prompts = Prompts(plan.vocab_size, plan.token_low)
    send(prompts.fresh(32), 2)  # warm-up, not kept
    prefill: list[RequestRecord] = []
    for length in plan.prompt_lengths:
        for _ in range(plan.reps):
            idle(plan.idle_s)
            prefill.append(_ok(send(prompts.fresh(length), 1)))
    for length in plan.extension_lengths or plan.prompt_lengths:
        for _ in range(plan.reps):
            base = prompts.fresh(plan.cached_tokens)
            extra = prompts.fresh(max(1, length))
            _ok(send(base, 1))  # the prefix, published for the next request to hit
            idle(plan.idle_s)
            prefill.append(_ok(send(base + extra, 1)))
    progress(
        f"prefill: {len(prefill)} requests, {', '.join(map(str, plan.prompt_lengths))} tokens "
        f"alone and {', '.join(map(str, plan.extension_lengths or plan.prompt_lengths))} after "
        f"{plan.cached_tokens} cached"
    )
    decode: list[tuple[int, tuple[RequestRecord, ...]]] = []
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            for _ in range(max(1, plan.reps - 1)):
                idle(plan.idle_s)
                streams = _together(
                    [
                        functools.partial(send, prompts.fresh(context), plan.decode_tokens)
                        for _ in range(batch)
                    ]
                )
                decode.append((batch, tuple(_ok(r) for r in streams)))
    progress(f"decode: batches {plan.decode_batches} at contexts {plan.decode_contexts}")
    contention: list[tuple[RequestRecord, tuple[RequestRecord, ...]]] = []
    median_len = plan.prompt_lengths[len(plan.prompt_lengths) // 2]
    for _ in range(plan.contention_rounds):
        stream_prompt = prompts.fresh(plan.decode_contexts[0])
        pre_prompts = [prompts.fresh(median_len) for _ in range(plan.contention_prefills)]
        streaming = threading.Event()

        def stream(p: list[int] = stream_prompt, go: threading.Event = streaming) -> RequestRecord:
            try:
                return send(p, plan.contention_tokens, on_first_token=go.set)
            finally:
                go.set()  # a stream that failed releases the prefills too

        def prefills(
            ps: list[list[int]] = pre_prompts, go: threading.Event = streaming
        ) -> list[RequestRecord]:
            # they start once the stream has its first token, so they overlap its decode
            if not go.wait(600):
                raise CalibrationError("the contention stream had no first token in 600 s")
            return [_ok(send(p, 1)) for p in ps]

        idle(plan.idle_s)
        got = _together([stream, prefills])
        contention.append((_ok(got[0]), tuple(got[1])))
    progress(f"contention: {plan.contention_rounds} streams against back-to-back prefills")
    return Measurements(tuple(prefill), tuple(decode), tuple(contention))


def _ok(record: RequestRecord) -> RequestRecord:
    if record.status != "ok":
        raise CalibrationError(
            f"a calibration request failed ({record.status}): {record.error[:200]}"
        )
    return record


def _together(calls: Sequence[Callable[[], object]]) -> list:  # type: ignore[type-arg]
    """Run `calls` at once (threads: greenlets under gevent), their results in order."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise CalibrationError("a calibration request did not end within 600 s")
    return results


# -- fitting (pure) --------------------------------------------------------------------------------


def token_times(record: RequestRecord) -> list[float]:
    """Each output token's arrival on the run clock (the first token, then its gaps)."""
    if math.isnan(record.first_token_s):
        return []
    return list(itertools.accumulate(record.token_gaps_s, initial=record.first_token_s))


def _median(xs: Sequence[float], what: str) -> float:
    values = [x for x in xs if not math.isnan(x)]
    if not values:
        raise CalibrationError(f"nothing measured for {what}")
    return statistics.median(values)


def _hit(record: RequestRecord) -> int:
    return sum(n for _, n in record.hit_tokens)


def _step_while_all_stream(streams: Sequence[RequestRecord]) -> float:
    """Median time per token of `streams` while every one of them streams (after each has its
    second token, before the first one ends); the whole stream after its first token when that
    window holds too few tokens."""
    times = [token_times(r) for r in streams]
    start = max(ts[1] if len(ts) > 1 else ts[0] for ts in times)
    end = min(ts[-1] for ts in times)
    steps = []
    for ts in times:
        inside = [t for t in ts if start <= t <= end]
        if len(inside) >= 4 and inside[-1] > inside[0]:
            steps.append((inside[-1] - inside[0]) / (len(inside) - 1))
        elif len(ts) > 2:
            steps.append((ts[-1] - ts[1]) / (len(ts) - 2))
    return _median(steps, "decode steps")


def _windows_overlap(a: float, b: float, windows: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in windows)


def _fit_model(
    pre: tuple[PrefillSample, ...],
    dec: tuple[DecodeSample, ...],
    profile: TimeModel,
    note: str,
) -> TimeModel:
    return TimeModel.fit(
        Samples(pre, dec, profile.samples.pull),
        Provenance(
            machine=profile.provenance.machine,
            checkpoint_path=profile.provenance.checkpoint_path,
            checkpoint_fingerprint=profile.provenance.checkpoint_fingerprint,
            created=profile.provenance.created,
            store=profile.provenance.store,
            note=note
            or "prefill and decode measured through the serving API; pulls from the profile",
        ),
    )


def fit(
    m: Measurements, profile: TimeModel, *, page_tokens: int, page_bytes: int, note: str = ""
) -> Calibration:
    """The terms from the measurements (see the module doc); pulls from `profile`."""

    def pages_bytes(tokens: int) -> int:
        return -(-tokens // page_tokens) * page_bytes

    groups: dict[tuple[int, int], list[float]] = {}
    for r in m.prefill:
        hit = _hit(r)
        groups.setdefault((r.prompt_tokens - hit, hit), []).append(r.breakdown.prefill_s)
    pre = tuple(PrefillSample(n, c, statistics.median(v)) for (n, c), v in sorted(groups.items()))
    dec: list[DecodeSample] = []
    for batch, streams in m.decode:
        step = _step_while_all_stream(streams)
        context = sum(r.prompt_tokens + r.output_tokens // 2 for r in streams)
        dec.append(DecodeSample(batch, context, step))
    if not pre or not dec:
        raise CalibrationError("no prefill or decode measurements to fit")
    try:
        fitted = _fit_model(pre, tuple(dec), profile, note)
    except ValueError as exc:  # too few distinct points (lstsq.SingularFit)
        raise CalibrationError(
            f"the calibration's samples do not determine a model: {exc}"
        ) from exc
    if not profile.samples.pull and profile.pulls:
        fitted = dataclasses.replace(fitted, pulls=profile.pulls)
    model = fitted

    def pull(tokens: int) -> float:
        return model.pull_s(pages_bytes(tokens), "dram", True) if tokens else 0.0

    request = _median(
        [
            r.ttft_s - model.prefill_s(r.prompt_tokens - _hit(r), _hit(r)) - pull(_hit(r))
            for r in m.prefill
        ],
        "request overhead",
    )
    lone = [s[0] for b, s in m.decode if b == 1]
    handoff = _median(
        [
            r.token_gaps_s[0] - model.decode_step_s(1, r.prompt_tokens + 1) - pull(r.prompt_tokens)
            for r in lone
            if r.token_gaps_s
        ],
        "the hand-off",
    )
    in_rates: list[float] = []
    out_rates: list[float] = []
    pre_ratios: list[float] = []
    for stream, prefills in m.contention:
        ts = token_times(stream)
        windows = [(r.first_token_s - r.breakdown.prefill_s, r.first_token_s) for r in prefills]
        if len(ts) < 3:
            continue
        # each gap after the hand-off is contended for the share of it a prefill computed in
        busy_t = free_t = 0.0
        busy_n = free_n = 0.0
        for a, b in itertools.pairwise(ts[1:]):
            share = _windows_overlap(a, b, windows) / (b - a) if b > a else 0.0
            busy_t += share * (b - a)
            free_t += (1 - share) * (b - a)
            busy_n += share
            free_n += 1 - share
        if busy_n >= 1 and free_n >= 1:
            in_rates.append(busy_t / busy_n)
            out_rates.append(free_t / free_n)
        span = (ts[1], ts[-1])
        for r in prefills:
            lo, hi = r.first_token_s - r.breakdown.prefill_s, r.first_token_s
            if hi > lo and _windows_overlap(lo, hi, [span]) >= 0.9 * (hi - lo):
                expected = model.prefill_s(r.prompt_tokens - _hit(r), _hit(r))
                if expected > 0:
                    pre_ratios.append(r.breakdown.prefill_s / expected)
    decode_c = (
        max(1.0, statistics.median(in_rates) / statistics.median(out_rates)) if in_rates else 1.0
    )
    prefill_c = max(1.0, statistics.median(pre_ratios)) if pre_ratios else 1.0
    # how far each alone prefill was from the fit: this machine's speed from one request to
    # the next (shared with other work, it is skewed to the slow side)
    jitter = tuple(
        sorted(
            r.breakdown.prefill_s / e
            for r in m.prefill
            if (e := model.prefill_s(r.prompt_tokens - _hit(r), _hit(r))) > 0
            and r.breakdown.prefill_s > 0
        )
    )
    count = (
        len(m.prefill) + sum(len(s) for _, s in m.decode) + sum(1 + len(p) for _, p in m.contention)
    )
    return Calibration(
        model=model,
        request_overhead_s=max(0.0, request),
        token_overhead_s=0.0,
        handoff_s=max(0.0, handoff),
        prefill_contention=prefill_c,
        decode_contention=decode_c,
        prefill_jitter=jitter,
        requests=count,
    )
