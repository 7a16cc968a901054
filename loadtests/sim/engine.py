"""The engine model: local queues, iteration batching, optional chunked prefill, a paged pool.

One `SimEngine` per engine, in one of three roles (the router core's `Role`):
- prefill: a FIFO of dispatched requests; an iteration takes the head request(s) up to
  `prefill_batch_tokens` new tokens, pulls their hit pages, computes the rest, and hands each
  first token and its KV to the decode engine the router chose;
- decode: requests join the batch when their KV has arrived, the batch has room (`max_batch`)
  and the pool has their pages; an iteration is one decode step of the whole batch;
- colocated: both. Without chunking, an iteration is either a prefill (which stalls decode, as
  vLLM's default scheduler does) or a decode step; with `chunk_tokens` > 0 every iteration is a
  decode step plus up to `chunk_tokens - batch` prefill tokens (Sarathi-style chunked prefill).
Iteration times come from the time model (`prefill_s`, `decode_step_s`, `pull_s`), plus the
cluster's serving-path terms: `request_overhead_s` in the iteration that ends a prefill, and
`token_overhead_s` in every decode iteration (0 by default; `strata simulate --overheads-from`
fits them to a live run), `handoff_s` between a prefill's first token and the decode engine's
queue (beyond the modelled KV pull), and `prefill_contention` / `decode_contention`: an
iteration that starts while another engine of its host computes takes that many times longer
(engines sharing one machine's processors; 1 by default), and `prefill_jitter`: each prefill's
compute times a draw from these measured multipliers (a shared machine's speed varies from one
request to the next, skewed to the slow side; the draws are seeded by the run's seed and the
engine, so a run is repeatable). `strata loadtest --validate` measures all of these live. The pool
holds each running request's pages (prompt + max_tokens, reserved when it starts) and, in the
per-engine store mode, an LRU prefix cache in whatever room is left.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.router.core import Placement, Role, WorkerView
from loadtests.sim.store import LocalCache
from loadtests.workload import Request

if TYPE_CHECKING:
    from loadtests.sim.simulator import Simulator


@dataclass(slots=True)
class Job:
    """A request inside the simulated cluster (mutable: the engines advance it)."""

    req: Request
    keys: tuple[int, ...]
    placement: Placement
    dispatched_s: float
    pages_needed: int
    prefill_start_s: float = math.nan
    first_token_s: float = math.nan
    join_s: float = math.nan
    finish_s: float = math.nan
    pull_s: float = 0.0
    transfer_s: float = 0.0
    new_tokens: int = 0
    cached_tokens: int = 0
    progress: int = 0
    generated: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    handed_off: bool = False  # the cluster's handoff_s has been paid

    @property
    def started(self) -> bool:
        return not math.isnan(self.prefill_start_s)

    @property
    def context(self) -> int:
        return self.req.prompt_tokens + self.generated


@dataclass(frozen=True, slots=True)
class Iteration:
    duration_s: float
    prefills: tuple[tuple[Job, int, bool], ...]  # (job, tokens computed now, prefill completes)
    decodes: tuple[Job, ...]


class SimEngine:
    def __init__(
        self, sim: Simulator, worker_id: str, host: str, role: Role, view_host: str
    ) -> None:
        self.sim = sim
        self.worker_id = worker_id
        self.host = host
        self.view_host = view_host  # the host id the router sees (per-engine caches: the engine)
        self.role = role
        self.prefill_q: deque[Job] = deque()
        self.join_q: deque[Job] = deque()
        self.running: list[Job] = []
        self.used_pages = 0
        self.cache = LocalCache() if sim.cluster.store == "per_engine" else None
        self.busy = False
        self.busy_s = 0.0
        self._jitter = random.Random(f"{sim.seed}/{worker_id}/prefill_jitter")

    # -- what the router sees -------------------------------------------------------------------
    def report(self) -> WorkerView:
        c = self.sim.cluster
        queued = sum(
            (j.new_tokens - j.progress)
            if j.started
            else max(1, j.req.prompt_tokens - j.placement.hit_tokens_used)
            for j in self.prefill_q
        )
        decoding = self.running + list(self.join_q)
        return WorkerView(
            worker_id=self.worker_id,
            role=self.role,
            host_id=self.view_host,
            model="",
            page_tokens=c.page_tokens,
            queued_prefill_tokens=queued,
            queued_requests=len(self.prefill_q),
            running_requests=len(decoding),
            running_context_tokens=sum(j.context for j in decoding),
            free_pages=max(0, c.pool_pages - self.used_pages - self._cached()),
            max_batch=c.max_batch,
            running_remaining_tokens=tuple(
                max(0, j.req.max_tokens - j.generated) for j in decoding
            ),
            step_token_budget=c.chunk_tokens if self.role is Role.colocated else 0,
        )

    # -- entry points ---------------------------------------------------------------------------
    def enqueue_prefill(self, job: Job) -> None:
        self.prefill_q.append(job)
        self.kick()

    def enqueue_join(self, job: Job) -> None:
        handoff = self.sim.cluster.handoff_s
        if handoff > 0 and not job.handed_off:  # the serving path's part of the hand-off
            job.handed_off = True
            job.transfer_s += handoff
            self.sim.loop.after(handoff, self.enqueue_join, job)
            return
        self.join_q.append(job)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        plan = self._plan()
        if plan is None:
            return
        duration = plan.duration_s * self._contention(plan)
        self.busy = True
        self.busy_s += duration
        self.sim.loop.after(duration, self._done, plan)

    def _contention(self, plan: Iteration) -> float:
        """The cluster's slowdown for `plan` when another engine of this host is computing as it
        starts (1 when none is, or when the cluster has no contention terms)."""
        c = self.sim.cluster
        factor = c.prefill_contention if plan.prefills else c.decode_contention
        if factor == 1.0:
            return 1.0
        busy = any(e.busy for e in self.sim.engines if e is not self and e.host == self.host)
        return factor if busy else 1.0

    # -- pool -----------------------------------------------------------------------------------
    def _cached(self) -> int:
        return len(self.cache) if self.cache is not None else 0

    def _reserve(self, pages: int) -> bool:
        room = self.sim.cluster.pool_pages - self.used_pages - self._cached()
        if room < pages and self.cache is not None:
            self.cache.evict(pages - room)
            room = self.sim.cluster.pool_pages - self.used_pages - self._cached()
        if room < pages:
            return False
        self.used_pages += pages
        return True

    def _free(self, pages: int) -> None:
        self.used_pages -= pages

    # -- iterations -----------------------------------------------------------------------------
    def _start(self, job: Job) -> bool:
        """Begin a queued job's prefill: reserve its pages, look its prefix up, plan the pull."""
        pages = job.pages_needed if self.role is Role.colocated else self._prompt_pages(job)
        if not self._reserve(pages):
            return False
        job.prefill_start_s = self.sim.loop.now
        self.sim.lookup_for_prefill(self, job)
        return True

    def _prompt_pages(self, job: Job) -> int:
        return -(-job.req.prompt_tokens // self.sim.cluster.page_tokens)

    def _plan(self) -> Iteration | None:
        c = self.sim.cluster
        model = self.sim.model
        if self.role is Role.decode:
            self._admit_joins()
        prefills: list[tuple[Job, int, bool]] = []
        prefill_s = 0.0
        chunked = self.role is Role.colocated and c.chunk_tokens > 0
        if self.role is not Role.decode:
            budget = (
                max(c.chunk_tokens - len(self.running), 1) if chunked else c.prefill_batch_tokens
            )
            for job in self.prefill_q:
                if not chunked and prefills:
                    ahead = job.new_tokens - job.progress if job.started else job.req.prompt_tokens
                    if ahead > budget:
                        break
                if not job.started:
                    if self.role is Role.colocated and self._batch_full():
                        break  # the decode batch it would join is full
                    if not self._start(job):
                        break  # head-of-line: the pool has no room for it yet
                    prefill_s += job.pull_s
                left = job.new_tokens - job.progress
                take = min(left, budget) if chunked else left
                piece = model.prefill_s(take, job.cached_tokens + job.progress)
                if prefills:
                    piece -= model.prefill.fixed_s  # one launch per batched iteration
                if c.prefill_jitter:
                    piece *= self._jitter.choice(c.prefill_jitter)
                if take == left:
                    piece += c.request_overhead_s  # the serving path of its first token
                prefill_s += max(piece, 0.0)
                budget -= take
                prefills.append((job, take, take == left))
                if budget <= 0:
                    break
        decodes: tuple[Job, ...] = ()
        if self.running and (chunked or not prefills):
            decodes = tuple(self.running)
        if not prefills and not decodes:
            return None
        decode_s = (
            model.decode_step_s(len(decodes), sum(j.context for j in decodes)) + c.token_overhead_s
            if decodes
            else 0.0
        )
        return Iteration(prefill_s + decode_s, tuple(prefills), decodes)

    def _batch_full(self) -> bool:
        prefilling = sum(1 for j in self.prefill_q if j.started)
        return len(self.running) + prefilling >= self.sim.cluster.max_batch

    def _admit_joins(self) -> None:
        while self.join_q and len(self.running) < self.sim.cluster.max_batch:
            job = self.join_q[0]
            if not self._reserve(job.pages_needed):
                break
            self.join_q.popleft()
            job.join_s = self.sim.loop.now
            self.running.append(job)

    def _done(self, plan: Iteration) -> None:
        self.busy = False
        now = self.sim.loop.now
        for job in plan.decodes:
            job.generated += 1
        finished = [j for j in plan.decodes if j.generated >= j.req.max_tokens]
        for job in finished:
            self.running.remove(job)
            self._free(job.pages_needed)
            job.finish_s = now
            self.sim.finished(job)
        for job, take, completes in plan.prefills:
            job.progress += take
            if not completes:
                continue
            self.prefill_q.remove(job)
            job.first_token_s = now
            job.generated = 1
            self.sim.first_token(self, job)
            if self.role is Role.colocated:
                if job.generated >= job.req.max_tokens:
                    self._free(job.pages_needed)
                    job.join_s = job.finish_s = now
                    self.sim.finished(job)
                else:
                    job.join_s = now
                    self.running.append(job)
            else:
                self._free(self._prompt_pages(job))
                self.sim.hand_to_decode(self, job)
        self.kick()

    def insert_cached(self, keys: tuple[int, ...]) -> None:
        """Keep `keys` in this engine's prefix cache (per-engine mode), room permitting."""
        if self.cache is None:
            return
        room = self.sim.cluster.pool_pages - self.used_pages - len(self.cache)
        new = [k for k in keys if k not in self.cache.pages]
        if len(new) > room:
            self.cache.evict(len(new) - room)
        self.cache.insert(keys)

    @property
    def queued(self) -> int:
        return len(self.prefill_q) + len(self.join_q)
