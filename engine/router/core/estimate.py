"""Predicting one request's TTFT on a prefill worker and its TPOT on a decode worker.

Every policy prices its pick with these functions (so admission can judge any policy's placement),
and the `strata` policy prices every candidate with them.

- TTFT on prefill worker P = the drain of P's queue (its queued prefill tokens, ledger dispatches
  included, through the time model) + pulling the hit pages, each from its tier and store node as
  seen from P's host (same host or remote) + computing the missed tokens after the pulled ones. If
  pulling is slower than recomputing from scratch (a remote SSD hit, say), P recomputes: the
  estimate takes the cheaper of the two.
- TPOT on decode worker D, for a request joining at `join_at_s`: one decode step of the batch D
  will run then. "predicted" counts the running requests that will still be there (when the worker
  reports how many tokens each may still produce) plus the dispatches that will have joined;
  "current" is the baseline that takes the batch as reported now, plus this request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.router.core.timemodel import TimeModel
from engine.router.core.types import RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """A request's usable hit pages grouped by (tier, store node host): the pull plan's shape."""

    pages: int  # hit pages the prefill may use (it always computes at least the last token)
    groups: tuple[tuple[str, str, int], ...]  # (tier, node host, pages)


def prefix_groups(request: RequestView) -> PrefixGroups:
    """Group the hit pages the request can use; at least one prompt token is always computed."""
    usable = min(request.prefix.hit_pages, (request.prompt_tokens - 1) // request.page_tokens)
    counts: dict[tuple[str, str], int] = {}
    for tier, host in zip(
        request.prefix.tiers[:usable], request.prefix.node_hosts[:usable], strict=True
    ):
        counts[(tier, host)] = counts.get((tier, host), 0) + 1
    return PrefixGroups(usable, tuple((t, h, n) for (t, h), n in counts.items()))


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    queue_s: float
    pull_s: float
    compute_s: float
    hit_tokens_used: int

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.pull_s + self.compute_s

    @property
    def work_s(self) -> float:
        """What this request adds to the worker's queue (pull + compute)."""
        return self.pull_s + self.compute_s


def queue_s(worker: WorkerView, model: TimeModel) -> float:
    """Seconds until `worker` would start a new prefill (its queue, drained through the model)."""
    return model.queue_drain_s(worker.queued_prefill_tokens, worker.queued_requests)


def estimate_prefill(
    request: RequestView,
    worker: WorkerView,
    model: TimeModel,
    groups: PrefixGroups | None = None,
) -> PrefillEstimate:
    """The predicted TTFT of `request` on prefill worker `worker`, split into its parts."""
    plan = groups if groups is not None else prefix_groups(request)
    waiting = queue_s(worker, model)
    recompute = model.prefill_s(request.prompt_tokens, 0)
    if plan.pages == 0:
        return PrefillEstimate(waiting, 0.0, recompute, 0)
    pull = 0.0
    for tier, host, pages in plan.groups:
        pull += model.pull_s(pages * request.page_bytes, tier, host == worker.host_id)
    hit_tokens = plan.pages * request.page_tokens
    compute = model.prefill_s(request.prompt_tokens - hit_tokens, hit_tokens)
    if pull + compute < recompute:
        return PrefillEstimate(waiting, pull, compute, hit_tokens)
    return PrefillEstimate(waiting, 0.0, recompute, 0)


def load_over(
    worker: WorkerView, model: TimeModel, now: float, start_s: float, end_s: float
) -> tuple[float, float]:
    """(requests, context tokens) `worker` is predicted to decode, averaged over [start_s, end_s]
    (the load at `start_s` when the two are equal).

    A running request stays until its reported remaining tokens run out at today's step time
    (forever when the worker does not report them); a ledger dispatch is there from its join
    until its `max_tokens` have run at the step of the fullest batch it could see.
    """
    running = worker.running_requests
    context = worker.running_context_tokens
    span = end_s - start_s
    step = model.decode_step_s(max(running, 1), context)
    joins = worker.pending_joins
    join_step = model.decode_step_s(
        running + len(joins), context + sum(j.context_tokens for j in joins)
    )
    requests = float(running)
    tokens = float(context)
    if worker.running_remaining_tokens and running > 0 and step > 0:
        reported_at = now - worker.report_age_s
        share = 0.0
        for remaining in worker.running_remaining_tokens[:running]:
            share += _presence(reported_at, reported_at + remaining * step, start_s, span)
        requests = share
        tokens = context * share / running
    for join in joins:
        presence = _presence(
            join.join_at_s, join.join_at_s + join.max_tokens * join_step, start_s, span
        )
        requests += presence
        tokens += join.context_tokens * presence
    return requests, tokens


def _presence(since: float, until: float, start_s: float, span: float) -> float:
    """The fraction of [start_s, start_s + span] within [since, until) (presence at start_s for
    an empty span)."""
    if span <= 0:
        return 1.0 if since <= start_s < until else 0.0
    overlap = min(until, start_s + span) - max(since, start_s)
    return max(overlap, 0.0) / span


def estimate_tpot(
    request: RequestView,
    worker: WorkerView,
    model: TimeModel,
    now: float,
    join_at_s: float,
    mode: str = "predicted",
) -> float:
    """Predicted seconds per output token of `request` on decode worker `worker`.

    "predicted": the batch averaged over the request's life from `join_at_s` (its length taken
    at the step time of the batch it joins); "current": the batch as reported, plus itself.
    The request's own context is its prompt plus half its generation (its mean over its life).
    A batch past `max_batch` time-shares the worker: the step stretches in proportion.
    """
    own = request.prompt_tokens + request.max_tokens / 2.0
    if mode == "predicted":
        running, context = load_over(worker, model, now, join_at_s, join_at_s)
        life = request.max_tokens * _step(model, running + 1.0, context + own, worker.max_batch)
        running, context = load_over(worker, model, now, join_at_s, join_at_s + life)
    elif mode == "current":
        running, context = float(worker.running_requests), float(worker.running_context_tokens)
    else:
        raise ValueError(f"unknown load mode {mode!r} (predicted, current)")
    return _step(model, running + 1.0, context + own, worker.max_batch)


def _step(model: TimeModel, batch: float, context: float, max_batch: int) -> float:
    cap = max(max_batch, 1)
    if batch <= cap:
        return (
            model.decode.fixed_s
            + model.decode.per_request_s * batch
            + (model.decode.per_context_token_s * context)
        )
    return _step(model, cap, context * cap / batch, cap) * batch / cap


def eligible(workers: Sequence[WorkerView], request: RequestView) -> list[WorkerView]:
    """Healthy workers serving the request's model ("" = any)."""
    return [w for w in workers if w.healthy and (not request.model or w.model == request.model)]
