"""`strata` (the default): the pair with the lowest predicted cost, hits and load weighed together.

For each prefill-side worker P the predicted TTFT is its queue drain + pulling the usable hit
pages from their tier and node as seen from P's host + computing the missed tokens (or, when that
is cheaper, recomputing everything); for each decode worker D that can take P's output, the TPOT
of the batch D will run when P finishes. cost = TTFT + decode_weight * max_tokens * TPOT (the
request's predicted end-to-end time). The cheapest pair wins; pairs within `tie_tolerance` of it
are drawn at random from `rng`, so equal workers share a burst.

This is Mooncake's cache-aware choice and Preble's exploit/explore with rebalancing in one rule:
a request exploits the worker next to its cached prefix until that worker's queue (which the
ledger grows with every dispatch) makes it slower than pulling remotely or recomputing on a less
loaded worker; then it explores there, and a hot prefix spreads over as many workers as its load
needs. Every decision lists the priced candidates and the part of the cost each lost on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

from engine.router.core.estimate import (
    PrefillPricer,
    batch_step_s,
    decode_load,
    estimate_tpot,
    joined_batch,
    prefill_stall_s,
)
from engine.router.core.policies.base import no_worker, placement_of
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import (
    Candidate,
    CandidateList,
    Placement,
    Refusal,
    RequestView,
    Role,
    WorkerView,
)

SHORTLIST = 3  # prefill workers (and decode workers for each) priced exactly
_T = TypeVar("_T")
_Parts = tuple[float, float, float, int]  # a PrefillPricer.parts: queue, pull, compute, hit tokens


class Strata:
    name = "strata"

    def __init__(self, *, decode_weight: float = 1.0, tie_tolerance: float = 0.01) -> None:
        if decode_weight < 0:
            raise ValueError(f"decode_weight must be >= 0, got {decode_weight}")
        if not 0 <= tie_tolerance < 1:
            raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance}")
        self.decode_weight = decode_weight
        self.tie_tolerance = tie_tolerance

    def place(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        model: TimeModel,
        now: float,
        rng: random.Random,
    ) -> Placement | Refusal:
        # The pools (base.pools, in one pass): healthy workers of the request's model; a
        # co-located worker pairs only with itself, a prefill-only one with every decode worker.
        want = request.model
        prefill_side: list[WorkerView] = []
        decoders: list[WorkerView] = []
        for w in workers:
            if w.healthy and (not want or w.model == want):
                if w.role is Role.decode:
                    decoders.append(w)
                elif w.role in (Role.prefill, Role.colocated):
                    prefill_side.append(w)
        servable = [p for p in prefill_side if decoders or p.role is Role.colocated]
        if not servable:
            return no_worker(request, workers)
        # Everything per worker is worked out once: its prefill parts and TTFT, and for decode
        # workers the predicted batch; pairs are then priced from plain numbers, and the
        # Candidate records (with the reason each lost) are built only if the explanation is read.
        pricer = PrefillPricer(request, model)
        parts = {p.worker_id: pricer.parts(p) for p in servable}
        ttft = {wid: q + pull + compute for wid, (q, pull, compute, _) in parts.items()}
        loads = {d.worker_id: decode_load(d, model, now) for d in decoders}
        stall: dict[str, float] = {}
        for p in servable:
            if p.role is Role.colocated:
                loads[p.worker_id] = decode_load(p, model, now)
                stall[p.worker_id] = prefill_stall_s(request, p, model, 1.0)
        max_tokens = request.max_tokens
        own = request.prompt_tokens + max_tokens / 2.0
        weight = self.decode_weight * max_tokens
        # Pricing every pair exactly costs P x D decode estimates. TPOT depends on the prefill
        # worker only through the join time, so first each decode worker is priced once, at
        # the earliest join; then the SHORTLIST best prefill workers are priced exactly with
        # their SHORTLIST best decode workers, and the cheapest exact pair wins.
        earliest = now + min(ttft.values())
        rough_tpot: dict[str, float] = {}
        for d in decoders:
            running, context = joined_batch(loads[d.worker_id], model, own, max_tokens, earliest)
            rough_tpot[d.worker_id] = batch_step_s(model, running + 1.0, context + own, d.max_batch)
        by_decode = sorted(decoders, key=lambda d: (rough_tpot[d.worker_id], d.worker_id))
        decode_list = tuple(
            self._shortlist(by_decode, [rough_tpot[d.worker_id] for d in by_decode])
        )
        best_rough = rough_tpot[by_decode[0].worker_id] if by_decode else 0.0
        rough: list[tuple[float, WorkerView, tuple[WorkerView, ...]]] = []
        for p in servable:
            if p.role is Role.colocated:
                rough.append((ttft[p.worker_id], p, (p,)))
            else:
                rough.append((ttft[p.worker_id] + weight * best_rough, p, decode_list))
        rough.sort(key=lambda x: (x[0], x[1].worker_id))
        shortlisted = self._shortlist(rough, [cost for cost, _, _ in rough])
        # exact pairs: (cost, prefill, decode, tpot)
        exact: list[tuple[float, WorkerView, WorkerView, float]] = []
        for _, p, pair_with in shortlisted:
            p_ttft = ttft[p.worker_id]
            join = now + p_ttft
            for d in pair_with:
                did = d.worker_id
                life = max_tokens * rough_tpot[did] if did in rough_tpot else None
                running, context = joined_batch(loads[did], model, own, max_tokens, join, life)
                tpot = batch_step_s(model, running + 1.0, context + own, d.max_batch)
                if d.role is Role.colocated:
                    tpot += stall[did]
                exact.append((p_ttft + weight * tpot, p, d, tpot))
        limit = min(e[0] for e in exact) * (1.0 + self.tie_tolerance)
        tied = sorted(
            (e for e in exact if e[0] <= limit), key=lambda e: (e[1].worker_id, e[2].worker_id)
        )
        won = tied[0] if len(tied) == 1 else rng.choice(tied)
        cost, p, d, tpot = won
        q, pull, compute, hit = parts[p.worker_id]
        winner = Candidate(
            p.worker_id, d.worker_id, ttft[p.worker_id], tpot, cost, "", hit, q, pull, compute
        )

        def explain() -> list[Candidate]:
            """The other candidates, each with why it lost: the exact pairs, then the prefill
            workers left out of the shortlist, each with its best decode worker."""
            out = []
            for e in exact:
                if e is not won:
                    out.append(self._lost(e[1], e[2], e[3], parts, ttft, winner, max_tokens))
            for _, p, pair_with in rough[len(shortlisted) :]:
                d = pair_with[0]
                if p.role is Role.colocated:
                    pid = p.worker_id
                    tpot = estimate_tpot(
                        request, d, model, now, now + ttft[pid], load=loads[d.worker_id]
                    )
                else:
                    tpot = rough_tpot[d.worker_id]
                out.append(self._lost(p, d, tpot, parts, ttft, winner, max_tokens))
            return out

        count = len(exact) + len(rough) - len(shortlisted)
        return placement_of(winner, self.name, CandidateList(winner, count, explain))

    def _shortlist(self, ordered: Sequence[_T], costs: Sequence[float]) -> Sequence[_T]:
        """The first SHORTLIST of `ordered` (cheapest first), and every later one tied with the
        cheapest within the tolerance (so a draw can pick any of equal workers)."""
        if not ordered:
            return ()
        limit = costs[0] * (1.0 + self.tie_tolerance)
        keep = max(SHORTLIST, sum(1 for c in costs if c <= limit))
        return ordered[:keep]

    def _lost(
        self,
        p: WorkerView,
        d: WorkerView,
        tpot: float,
        parts: dict[str, _Parts],
        ttft: dict[str, float],
        winner: Candidate,
        max_tokens: int,
    ) -> Candidate:
        """The candidate (p, d) with the reason it lost to `winner`: the part of its cost that
        is most above the winner's."""
        q, pull, compute, hit = parts[p.worker_id]
        p_ttft = ttft[p.worker_id]
        cost = p_ttft + self.decode_weight * max_tokens * tpot
        if cost <= winner.cost * 1.0000001 + 1e-12:
            reason = f"tied at {cost:.4g}s; the draw picked {winner.prefill_id}"
        else:
            part, delta = "queue", q - winner.queue_s
            for name, more in (
                ("pull", pull - winner.pull_s),
                ("compute", compute - winner.compute_s),
                (
                    "decode load",
                    self.decode_weight * max_tokens * (tpot - winner.predicted_tpot_s),
                ),
            ):
                if more > delta:
                    part, delta = name, more
            reason = f"cost {cost:.4g}s > {winner.cost:.4g}s, mostly {part} (+{delta:.3g}s)"
        return Candidate(
            p.worker_id, d.worker_id, p_ttft, tpot, cost, reason, hit, q, pull, compute
        )
