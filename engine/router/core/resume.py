"""Placing the rest of a decode whose worker died: a decode-only placement, priced like any other.

A resumed decode skips the prefill pool: the new decode worker pulls the pages of prompt + output
so far from the store, recomputes the tail it cannot pull, and continues for the tokens left.
`place_resume` prices each candidate (a decode-only worker, or a co-located one for a co-located
run; never one in `exclude`) as

    catch-up = pull of the hit pages from their tier and node as seen from the worker's host
               + compute of the missed context (or a full recompute, when that is cheaper)
    TPOT     = one step of the batch the worker is predicted to run once the request rejoins
    cost     = catch-up + remaining_tokens * TPOT

and returns the cheapest as a `Placement` (prefill_id == decode_id == the chosen worker: the
catch-up runs there; `predicted_ttft_s` is the catch-up, i.e. the time to the next token), with
every candidate and the part of its cost it lost on; a `Refusal(no_worker)` when no worker may
take it. Ties go to the lowest worker id, so a resume is reproducible from its inputs.

`resume_view` turns the original request into the view of its rest: the context is prompt +
produced tokens, `max_tokens` what is left. Pure: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from engine.router.core.estimate import (
    decode_load,
    eligible,
    estimate_prefill,
    estimate_tpot,
    prefix_groups,
)
from engine.router.core.policies.base import NO_WORKER_RETRY_S, candidate, placement_of
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

RESUME_POLICY = "resume"


def resume_view(request: RequestView, produced: int) -> RequestView:
    """The rest of `request` after `produced` output tokens: context prompt + produced, at least
    one token still to generate. The prefix answer stays the prompt's (the output's pages may
    not be stored yet, so they are priced as recomputed)."""
    if produced < 0:
        raise ValueError(f"produced must be >= 0, got {produced}")
    return dataclasses.replace(
        request,
        prompt_tokens=request.prompt_tokens + produced,
        max_tokens=max(1, request.max_tokens - produced),
    )


def place_resume(
    request: RequestView,
    workers: Sequence[WorkerView],
    model: TimeModel,
    now: float,
    *,
    colocated: bool,
    exclude: Collection[str] = (),
) -> Placement | Refusal:
    """The decode worker to continue `request` (already a `resume_view`) on; see module doc."""
    want = Role.colocated if colocated else Role.decode
    pool = sorted(
        (w for w in eligible(workers, request) if w.role is want and w.worker_id not in exclude),
        key=lambda w: w.worker_id,
    )
    if not pool:
        return Refusal(
            RefusalReason.no_worker,
            NO_WORKER_RETRY_S,
            f"no other healthy {want.value} worker can continue the decode ({len(exclude)} tried)",
            request.slo_class,
        )
    groups = prefix_groups(request)
    priced: list[Candidate] = []
    for w in pool:
        est = estimate_prefill(request, w, model, groups)
        if w.role is Role.decode:
            # a decode worker has no prefill queue: its catch-up runs between its steps
            est = dataclasses.replace(est, queue_s=0.0)
        load = decode_load(w, model, now)
        tpot = estimate_tpot(request, w, model, now, now + est.ttft_s, load=load)
        priced.append(candidate(request, w, w, est, tpot))
    winner = min(priced, key=lambda c: (c.cost, c.decode_id))
    ranked = [winner, *(_lost(c, winner, request) for c in priced if c is not winner)]
    return placement_of(winner, RESUME_POLICY, tuple(ranked))


def _lost(cand: Candidate, winner: Candidate, request: RequestView) -> Candidate:
    parts = {
        "queue": cand.queue_s - winner.queue_s,
        "pull": cand.pull_s - winner.pull_s,
        "compute": cand.compute_s - winner.compute_s,
        "decode load": request.max_tokens * (cand.predicted_tpot_s - winner.predicted_tpot_s),
    }
    part = max(parts, key=lambda k: parts[k])
    if cand.cost <= winner.cost:
        reason = f"tied at {cand.cost:.4g}s; the lower worker id {winner.decode_id} wins"
    else:
        reason = f"cost {cand.cost:.4g}s > {winner.cost:.4g}s, mostly {part} (+{parts[part]:.3g}s)"
    return dataclasses.replace(cand, rejected_because=reason)
