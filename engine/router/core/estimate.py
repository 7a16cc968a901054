"""Predicting one request's TTFT on a prefill worker and its TPOT on a decode worker.

Every policy prices its pick with these functions (so admission can judge any policy's placement),
and the `strata` policy prices every candidate with them.

- TTFT on prefill worker P = the drain of P's queue (its queued prefill tokens, ledger dispatches
  included, through the time model) + pulling the hit pages, per tier: those on a store node on
  P's host over the same-host path, the others as one remote transfer (a cluster client fetches
  the nodes in parallel) + computing the missed tokens after the pulled ones. If
  pulling is slower than recomputing from scratch (a remote SSD hit, say), P recomputes: the
  estimate takes the cheaper of the two. On a co-located worker that reports its step token
  budget, every step of prefill chunks also runs a decode step of its batch, and both its queue
  and this request's compute pay for it.
- TPOT on decode worker D, for a request joining at `join_at_s`: one decode step of the batch D
  will run then. "predicted" counts the running requests that will still be there (when the worker
  reports how many tokens each may still produce) plus the dispatches that will have joined;
  "current" is the baseline that takes the batch as reported now, plus this request. The
  predicted batch never shrinks below the one at the join: under sustained load the departures
  during a request's life are replaced by newcomers (averaging them away made the prediction run
  about 20% low at 2x overload in the simulator). On a co-located worker every step also waits
  for the prefill work interleaved into it (`prefill_stall_s`).
- A queue's drain is counted from the report: the `report_age_s` the worker has spent draining
  it since is taken off (counting it again made TTFT run about 45% high at 2x overload).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from engine.router.core.timemodel import TimeModel
from engine.router.core.types import RequestView, Role, WorkerView

# Looking up an enum member costs a few hundred ns on every use; these run for every worker of
# every decision.
_COLOCATED = Role.colocated


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """A request's usable hit pages, the pull plan's shape: per tier, how many pages in all and
    how many on each store node's host."""

    pages: int  # hit pages the prefill may use (it always computes at least the last token)
    by_tier: tuple[tuple[str, int, dict[str, int]], ...]  # (tier, pages, {node host: pages})


