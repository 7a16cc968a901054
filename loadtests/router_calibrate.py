"""Measuring a time model on running workers through their gRPC services (for `strata bench router`).

The router's predictions are only as good as its time model, so the benchmark measures one on
the workers it then routes to, the way a profile is measured: on the workers' own timings.

- prefill: `PrefillResponse.timings` of prompts with `new` computed tokens after `cached` ones
  (a first prefill of the prefix publishes its pages; the second prompt extends it), seconds =
  compute + sample (queue, lookup and publishing are not the model's prefill term);
- pull: the second prefill's `pull_s` for its hit pages (DRAM, same host);
- decode: `batch` concurrent Decode streams with `context` tokens of prompt each; the step time
  is one stream's time per token while all streams run (its span over its tokens: a worker's
  stream delivers tokens in bursts, so single gaps are mostly ~0 with a long one now and then,
  and their median is not a step).

Each point is measured `reps` times and its median kept. Fitted by `TimeModel.fit`.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Sequence

import grpc

from engine.router.core.timemodel import (
    DecodeSample,
    Machine,
    PrefillSample,
    Provenance,
    PullSample,
    Samples,
    TimeModel,
)
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import DecodeStub, PrefillStub


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(length)]


def _greedy(tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=tokens, ignore_eos=True)


def calibrate(
    prefill_address: str,
    decode_address: str,
    *,
    vocab_size: int,
    page_tokens: int,
    page_bytes: int,
    new_tokens: Sequence[int] = (16, 128, 384),
    cached_tokens: Sequence[int] = (0, 256),
    batches: Sequence[int] = (1, 2, 4),
    contexts: Sequence[int] = (64, 384),
    decode_steps: int = 12,
    reps: int = 3,
    note: str = "",
) -> TimeModel:
    """A TimeModel fitted on measurements of the two workers (see the module doc)."""
    pre: list[PrefillSample] = []
    pulls: list[PullSample] = []
    seed = 1 + (uuid.uuid4().int % 1_000_000)  # fresh prompts: nothing cached from before
    with grpc.insecure_channel(prefill_address) as pch:
        stub = PrefillStub(pch)
        stub.Prefill(pb.PrefillRequest(token_ids=_prompt(seed, 32, vocab_size),
                                       sampling=_greedy(1)), timeout=120)  # fmt: skip  # warm-up
        for cached in cached_tokens:
            for new in new_tokens:
                computes: list[float] = []
                pull_s: list[float] = []
                for _ in range(reps):
                    seed += 1
                    ids = _prompt(seed, cached + new, vocab_size)
                    if cached:
                        stub.Prefill(pb.PrefillRequest(token_ids=ids[:cached],
                                                       sampling=_greedy(1)), timeout=120)  # fmt: skip
                    reply = stub.Prefill(pb.PrefillRequest(token_ids=ids, sampling=_greedy(1)),
                                         timeout=120)  # fmt: skip
                    hit = reply.hit_tokens.gpu + reply.hit_tokens.dram + reply.hit_tokens.ssd
                    computes.append(reply.timings.compute_s + reply.timings.sample_s)
                    if hit:
                        pull_s.append(reply.timings.pull_s)
                got_cached = (cached // page_tokens) * page_tokens if cached else 0
                pre.append(PrefillSample(cached + new - got_cached, got_cached,
                                         statistics.median(computes)))  # fmt: skip
                if pull_s:
                    nbytes = got_cached // page_tokens * page_bytes
                    pulls.append(PullSample("dram", True, nbytes, statistics.median(pull_s)))
    dec: list[DecodeSample] = []
    with grpc.insecure_channel(decode_address) as dch:
        stub_d = DecodeStub(dch)
        for context in contexts:
            for batch in batches:
                steps: list[float] = []
                for _ in range(reps):
                    seed += batch
                    steps.append(_decode_step(stub_d, seed, batch, context, decode_steps,
                                              vocab_size))  # fmt: skip
                dec.append(DecodeSample(batch, batch * (context + decode_steps // 2),
                                        statistics.median(steps)))  # fmt: skip
    return TimeModel.fit(
        Samples(tuple(pre), tuple(dec), tuple(pulls)),
        Provenance(
            machine=Machine(torch_device="cpu"),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            note=note or "measured by strata bench router on the workers it routes to",
        ),
    )


def _decode_step(
    stub: DecodeStub, seed: int, batch: int, context: int, steps: int, vocab: int
) -> float:
    """The first stream's time per token while `batch` streams decode together."""
    times: list[list[float]] = [[] for _ in range(batch)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            ids = _prompt(seed + i, context, vocab)
            req = pb.DecodeRequest(prompt_token_ids=ids, output_token_ids=[ids[-1] % vocab],
                                   sampling=_greedy(steps + 1))  # fmt: skip
            for event in stub.Decode(req, timeout=300):
                if event.HasField("token_id"):
                    times[i].append(time.perf_counter())
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise RuntimeError(f"decode calibration failed: {errors[0]}")
    # Gaps while every stream was running: between the last first-token and the first last-token.
    start = max(ts[0] for ts in times)
    end = min(ts[-1] for ts in times)
    mine = [t for t in times[0] if start <= t <= end]
    if len(mine) < 3:
        mine = times[0]
    if len(mine) < 2:
        raise RuntimeError("decode calibration: a stream gave fewer than two tokens")
    return (mine[-1] - mine[0]) / (len(mine) - 1)
