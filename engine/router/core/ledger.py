"""The dispatch ledger: the router's own dispatches, counted as load the moment they are decided.

Workers report their load every so often, so a burst decided between two reports would all land
on the worker that looked idle in the last one. The ledger remembers each dispatch and adds to
each worker's view what its report cannot show yet:

- on the prefill worker, a dispatch whose prefill has not finished and that was decided at or
  after the moment the report was taken (`now - report_age_s`): its tokens to compute join the
  queue. When the report counts its queue in whole prompts (`queued_are_prompts`: a real
  worker does not know a request's hits before its lookup), a dispatch it already includes has
  its hit tokens taken back out, so the queue is the tokens left to compute, as the time model
  prices it;
- on the decode worker, a dispatch that joins (or joined) the batch after the report was taken: a
  `PendingJoin` at its predicted join time (the end of its predicted TTFT), or at the real one
  once `on_prefill_done` says so.

A report newer than a dispatch includes it, so the ledger stops adding it by itself: nothing has
to agree between router replicas, and a lost release only costs until the next report. Entries
are removed by `release` (finished, failed, cancelled) or, as a bound, `max_age_s` after their
join. Mutates only itself; never reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.router.core.types import PendingJoin, Placement, RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    prefill_id: str
    decode_id: str
    prefill_tokens: int  # tokens the prefill computes (prompt minus the pulled prefix)
    context_tokens: int  # the prompt: the context the request brings to the decode batch
    max_tokens: int
    dispatched_at_s: float
    join_at_s: float  # predicted until the prefill is done, then the real time
    prefill_done: bool = False

    @property
    def join(self) -> PendingJoin:
        return PendingJoin(self.request_id, self.join_at_s, self.context_tokens, self.max_tokens)


@dataclass(frozen=True, slots=True)
class _Added:
    """What the ledger adds to one worker's view for reports taken at `seen_until`."""

    version: int
    seen_until: float
    prompts: bool  # the report's `queued_are_prompts`
    tokens: int
    requests: int
    joins: tuple[PendingJoin, ...]


class DispatchLedger:
    def __init__(self, *, max_age_s: float = 600.0, visibility_delay_s: float = 0.0) -> None:
        """`visibility_delay_s`: how long after a dispatch a report can first include it (the
        hop to the worker); `max_age_s`: how long after its join an unreleased entry is kept."""
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if visibility_delay_s < 0:
            raise ValueError(f"visibility_delay_s must be >= 0, got {visibility_delay_s}")
        self.max_age_s = max_age_s
        self.visibility_delay_s = visibility_delay_s
        self._entries: dict[str, Reservation] = {}
        self._by_worker: dict[str, dict[str, None]] = {}  # insertion-ordered sets
        self._expired_at = -math.inf
        # per worker: a version bumped by every change that touches it, and the last addition
        # computed (a report stays the same between two of its updates, so does the addition)
        self._versions: dict[str, int] = {}
        self._added: dict[str, _Added] = {}
        self._joins: dict[str, PendingJoin] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> Reservation | None:
        return self._entries.get(request_id)

    def reserve(self, request: RequestView, placement: Placement, now: float) -> Reservation:
        """Count `request` on its placement's workers from `now` (replaces an earlier entry of
        the same id, as a retry elsewhere does)."""
        self.release(request.request_id)
        entry = Reservation(
            request_id=request.request_id,
            prefill_id=placement.prefill_id,
            decode_id=placement.decode_id,
            prefill_tokens=max(request.prompt_tokens - placement.hit_tokens_used, 1),
            context_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            dispatched_at_s=now,
            join_at_s=now + placement.predicted_ttft_s,
        )
        self._entries[entry.request_id] = entry
        self._joins[entry.request_id] = entry.join
        for worker in {entry.prefill_id, entry.decode_id}:
            self._by_worker.setdefault(worker, {})[entry.request_id] = None
            self._touch(worker)
        return entry

    def _touch(self, worker: str) -> None:
        self._versions[worker] = self._versions.get(worker, 0) + 1

    def on_prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished (first token): it left the prefill queue and joins decode now."""
        entry = self._entries.get(request_id)
        if entry is not None:
            done = replace(entry, prefill_done=True, join_at_s=now)
            self._entries[request_id] = done
            self._joins[request_id] = done.join
            self._touch(entry.prefill_id)
            self._touch(entry.decode_id)

    def release(self, request_id: str) -> None:
        """Forget a dispatch (finished, failed, cancelled, or moved); unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        del self._joins[request_id]
        for worker in {entry.prefill_id, entry.decode_id}:
            self._touch(worker)
            ids = self._by_worker.get(worker)
            if ids is not None:
                ids.pop(request_id, None)
                if not ids:
                    del self._by_worker[worker]

    def expire(self, now: float) -> int:
        """Drop entries `max_age_s` past their join; returns how many went."""
        self._expired_at = now
        old = [e.request_id for e in self._entries.values() if now - e.join_at_s > self.max_age_s]
        for request_id in old:
            self.release(request_id)
        return len(old)

    def apply(self, workers: Sequence[WorkerView], now: float) -> tuple[WorkerView, ...]:
        """The views with the dispatches their reports do not show yet added (see module doc).
        Also drops expired entries, at most every tenth of `max_age_s`."""
        if now - self._expired_at > self.max_age_s / 10:
            self.expire(now)
        out: list[WorkerView] = []
        for worker in workers:
            ids = self._by_worker.get(worker.worker_id)
            if not ids:
                out.append(worker)
                continue
            added = self._addition(worker, ids, now)
            if added.tokens or added.joins:
                worker = _with_dispatches(worker, added.tokens, added.requests, added.joins)
            out.append(worker)
        return tuple(out)

    def _addition(self, worker: WorkerView, ids: dict[str, None], now: float) -> _Added:
        wid = worker.worker_id
        seen_until = now - worker.report_age_s - self.visibility_delay_s
        version = self._versions.get(wid, 0)
        cached = self._added.get(wid)
        if (
            cached is not None
            and cached.version == version
            and cached.prompts is worker.queued_are_prompts
            and abs(cached.seen_until - seen_until) <= 1e-9
        ):
            return cached
        entries = self._entries
        tokens = requests = 0
        joins: list[PendingJoin] = []
        for request_id in ids:
            entry = entries[request_id]
            if entry.prefill_id == wid and not entry.prefill_done:
                if entry.dispatched_at_s >= seen_until:
                    tokens += entry.prefill_tokens
                    requests += 1
                elif worker.queued_are_prompts:
                    # in the report, counted at its whole prompt: only the missed part is
                    # computed, the rest is pulled
                    tokens -= entry.context_tokens - entry.prefill_tokens
            if entry.decode_id == wid and entry.join_at_s >= seen_until:
                joins.append(self._joins[request_id])
        added = _Added(
            version, seen_until, worker.queued_are_prompts, tokens, requests, tuple(joins)
        )
        self._added[wid] = added
        return added


def _with_dispatches(
    w: WorkerView, tokens: int, requests: int, joins: tuple[PendingJoin, ...]
) -> WorkerView:
    """`w` with `tokens` / `requests` more queued and `joins` more pending (a faster replace)."""
    return WorkerView(
        w.worker_id,
        w.role,
        w.host_id,
        w.model,
        w.page_tokens,
        w.healthy,
        max(0, w.queued_prefill_tokens + tokens),
        w.queued_requests + requests,
        w.running_requests,
        w.running_context_tokens,
        w.free_pages,
        w.max_batch,
        w.report_age_s,
        w.running_remaining_tokens,
        w.pending_joins + joins,
        w.step_token_budget,
        w.queued_are_prompts,
    )
