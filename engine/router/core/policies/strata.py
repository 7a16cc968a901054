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

from engine.router.core.estimate import prefix_groups
from engine.router.core.policies.base import no_worker, placement_of, pools, price
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import Candidate, Placement, Refusal, RequestView, WorkerView


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
        per_prefill: list[tuple[Candidate, list[Candidate]]] = []
        for prefill in servable:
            pairs = [
                price(request, prefill, decode, model, now, groups, self.decode_weight)
                for decode in pool.decoders_for(prefill)
            ]
            pairs.sort(key=lambda c: (c.cost, c.decode_id))
            per_prefill.append((pairs[0], pairs))
        best_cost = min(c.cost for c, _ in per_prefill)
        limit = best_cost * (1.0 + self.tie_tolerance)
        tied = sorted((c for c, _ in per_prefill if c.cost <= limit), key=lambda c: c.prefill_id)
        winner = tied[0] if len(tied) == 1 else rng.choice(tied)
        candidates = [winner]
        for best, pairs in per_prefill:
            if best.prefill_id == winner.prefill_id:
                candidates.extend(_lost(c, winner, self.decode_weight, request) for c in pairs[1:])
            elif best is not winner:
                candidates.append(_lost(best, winner, self.decode_weight, request))
        return placement_of(winner, self.name, tuple(candidates))


def _lost(
    cand: Candidate, winner: Candidate, decode_weight: float, request: RequestView
) -> Candidate:
    """`cand` with the reason it lost to `winner`: the part of its cost that is most above."""
    if cand.cost <= winner.cost * 1.0000001 + 1e-12:
        reason = f"tied at {cand.cost:.4g}s; the draw picked {winner.prefill_id}"
    else:
        deltas = {
            "queue": cand.queue_s - winner.queue_s,
            "pull": cand.pull_s - winner.pull_s,
            "compute": cand.compute_s - winner.compute_s,
            "decode load": decode_weight
            * request.max_tokens
            * (cand.predicted_tpot_s - winner.predicted_tpot_s),
        }
        part, delta = max(deltas.items(), key=lambda kv: kv[1])
        reason = f"cost {cand.cost:.4g}s > {winner.cost:.4g}s, mostly {part} (+{delta:.3g}s)"
    return Candidate(
        prefill_id=cand.prefill_id,
        decode_id=cand.decode_id,
        predicted_ttft_s=cand.predicted_ttft_s,
        predicted_tpot_s=cand.predicted_tpot_s,
        cost=cand.cost,
        rejected_because=reason,
        hit_tokens_used=cand.hit_tokens_used,
        queue_s=cand.queue_s,
        pull_s=cand.pull_s,
        compute_s=cand.compute_s,
    )