def prefix_groups(request: RequestView) -> PrefixGroups:
    """Group the hit pages the request can use; at least one prompt token is always computed."""
    usable = min(request.prefix.hit_pages, (request.prompt_tokens - 1) // request.page_tokens)
    if usable <= 0:
        return PrefixGroups(0, ())
    tiers, hosts = request.prefix.tiers[:usable], request.prefix.node_hosts[:usable]
    tier, host = tiers[0], hosts[0]
    if tiers.count(tier) == usable:  # one tier (on one node, or spread over nodes)
        if hosts.count(host) == usable:
            return PrefixGroups(usable, ((tier, usable, {host: usable}),))
        return PrefixGroups(usable, ((tier, usable, dict(Counter(hosts))),))
    per_tier: dict[str, dict[str, int]] = {}
    # (PrefixHit checks that tiers and hosts are as long as the hit)
    for (tier, host), count in Counter(zip(tiers, hosts)).items():  # noqa: B905
        per_tier.setdefault(tier, {})[host] = count
    return PrefixGroups(usable, tuple((t, sum(h.values()), h) for t, h in per_tier.items()))


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
    """Seconds until `worker` would start a new prefill: its queue drained through the model,
    less the `report_age_s` it has already been draining since it reported (the queue is never
    empty in between, or the tokens the ledger added since are all that is left)."""
    tokens = worker.queued_prefill_tokens
    if tokens <= 0:
        return 0.0
    work = model.queue_drain_s(tokens, worker.queued_requests)
    if worker.role is _COLOCATED:
        work += interleaved_s(worker, model, tokens)
    if worker.report_age_s <= 0:
        return work
    return max(work - worker.report_age_s, 0.0)


def interleaved_s(worker: WorkerView, model: TimeModel, tokens: int) -> float:
    """What computing `tokens` of prefill costs a co-located worker on top of the prefill itself:
    each step of `step_token_budget` tokens also runs a decode step of its batch. Zero for other
    workers, an unknown budget, an idle batch or no tokens."""
    budget = worker.step_token_budget
    running = worker.running_requests
    if worker.role is not _COLOCATED or budget <= 0 or running <= 0 or tokens <= 0:
        return 0.0
    per_step = budget - running if budget > running else 1
    steps = -(-tokens // per_step)
    return steps * model.decode_step_s(running, worker.running_context_tokens)


class PrefillPricer:
    """One request's prefill estimate on any prefill-side worker (see `estimate_prefill`), with
    what does not depend on the worker worked out once: the recompute, the compute after the hit,
    and the pull from each host (remembered per host id). A policy builds one per decision and
    asks it for each worker; it mutates only its own memo."""

    __slots__ = ("_compute", "_hit_tokens", "_lines", "_missed", "_model", "_plan", "_prompt",
                 "_pulls", "_recompute", "_size")  # fmt: skip

    def __init__(
        self, request: RequestView, model: TimeModel, groups: PrefixGroups | None = None
    ) -> None:
        plan = groups if groups is not None else prefix_groups(request)
        self._model = model
        self._plan = plan
        self._prompt = request.prompt_tokens
        self._size = request.page_bytes
        self._recompute = model.prefill_s(request.prompt_tokens, 0)
        self._hit_tokens = plan.pages * request.page_tokens
        self._missed = request.prompt_tokens - self._hit_tokens
        self._compute = model.prefill_s(self._missed, self._hit_tokens) if plan.pages else 0.0
        # per tier: its pages, {host: pages}, and the (fixed, per byte) lines of its same-host
        # and remote paths; none when nothing is pulled (no pull profile, or no page bytes)
        lines = []
        if request.page_bytes > 0 and model.pulls:
            for tier, pages, hosts in plan.by_tier:
                same, remote = model.pull_coeffs(tier, True), model.pull_coeffs(tier, False)
                assert same is not None and remote is not None  # the model has pulls
                lines.append(
                    (pages, hosts, same.fixed_s, same.s_per_byte, remote.fixed_s, remote.s_per_byte)
                )
        self._lines = tuple(lines)
        self._pulls: dict[str, float] = {}

    def pull_s(self, host_id: str) -> float:
        """Seconds to pull the usable hit pages to a worker on `host_id`: per tier, the pages on
        that host over the same-host path, the others as one remote transfer (`TimeModel.pull_s`
        of each, the lines looked up once)."""
        found = self._pulls.get(host_id)
        if found is not None:
            return found
        pull = 0.0
        size = self._size
        for pages, hosts, same_fixed, same_per_byte, remote_fixed, remote_per_byte in self._lines:
            local = hosts.get(host_id, 0)
            if local:
                pull += same_fixed + same_per_byte * (local * size)
            if pages > local:
                pull += remote_fixed + remote_per_byte * ((pages - local) * size)
        self._pulls[host_id] = pull
        return pull

    def parts(self, worker: WorkerView) -> tuple[float, float, float, int]:
        """(queue_s, pull_s, compute_s, hit_tokens_used) of the request on `worker`: the fields
        of its `PrefillEstimate`, without building one (a policy's hot loop)."""
        model = self._model
        waiting = queue_s(worker, model)
        colocated = worker.role is _COLOCATED
        recompute = self._recompute
        if colocated:
            recompute += interleaved_s(worker, model, self._prompt)
        if self._plan.pages == 0:
            return waiting, 0.0, recompute, 0
        pull = self.pull_s(worker.host_id)
        compute = self._compute
        if colocated:
            compute += interleaved_s(worker, model, self._missed)
        if pull + compute < recompute:
            return waiting, pull, compute, self._hit_tokens
        return waiting, 0.0, recompute, 0

    def estimate(self, worker: WorkerView) -> PrefillEstimate:
        return PrefillEstimate(*self.parts(worker))


def estimate_prefill(
    request: RequestView,
    worker: WorkerView,
    model: TimeModel,
    groups: PrefixGroups | None = None,
) -> PrefillEstimate:
    """The predicted TTFT of `request` on prefill worker `worker`, split into its parts."""
    return PrefillPricer(request, model, groups).estimate(worker)


class DecodeLoad(NamedTuple):
    """A decode worker's batch over time, as predicted from its view. Built once per worker and
    decision by `decode_load`, then asked for many windows (`over`, `joined`, `steps_at`).
    Immutable; a named tuple rather than a frozen dataclass because a policy builds one for
    every decode worker in every decision, and a frozen dataclass takes several times longer to
    build.

    - `steady` requests (with `steady_context` tokens) stay throughout;
    - running requests with a known end, each with `each_context` tokens: request i is there
      from the report until `reported_at_s + remaining[i] * step_s` (`remaining` sorted, in
      tokens; `remaining_sum[i]` = the sum of the first i, so a window's overlap is a bisection
      and a difference of integers, not a loop and no sum of large absolute times);
    - `spans` (since, until, context tokens): the ledger's joins, each there for a while.
    """

    steady: float
    steady_context: float
    reported_at_s: float
    each_context: float
    remaining: tuple[int, ...]
    remaining_sum: tuple[int, ...]
    step_s: float
    spans: tuple[tuple[float, float, float], ...]
    max_batch: int

    def over(self, start_s: float, end_s: float) -> tuple[float, float]:
        """(requests, context tokens) averaged over [start_s, end_s] (at start_s if equal)."""
        requests, tokens = self.steady, self.steady_context
        span = end_s - start_s
        remaining = self.remaining
        if remaining:
            reported, step = self.reported_at_s, self.step_s
            start = start_s if start_s > reported else reported
            # remaining[first:] end after `start`, remaining[last:] outlast the window
            first = bisect_right(remaining, (start - reported) / step)
            if span <= 0:
                present = float(len(remaining) - first)
            else:
                last = bisect_right(remaining, (end_s - reported) / step, first)
                sums = self.remaining_sum
                inside = (last - first) * (reported - start) + step * (sums[last] - sums[first])
                present = (inside + (len(remaining) - last) * (end_s - start)) / span
            requests += present
            tokens += present * self.each_context
        if span <= 0:
            for since, until, ctx in self.spans:
                if since <= start_s < until:
                    requests += 1.0
                    tokens += ctx
            return requests, tokens
        for since, until, ctx in self.spans:
            overlap = (until if until < end_s else end_s) - (since if since > start_s else start_s)
            if overlap > 0:
                share = overlap / span
                requests += share
                tokens += ctx * share
        return requests, tokens

    def joined(
        self,
        model: TimeModel,
        own_context: float,
        max_tokens: int,
        join_at_s: float,
        life_s: float | None = None,
    ) -> tuple[float, float]:
        """(requests, context tokens) of the predicted batch a request joins at `join_at_s`,
        itself left out: the batch averaged over the request's life (`life_s`, or its
        `max_tokens` at the step of the batch it joins, with `own_context` tokens of its own),
        never below the batch at the join."""
        at_join = self.over(join_at_s, join_at_s)
        if life_s is None:
            batch = at_join[0] + 1.0
            life_s = max_tokens * batch_step_s(
                model, batch, at_join[1] + own_context, self.max_batch
            )
        running, context = self.over(join_at_s, join_at_s + life_s)
        if at_join[0] > running:
            return at_join
        return running, context

    def steps_at(
        self,
        model: TimeModel,
        own_context: float,
        max_tokens: int,
        joins: Sequence[float],
        life_s: float | None = None,
    ) -> list[float]:
        """For each time in `joins`: seconds of one decode step of the batch (`joined`) that a
        request with `own_context` tokens and `max_tokens` to generate joins then, itself
        included (`batch_step_s`). The same numbers as `joined` gives, computed in one loop: a
        policy asks this for every pair it prices."""
        (steady, steady_context, reported, each, remaining, sums, per_token, spans, max_batch) = (
            self
        )
        count = len(remaining)
        decode = model.decode
        fixed, per_request = decode.fixed_s, decode.per_request_s
        per_context = decode.per_context_token_s
        cap = max_batch if max_batch > 1 else 1
        out: list[float] = []
        for join in joins:
            # over(join, join): the batch at the join
            requests, tokens = steady, steady_context
            first = 0
            start = join
            if count:
                start = join if join > reported else reported
                first = bisect_right(remaining, (start - reported) / per_token)
                present = float(count - first)
                requests += present
                tokens += present * each
            for since, until, ctx in spans:
                if since <= join < until:
                    requests += 1.0
                    tokens += ctx
            life = life_s
            if life is None:
                batch = requests + 1.0
                if batch <= cap:  # batch_step_s, inline
                    life = max_tokens * (
                        fixed + per_request * batch + (per_context * (tokens + own_context))
                    )
                else:
                    life = max_tokens * batch_step_s(model, batch, tokens + own_context, max_batch)
            end = join + life
            span = end - join
            if span > 0:
                # over(join, join + life): the batch over the request's life
                running, context = steady, steady_context
                if count:
                    last = bisect_right(remaining, (end - reported) / per_token, first)
                    inside = (last - first) * (reported - start) + per_token * (
                        sums[last] - sums[first]
                    )
                    present = (inside + (count - last) * (end - start)) / span
                    running += present
                    context += present * each
                for since, until, ctx in spans:
                    overlap = (until if until < end else end) - (since if since > join else join)
                    if overlap > 0:
                        share = overlap / span
                        running += share
                        context += ctx * share
                if not requests > running:
                    requests, tokens = running, context
            batch = requests + 1.0
            if batch <= cap:  # batch_step_s, inline
                out.append(fixed + per_request * batch + (per_context * (tokens + own_context)))
            else:
                out.append(batch_step_s(model, batch, tokens + own_context, max_batch))
        return out


def decode_load(worker: WorkerView, model: TimeModel, now: float) -> DecodeLoad:
    """The predicted batch of `worker` (see DecodeLoad).

    A running request stays until its reported remaining tokens run out at today's step time
    (forever when the worker does not report them); a ledger dispatch is there from its join
    until its `max_tokens` have run at the step of the fullest batch it could see.
    """
    running = worker.running_requests
    context = worker.running_context_tokens
    joins = worker.pending_joins
    reported_at = now - worker.report_age_s
    steady, steady_context, each = float(running), float(context), 0.0
    remaining: list[int] = []
    step = model.decode.seconds(running if running > 1 else 1, context)
    if worker.running_remaining_tokens and running > 0 and step > 0:
        each = context / running
        remaining = sorted(worker.running_remaining_tokens[:running])
        steady = float(running - len(remaining))
        steady_context = each * steady
    spans: list[tuple[float, float, float]] = []
    if joins:
        joining = 0
        for j in joins:
            joining += j.context_tokens
        join_step = model.decode_step_s(running + len(joins), context + joining)
        for j in joins:
            spans.append(
                (j.join_at_s, j.join_at_s + j.max_tokens * join_step, float(j.context_tokens))
            )
    return DecodeLoad(
        steady,
        steady_context,
        reported_at,
        each,
        tuple(remaining),
        tuple(accumulate(remaining, initial=0)),
        float(step),
        tuple(spans),
        worker.max_batch,
    )


def load_over(
    worker: WorkerView, model: TimeModel, now: float, start_s: float, end_s: float
) -> tuple[float, float]:
    """(requests, context tokens) `worker` is predicted to decode, averaged over [start_s, end_s]
    (the load at `start_s` when the two are equal)."""
    return decode_load(worker, model, now).over(start_s, end_s)


def estimate_tpot(
    request: RequestView,
    worker: WorkerView,
    model: TimeModel,
    now: float,
    join_at_s: float,
    mode: str = "predicted",
    load: DecodeLoad | None = None,
    life_s: float | None = None,
) -> float:
    """Predicted seconds per output token of `request` on decode worker `worker`.

    "predicted": the batch averaged over the request's life from `join_at_s` (its length taken
    at the step time of the batch it joins; `DecodeLoad.joined`); "current": the batch as reported,
    plus itself. The request's own context is its prompt plus half its generation (its mean over
    its life). A batch past `max_batch` time-shares the worker: the step stretches in proportion
    (`batch_step_s`). `load` is `decode_load(worker, model, now)` when the caller has it already;
    `life_s` the request's decode time when the caller has an estimate of it (else it is taken
    at the join).
    """
    own = request.prompt_tokens + request.max_tokens / 2.0
    if mode == "predicted":
        batch = load if load is not None else decode_load(worker, model, now)
        running, context = batch.joined(model, own, request.max_tokens, join_at_s, life_s)
    elif mode == "current":
        running, context = float(worker.running_requests), float(worker.running_context_tokens)
    else:
        raise ValueError(f"unknown load mode {mode!r} (predicted, current)")
    step = batch_step_s(model, running + 1.0, context + own, worker.max_batch)
    if worker.role is not _COLOCATED:
        return step
    return step + prefill_stall_s(request, worker, model, running + 1.0)


def prefill_stall_s(
    request: RequestView,
    worker: WorkerView,
    model: TimeModel,
    batch: float,
    steady: bool = False,
) -> float:
    """Seconds of prefill each decode step of a co-located `worker` is predicted to wait for.

    Prefill work runs in the steps of the batch: a whole prefill stalls every decode of it, a
    chunk of `step_token_budget` tokens shares a step with it. A burst already queued (the
    ledger's dispatches included) delays the newcomer's steps by its work spread over the
    newcomer's output tokens. With `steady` (admission's view of sustained load), every request
    of the batch (`batch`, the newcomer included) is also taken to be followed by another whose
    prefill runs while it decodes, so each step waits for at least (batch x one prefill) / (one
    request's output tokens), `request` taken as the typical one (Little's law: the batch is the
    arrival rate times the decode time). That term is left out of placement: it follows from the
    placement policy's own future choices, not from the worker. With chunking no step waits
    longer than one chunk. Zero for other workers.
    """
    if worker.role is not _COLOCATED:
        return 0.0
    out = request.max_tokens if request.max_tokens > 1 else 1
    per_step = 0.0
    tokens = worker.queued_prefill_tokens
    if tokens > 0:
        per_step = model.queue_drain_s(tokens, worker.queued_requests) / out
    if steady:
        per_step = max(per_step, batch * model.prefill_s(request.prompt_tokens, 0) / out)
    budget = worker.step_token_budget
    if budget > 0 and per_step > 0:
        chunk = budget - worker.running_requests if budget > worker.running_requests else 1
        per_step = min(per_step, model.prefill_s(chunk, 0))
    return per_step


def batch_step_s(model: TimeModel, batch: float, context: float, max_batch: int) -> float:
    """Seconds of one decode step of `batch` requests (a prediction: it may be fractional) with
    `context` tokens in all, on a worker that runs at most `max_batch` at once: past that the
    worker time-shares, and the step stretches in proportion."""
    cap = max_batch if max_batch > 1 else 1
    if batch <= cap:
        return (
            model.decode.fixed_s
            + model.decode.per_request_s * batch
            + (model.decode.per_context_token_s * context)
        )
    return batch_step_s(model, cap, context * cap / batch, cap) * batch / cap


def eligible(workers: Sequence[WorkerView], request: RequestView) -> list[WorkerView]:
    """Healthy workers serving the request's model ("" = any)."""
    return [w for w in workers if w.healthy and (not request.model or w.model == request.model)]
