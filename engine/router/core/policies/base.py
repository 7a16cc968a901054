"""The placement policy protocol and what every policy shares: pools, pairs, pricing a pick.

A policy is a small object with a `name` and a pure `place` method: given the request, a snapshot
of the workers (with the ledger's dispatches already applied), the time model, `now` and a seeded
`rng`, it returns a `Placement`, or a `Refusal` with reason `no_worker` when nothing can serve.
Admission, not the policy, decides whether the pick meets the request's SLO, so every placement
carries predicted TTFT and TPOT, whichever policy made it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from engine.router.core.estimate import (
    DecodeLoad,
    PrefillEstimate,
    PrefixGroups,
    eligible,
    estimate_prefill,
    estimate_tpot,
    prefix_groups,
)
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import (
    Candidate,
    Placement,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    WorkerView,
)

NO_WORKER_RETRY_S = 1.0  # a hint for clients when no worker is up; the shell may override it


@runtime_checkable
class Policy(Protocol):
    name: str

    def place(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        model: TimeModel,
        now: float,
        rng: random.Random,
    ) -> Placement | Refusal: ...


@dataclass(frozen=True, slots=True)
class Pools:
    """The workers that may take a request: prefill side, and decode side for each prefill worker.

    A co-located worker pairs only with itself; a prefill-only worker with every decode-only one.
    """

    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]

    def decoders_for(self, prefill: WorkerView) -> tuple[WorkerView, ...]:
        if prefill.role is Role.colocated:
            return (prefill,)
        return self.decode

    @property
    def servable(self) -> tuple[WorkerView, ...]:
        """Prefill-side workers that have somewhere to decode."""
        return tuple(p for p in self.prefill if self.decoders_for(p))


def pools(request: RequestView, workers: Sequence[WorkerView]) -> Pools:
    ok = eligible(workers, request)
    return Pools(
        prefill=tuple(w for w in ok if w.does_prefill),
        decode=tuple(w for w in ok if w.role is Role.decode),
    )


def no_worker(request: RequestView, workers: Sequence[WorkerView]) -> Refusal:
    healthy = sum(1 for w in workers if w.healthy)
    want = f"model {request.model!r}" if request.model else "the request"
    return Refusal(
        RefusalReason.no_worker,
        NO_WORKER_RETRY_S,
        f"no healthy prefill+decode pair serves {want} ({healthy} of {len(workers)} workers healthy)",
        request.slo_class,
    )


def price(
    request: RequestView,
    prefill: WorkerView,
    decode: WorkerView,
    model: TimeModel,
    now: float,
    groups: PrefixGroups | None = None,
    decode_weight: float = 1.0,
    *,
    estimate: PrefillEstimate | None = None,
    load: DecodeLoad | None = None,
    life_s: float | None = None,
) -> Candidate:
    """The candidate (prefill, decode) with its predicted TTFT, TPOT and cost.

    cost = TTFT + decode_weight * max_tokens * TPOT: the request's predicted end-to-end time
    with the default weight. `estimate`, `load` and `life_s` are the prefill estimate, the
    decode load and the request's decode time when the caller has them already.
    """
    est = estimate if estimate is not None else estimate_prefill(request, prefill, model, groups)
    tpot = estimate_tpot(request, decode, model, now, now + est.ttft_s, load=load, life_s=life_s)
    return candidate(request, prefill, decode, est, tpot, decode_weight)


def candidate(
    request: RequestView,
    prefill: WorkerView,
    decode: WorkerView,
    est: PrefillEstimate,
    tpot: float,
    decode_weight: float = 1.0,
) -> Candidate:
    return Candidate(
        prefill_id=prefill.worker_id,
        decode_id=decode.worker_id,
        predicted_ttft_s=est.ttft_s,
        predicted_tpot_s=tpot,
        cost=est.ttft_s + decode_weight * request.max_tokens * tpot,
        hit_tokens_used=est.hit_tokens_used,
        queue_s=est.queue_s,
        pull_s=est.pull_s,
        compute_s=est.compute_s,
    )


def placement_of(
    winner: Candidate, policy: str, candidates: tuple[Candidate, ...] = ()
) -> Placement:
    return Placement(
        prefill_id=winner.prefill_id,
        decode_id=winner.decode_id,
        predicted_ttft_s=winner.predicted_ttft_s,
        predicted_tpot_s=winner.predicted_tpot_s,
        policy=policy,
        candidates=candidates or (winner,),
        predicted_queue_s=winner.queue_s,
        prefill_work_s=winner.pull_s + winner.compute_s,
        hit_tokens_used=winner.hit_tokens_used,
    )


def pick_pair(
    request: RequestView,
    prefill: WorkerView,
    decode: WorkerView,
    model: TimeModel,
    now: float,
    policy: str,
) -> Placement:
    """A placement for a pair a simple policy chose, priced so admission can judge it."""
    cand = price(request, prefill, decode, model, now, prefix_groups(request))
    return placement_of(cand, policy)


_Key = TypeVar("_Key", int, tuple[int, int])


def lowest(
    workers: Sequence[WorkerView],
    key: Callable[[WorkerView], _Key],
    rng: random.Random,
) -> WorkerView:
    """A random one of the workers with the smallest `key(worker)` (ties drawn from `rng` in
    worker-id order, so a seed gives the same pick)."""
    keyed = [(key(w), w) for w in workers]
    best = min(k for k, _ in keyed)
    tied = sorted((w for k, w in keyed if k == best), key=lambda w: w.worker_id)
    return tied[0] if len(tied) == 1 else rng.choice(tied)
