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

How it stays cheap (for 16 workers about 2.5x the CPU of a `round_robin` decision, 2.5-3x less
than when each candidate was priced with `estimate_prefill` and `estimate_tpot`; `strata bench
decisions`, docs/benchmarks.md):
what depends on one worker is worked out once per decision (each prefill worker's TTFT parts,
each host's pull, each decode worker's predicted batch), pairs are priced from plain numbers
(`DecodeLoad.steps_at` prices one decode worker at every shortlisted join in one loop), and the
`Candidate` records with the reason each lost, which cost more to build than the decision, are
built only when the explanation is read (`CandidateList`). The choice is the same as pricing
every candidate with `estimate_prefill` and `estimate_tpot` (tests/unit/
test_router_decisions_golden.py pins it on a seeded corpus).
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Sequence
from typing import TypeVar

from engine.router.core.estimate import (
    PrefillPricer,
    decode_load,
    estimate_tpot,
    prefill_stall_s,
)
from engine.router.core.policies.base import no_worker
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

# Looking up an enum member costs a few hundred ns on every use; these run for every worker of
# every decision.
_COLOCATED, _DECODE = Role.colocated, Role.decode
_PREFILL_SIDE = (Role.prefill, Role.colocated)
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
                if w.role is _DECODE:
                    decoders.append(w)
                elif w.role in _PREFILL_SIDE:
                    prefill_side.append(w)
        servable = [p for p in prefill_side if decoders or p.role is _COLOCATED]
        if not servable:
            return no_worker(request, workers)
        # Everything per worker is worked out once: its prefill parts and TTFT, and for decode
        # workers the predicted batch; pairs are then priced from plain numbers, and the
        # Candidate records (with the reason each lost) are built only if the explanation is read.
        pricer = PrefillPricer(request, model)
        parts = [pricer.parts(p) for p in servable]
        ttft = [q + pull + compute for q, pull, compute, _ in parts]
        max_tokens = request.max_tokens
        own = request.prompt_tokens + max_tokens / 2.0
        weight = self.decode_weight * max_tokens
        # Pricing every pair exactly costs P x D decode estimates. TPOT depends on the prefill
        # worker only through the join time, so first each decode worker is priced once, at
        # the earliest join; then the SHORTLIST best prefill workers are priced exactly with
        # their SHORTLIST best decode workers, and the cheapest exact pair wins.
        earliest = (now + min(ttft),)
        loads = [decode_load(d, model, now) for d in decoders]
        # (rough TPOT, worker id, index): sorted in (TPOT, id) order, nothing else compared
        by_decode = sorted(
            (load.steps_at(model, own, max_tokens, earliest)[0], d.worker_id, k)
            for k, (d, load) in enumerate(zip(decoders, loads, strict=True))
        )
        decode_list = self._shortlist(by_decode, [t for t, _, _ in by_decode])
        best_rough = by_decode[0][0] if by_decode else 0.0
        # (rough cost, worker id, index); a co-located worker's rough cost is its TTFT
        rough = sorted(
            (ttft[i] if p.role is _COLOCATED else ttft[i] + weight * best_rough, p.worker_id, i)
            for i, p in enumerate(servable)
        )
        shortlisted = self._shortlist(rough, [cost for cost, _, _ in rough])
        # Exact prices: per decode worker of the shortlist, the TPOT at the join of each split
        # prefill worker shortlisted (in one call); a co-located worker with its own batch.
        split = [i for _, _, i in shortlisted if servable[i].role is not _COLOCATED]
        joins = [now + ttft[i] for i in split]
        by_worker = [
            (k, loads[k].steps_at(model, own, max_tokens, joins, max_tokens * tpot))
            for tpot, _, k in (decode_list if split else ())
        ]
        # exact pairs in the order priced: (cost, prefill index, decode index (-1: itself), tpot)
        exact: list[tuple[float, int, int, float]] = []
        at = 0  # the shortlisted split worker's place in `joins`
        for _, _, i in shortlisted:
            p = servable[i]
            p_ttft = ttft[i]
            if p.role is _COLOCATED:
                own_load = decode_load(p, model, now)
                tpot = own_load.steps_at(model, own, max_tokens, (now + p_ttft,))[0]
                tpot += prefill_stall_s(request, p, model, 1.0)
                exact.append((p_ttft + weight * tpot, i, -1, tpot))
                continue
            for k, steps in by_worker:
                tpot = steps[at]
                exact.append((p_ttft + weight * tpot, i, k, tpot))
            at += 1
        limit = min(e[0] for e in exact) * (1.0 + self.tie_tolerance)
        tied = sorted(
            (servable[i].worker_id, servable[i].worker_id if k < 0 else decoders[k].worker_id, n)
            for n, (cost, i, k, _) in enumerate(exact)
            if cost <= limit
        )
        won = exact[tied[0][2] if len(tied) == 1 else rng.choice(tied)[2]]
        cost, i, k, tpot = won
        p = servable[i]
        d = p if k < 0 else decoders[k]
        q, pull, compute, hit = parts[i]

        def explain() -> list[Candidate]:
            """Every candidate, the winner first, each other with why it lost: the exact pairs,
            then the prefill workers left out of the shortlist, each with its best decode
            worker (its own batch for a co-located one)."""
            winner = Candidate(
                p.worker_id, d.worker_id, ttft[i], tpot, cost, "", hit, q, pull, compute
            )
            out = [winner]
            for e in exact:
                if e is not won:
                    pe = servable[e[1]]
                    de = pe if e[2] < 0 else decoders[e[2]]
                    out.append(
                        self._lost(pe, de, e[3], parts[e[1]], ttft[e[1]], winner, max_tokens)
                    )
            for _, _, j in rough[len(shortlisted) :]:
                pj = servable[j]
                if pj.role is _COLOCATED:
                    load = decode_load(pj, model, now)
                    dj, tpot_j = (
                        pj,
                        estimate_tpot(request, pj, model, now, now + ttft[j], load=load),
                    )
                else:
                    dj, tpot_j = decoders[by_decode[0][2]], by_decode[0][0]
                out.append(self._lost(pj, dj, tpot_j, parts[j], ttft[j], winner, max_tokens))
            return out

        count = len(exact) + len(rough) - len(shortlisted)
        return Placement(
            prefill_id=p.worker_id,
            decode_id=d.worker_id,
            predicted_ttft_s=ttft[i],
            predicted_tpot_s=tpot,
            policy=self.name,
            candidates=CandidateList(count, explain),
            predicted_queue_s=q,
            prefill_work_s=pull + compute,
            hit_tokens_used=hit,
        )

    def _shortlist(self, ordered: Sequence[_T], costs: Sequence[float]) -> Sequence[_T]:
        """The first SHORTLIST of `ordered` (cheapest first), and every later one tied with the
        cheapest within the tolerance (so a draw can pick any of equal workers)."""
        if not ordered:
            return ()
        limit = costs[0] * (1.0 + self.tie_tolerance)
        keep = max(SHORTLIST, bisect_right(costs, limit))  # costs ascend: those <= limit
        return ordered[:keep]

    def _lost(
        self,
        p: WorkerView,
        d: WorkerView,
        tpot: float,
        parts: _Parts,
        p_ttft: float,
        winner: Candidate,
        max_tokens: int,
    ) -> Candidate:
        """The candidate (p, d) with the reason it lost to `winner`: the part of its cost that
        is most above the winner's."""
        q, pull, compute, hit = parts
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
