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
    decode_load,
    estimate_prefill,
    estimate_tpot,
    prefix_groups,
)
from engine.router.core.policies.base import candidate, no_worker, placement_of, pools, price
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import (
    Candidate,
    Placement,
    Refusal,
    RequestView,
    Role,
    WorkerView,
)

SHORTLIST = 3  # prefill workers (and decode workers for each) priced exactly
_T = TypeVar("_T")


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
        pool = pools(request, workers)
        servable = pool.servable
        if not servable:
            return no_worker(request, workers)
        groups = prefix_groups(request)
        weight = self.decode_weight * request.max_tokens
        estimates = {p.worker_id: estimate_prefill(request, p, model, groups) for p in servable}
        loads = {d.worker_id: decode_load(d, model, now) for d in pool.decode}
        for p in servable:
            if p.role is Role.colocated:
                loads[p.worker_id] = decode_load(p, model, now)
        # Pricing every pair exactly costs P x D decode estimates. TPOT depends on the prefill
        # worker only through the join time, so first each decode worker is priced once, at
        # the earliest join; then the SHORTLIST best prefill workers are priced exactly with
        # their SHORTLIST best decode workers, and the cheapest exact pair wins.
        earliest = now + min(e.ttft_s for e in estimates.values())
        rough_tpot = {
            d.worker_id: estimate_tpot(request, d, model, now, earliest, load=loads[d.worker_id])
            for d in pool.decode
        }
        by_decode = sorted(pool.decode, key=lambda d: (rough_tpot[d.worker_id], d.worker_id))
        decode_list = self._shortlist(by_decode, [rough_tpot[d.worker_id] for d in by_decode])

        def rough_best(p: WorkerView) -> tuple[float, tuple[WorkerView, ...]]:
            if p.role is Role.colocated:
                return estimates[p.worker_id].ttft_s, (p,)
            best = rough_tpot[by_decode[0].worker_id]
            return estimates[p.worker_id].ttft_s + weight * best, decode_list

        rough = sorted(
            ((rough_best(p), p) for p in servable), key=lambda x: (x[0][0], x[1].worker_id)
        )
        shortlisted = self._shortlist(rough, [cost for (cost, _), _ in rough])
        exact: list[Candidate] = []
        for (_, decoders), p in shortlisted:
            est = estimates[p.worker_id]
            for d in decoders:
                exact.append(
                    price(
                        request,
                        p,
                        d,
                        model,
                        now,
                        decode_weight=self.decode_weight,
                        estimate=est,
                        load=loads[d.worker_id],
                        life_s=(
                            request.max_tokens * rough_tpot[d.worker_id]
                            if d.worker_id in rough_tpot
                            else None
                        ),
                    )
                )
        best_cost = min(c.cost for c in exact)
        limit = best_cost * (1.0 + self.tie_tolerance)
        tied = sorted(
            (c for c in exact if c.cost <= limit), key=lambda c: (c.prefill_id, c.decode_id)
        )
        winner = tied[0] if len(tied) == 1 else rng.choice(tied)
        candidates = [winner]
        candidates.extend(
            _lost(c, winner, self.decode_weight, request) for c in exact if c is not winner
        )
        for (_, decoders), p in rough[len(shortlisted) :]:
            d = decoders[0]
            est = estimates[p.worker_id]
            if p.role is Role.colocated:
                tpot = estimate_tpot(
                    request, d, model, now, now + est.ttft_s, load=loads[d.worker_id]
                )
            else:
                tpot = rough_tpot[d.worker_id]
            cand = candidate(request, p, d, est, tpot, self.decode_weight)
            candidates.append(_lost(cand, winner, self.decode_weight, request))
        return placement_of(winner, self.name, tuple(candidates))

    def _shortlist(self, ordered: Sequence[_T], costs: Sequence[float]) -> tuple[_T, ...]:
        """The first SHORTLIST of `ordered` (cheapest first), and every later one tied with the
        cheapest within the tolerance (so a draw can pick any of equal workers)."""
        if not ordered:
            return ()
        limit = costs[0] * (1.0 + self.tie_tolerance)
        keep = max(SHORTLIST, sum(1 for c in costs if c <= limit))
        return tuple(ordered[:keep])


def _lost(
    cand: Candidate, winner: Candidate, decode_weight: float, request: RequestView
) -> Candidate:
    """`cand` with the reason it lost to `winner`: the part of its cost that is most above."""
    if cand.cost <= winner.cost * 1.0000001 + 1e-12:
        reason = f"tied at {cand.cost:.4g}s; the draw picked {winner.prefill_id}"
    else:
        part, delta = "queue", cand.queue_s - winner.queue_s
        for name, more in (
            ("pull", cand.pull_s - winner.pull_s),
            ("compute", cand.compute_s - winner.compute_s),
            (
                "decode load",
                decode_weight
                * request.max_tokens
                * (cand.predicted_tpot_s - winner.predicted_tpot_s),
            ),
        ):
            if more > delta:
                part, delta = name, more
        reason = f"cost {cand.cost:.4g}s > {winner.cost:.4g}s, mostly {part} (+{delta:.3g}s)"
    return Candidate(
        cand.prefill_id,
        cand.decode_id,
        cand.predicted_ttft_s,
        cand.predicted_tpot_s,
        cand.cost,
        reason,
        cand.hit_tokens_used,
        cand.queue_s,
        cand.pull_s,
        cand.compute_s,
    )
