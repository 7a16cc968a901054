"""The decode half of `strata bench engine`: the decode worker's tokens/s at each batch, with
the reference steps of `loadtests.engine_steps` timed between its repetitions, in the same
process at the same batch and the prompt's context (so a noisy machine shifts them together).

A repetition submits `batch` identical requests (the prompt, its first token, greedy,
`new_tokens` more) to a DecodeWorker over the store, which pulls the prompt's pages for each.
The worker's tokens/s counts the tokens sampled after its first step over the span to its last
(`decode_rate`); the reference steps' tokens/s is the batch over their median step time.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from client import StoreClient
from engine.decode import DecodeWorker
from engine.requests import DecodeRequest, DecodeResult
from engine.runtime import ModelRuntime
from engine.sampling import SamplingParams
from loadtests.engine_steps import DenseStep, ModelSteps, time_call


class BenchFailed(RuntimeError):
    """A measurement gave a wrong answer (a different first token, a partial hit)."""


@dataclass(frozen=True, slots=True)
class Stat:
    """Samples of a latency in seconds: the median and the p90 (nearest rank)."""

    median_s: float
    p90_s: float
    samples_s: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        ordered = sorted(samples)
        p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
        return cls(statistics.median(ordered), p90, tuple(samples))


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What to measure: batch 1 and `batches`, `decode_reps` repetitions of `new_tokens` a
    request, `reference_steps` calls of each reference step per repetition."""

    namespace: str
    batches: tuple[int, ...] = (8, 32)
    new_tokens: int = 64
    decode_reps: int = 3
    reference_steps: int = 5
    chunk_tokens: int = 256
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode throughput at one batch size: tokens after the first step over the span from the
    first step to the last (the pulls of the requests that join after the first are in it;
    `end_to_end` counts every pull: all new tokens over submit to last result; `steady` counts
    only the steps in which the whole batch decoded, see `steady_rate`). p90 is of the time per
    token, given as tokens/s (90% of repetitions were at least this fast)."""

    batch: int
    new_tokens_per_request: int
    tokens_per_s_median: float
    tokens_per_s_p90: float
    end_to_end_tokens_per_s_median: float
    samples_tokens_per_s: tuple[float, ...]
    steady_tokens_per_s_median: float
    hit_tokens_per_request: int
    same_tokens_as_batch_1: bool


@dataclass(frozen=True, slots=True)
class StepRates:
    """The worker's decode at one batch next to its reference steps at the prompt's context
    (tokens/s: batch over the median step time), and the ratios of tokens/s between them. A
    ratio is the median over repetitions of the ratio within one: the worker's run against the
    reference calls just before it, so the slow drifts of a shared machine cancel out. The
    worker's rate is given over its whole span (from the first request's first step: the pulls
    of the requests joining after it are in it) and steady (while the whole batch decoded)."""

    batch: int
    context_tokens: int
    worker_tokens_per_s: float
    worker_steady_tokens_per_s: float
    model_step_tokens_per_s: float
    gathered_step_tokens_per_s: float
    dense_step_tokens_per_s: float
    model_step_median_s: float
    gathered_step_median_s: float
    dense_step_median_s: float
    worker_to_model_step_ratio: float
    worker_to_dense_ratio: float
    worker_steady_to_model_step_ratio: float
    worker_steady_to_dense_ratio: float
    model_step_to_dense_ratio: float
    gathered_step_to_dense_ratio: float


def steady_rate(times: Sequence[Sequence[float]]) -> float:
    """Tokens/s of requests decoded together while all of them were: the tokens sampled after
    the last request's first step up to the first request's last step, over that span (0 when
    the requests never all decoded at once for two steps)."""
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    tokens = sum(1 for ts in times for t in ts if start < t <= end)
    return tokens / (end - start) if end > start else 0.0


def decode_rate(times: Sequence[Sequence[float]]) -> float:
    """Tokens/s of requests decoded together, from their token times: the tokens sampled after
    the first step, over the span from the first step to the last."""
    start = min(t[0] for t in times)
    end = max(t[-1] for t in times)
    tokens = sum(1 for ts in times for t in ts if t > start)
    return tokens / (end - start) if end > start else 0.0


def measure_decode(
    runtime: ModelRuntime, client: StoreClient, ids: list[int], first: int, opts: DecodeOptions
) -> tuple[tuple[Decode, ...], tuple[StepRates, ...]]:
    """Decode throughput at batch 1 and each of `opts.batches`, pulling the prompt's pages (put
    under `opts.namespace`) each time, with the reference steps at each batch timed between the
    repetitions. Raises BenchFailed when a request gives fewer tokens than asked."""
    out: list[Decode] = []
    steps: list[StepRates] = []
    reference: tuple[int, ...] = ()
    params = SamplingParams(max_tokens=1 + opts.new_tokens, ignore_eos=True)
    request = DecodeRequest(tuple(ids), (first,), params, opts.namespace)
    for batch in sorted({1, *opts.batches}):
        calls = (opts.decode_reps + 1) * opts.reference_steps
        model = ModelSteps(runtime, batch, len(ids), calls, opts.seed)
        dense = DenseStep(runtime, batch, len(ids), calls, opts.seed)
        worker = DecodeWorker(
            runtime,
            client,
            max_batch=batch,
            chunk_tokens=opts.chunk_tokens,
            kv_capacity_tokens=batch * runtime.max_context,
        )
        model_s: list[list[float]] = []  # per repetition, the calls just before its run
        gathered_s: list[list[float]] = []
        dense_s: list[list[float]] = []
        try:
            worker.generate(ids, (first,), SamplingParams(max_tokens=3), namespace=opts.namespace)
            rates, steady, e2e, same = [], [], [], True
            results: list[DecodeResult] = []
            for rep in range(-1, opts.decode_reps):  # round -1 warms the references up
                for _ in range(opts.reference_steps):
                    m = time_call(runtime, model.model_step)
                    g = time_call(runtime, model.gathered_step)
                    d = time_call(runtime, dense)
                    model.advance()
                    if rep >= 0:
                        if len(model_s) <= rep:
                            model_s.append([])
                            gathered_s.append([])
                            dense_s.append([])
                        model_s[rep].append(m)
                        gathered_s[rep].append(g)
                        dense_s[rep].append(d)
                if rep < 0:
                    continue
                began = time.monotonic()
                streams = [worker.submit(request) for _ in range(batch)]
                results = [s.result() for s in streams]
                ended = max(r.token_times_s[-1] for r in results)
                for r in results:
                    if len(r.token_ids) != opts.new_tokens:
                        raise BenchFailed(f"decode gave {len(r.token_ids)} tokens")
                    reference = reference or r.token_ids
                    same = same and r.token_ids == reference
                rates.append(decode_rate([r.token_times_s for r in results]))
                steady.append(steady_rate([r.token_times_s for r in results]))
                e2e.append(batch * opts.new_tokens / (ended - began))
                progress(
                    f"decode batch {batch} {rep + 1}/{opts.decode_reps}: {rates[-1]:.1f} tok/s; "
                    f"model step {batch / statistics.median(model_s[rep]):.1f}, dense step "
                    f"{batch / statistics.median(dense_s[rep]):.1f} tok/s"
                )
        finally:
            worker.close()
        del model, dense  # before the next batch's are built
        per_token = Stat.of([1.0 / r for r in rates])
        worker_rate = statistics.median(rates)
        out.append(
            Decode(
                batch=batch,
                new_tokens_per_request=opts.new_tokens,
                tokens_per_s_median=worker_rate,
                tokens_per_s_p90=1.0 / per_token.p90_s,
                end_to_end_tokens_per_s_median=statistics.median(e2e),
                samples_tokens_per_s=tuple(rates),
                steady_tokens_per_s_median=statistics.median(steady),
                hit_tokens_per_request=min(r.stats.hit_tokens.total for r in results),
                same_tokens_as_batch_1=same,
            )
        )
        steps.append(step_rates(batch, len(ids), rates, steady, model_s, gathered_s, dense_s))
    return tuple(out), tuple(steps)


def step_rates(
    batch: int,
    context: int,
    worker_rates: Sequence[float],
    steady_rates: Sequence[float],
    model_s: Sequence[Sequence[float]],
    gathered_s: Sequence[Sequence[float]],
    dense_s: Sequence[Sequence[float]],
) -> StepRates:
    """The rates and ratios of one batch: the worker's tokens/s of each repetition (over its
    whole span, and steady), and the seconds of each reference call, by repetition (the calls
    just before that one's run)."""

    def rate(calls: Sequence[float]) -> float:
        return batch / statistics.median(calls)

    def paired(ratios: Sequence[float]) -> float:
        return statistics.median(ratios)

    flat = [[t for rep in x for t in rep] for x in (model_s, gathered_s, dense_s)]
    model, gathered, dense = (statistics.median(x) for x in flat)
    reps = list(zip(worker_rates, model_s, gathered_s, dense_s, strict=True))
    steady = list(zip(steady_rates, model_s, dense_s, strict=True))
    return StepRates(
        batch=batch,
        context_tokens=context,
        worker_tokens_per_s=statistics.median(worker_rates),
        worker_steady_tokens_per_s=statistics.median(steady_rates),
        model_step_tokens_per_s=batch / model,
        gathered_step_tokens_per_s=batch / gathered,
        dense_step_tokens_per_s=batch / dense,
        model_step_median_s=model,
        gathered_step_median_s=gathered,
        dense_step_median_s=dense,
        worker_to_model_step_ratio=paired([w / rate(m) for w, m, _, _ in reps]),
        worker_to_dense_ratio=paired([w / rate(d) for w, _, _, d in reps]),
        worker_steady_to_model_step_ratio=paired([w / rate(m) for w, m, _ in steady]),
        worker_steady_to_dense_ratio=paired([w / rate(d) for w, _, d in steady]),
        model_step_to_dense_ratio=paired([rate(m) / rate(d) for _, m, _, d in reps]),
        gathered_step_to_dense_ratio=paired([rate(g) / rate(d) for _, _, g, d in reps]),
    )
