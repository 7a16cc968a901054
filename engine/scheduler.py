"""`BatchScheduler`: continuous batching over one KV pool, the loop behind the decode and the
co-located workers (DESIGN §8).

One thread owns the pool and the model. Between steps it admits waiting requests (FIFO, while
the batch and the pool have room: a request reserves the pages of its whole possible length up
front, so no request is ever preempted), pulls the pages the store has for each (verified), and
then runs steps. A step is:

1. prefill chunks: tokens a request still lacks KV for (a recomputed tail, or a whole prompt),
   oldest request first, `chunk_tokens` per forward pass, at most the step's token budget minus
   the decode batch (`step_token_budget` None: no budget; a tail is computed at once);
2. one batched `decode_step` for every request whose KV is complete but for its last token,
   one batched draw of their next tokens (`sample_tokens`: each request's own params and
   seed), then each token handed to its stream (a non-blocking queue put).

On CPU (the torch kernel backend) a request that starts decoding gets a row of `KVRows`: its
K/V copied once into one contiguous block that each step extends, so the step's attention
reads the batch in place instead of gathering pages. Decode batches are taken in row order.

A request's KV covers its tokens but the last; that last token is the input of its next decode
step. Each page that fills is published in the background (so a replacement worker can pull the
text generated so far); a request that ends frees its pages at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from client import IoClass, Scope, chain_key, page_keys
from engine.errors import EngineBusy, InvalidRequest
from engine.kernels import select_backend
from engine.kv_rows import KVRow, KVRows
from engine.lifecycle import InFlight
from engine.output import OutputText
from engine.requests import DecodeRequest, DecodeStats, FinishReason, TierTokens, TokenEvent
from engine.runtime import ModelRuntime
from engine.sampling import Sampler, sample_tokens
from engine.store_link import Fetched, PullResult, StoreLink
from engine.stream import TokenStream

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    """How a scheduler batches. `kv_capacity_tokens` sizes the pool (None: room for
    `max_batch` requests of 1024 tokens, and never less than one request of the full context)."""

    max_batch: int = 32
    chunk_tokens: int = 256
    step_token_budget: int | None = None
    kv_capacity_tokens: int | None = None
    pull_io_class: IoClass = IoClass.CRITICAL
    max_waiting: int = 1024
    publish: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.chunk_tokens < 1 or self.max_waiting < 1:
            raise ValueError("max_batch, chunk_tokens and max_waiting must be positive")
        if self.step_token_budget is not None and self.step_token_budget <= self.max_batch:
            raise ValueError(
                f"step_token_budget {self.step_token_budget} must exceed max_batch "
                f"{self.max_batch}, or prefill could starve behind a full decode batch"
            )


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """How loaded a scheduler is at one moment (`BatchScheduler.load`)."""

    queued_prefill_tokens: int  # tokens of waiting requests, and those running requests lack
    queued_requests: int  # accepted, not yet in the batch
    running_requests: int
    running_context_tokens: int
    free_pages: int
    total_pages: int
    running_remaining_tokens: tuple[int, ...] = ()  # per running request: most tokens still to come


@dataclass(eq=False)
class _Sequence:
    """The scheduler's state of one request (owned by the scheduler thread once admitted)."""

    request: DecodeRequest
    stream: TokenStream
    scope: Scope
    tokens: list[int]
    output: OutputText
    sampler: Sampler
    pages_needed: int
    arrived: float
    table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    stored: int = 0  # leading pages in the store or queued for it
    pulled: PullResult = field(default_factory=PullResult)
    fetched: Fetched | None = None
    recomputed: int = 0
    queued_pages: int = 0
    admitted: float = 0.0
    row: KVRow | None = None  # its contiguous K/V, once it decodes (CPU)

    def stats(self, page_tokens: int) -> DecodeStats:
        return DecodeStats(
            hit_tokens=TierTokens.of_pages(self.pulled.tiers, page_tokens),
            computed_tokens=self.recomputed,
            published_pages=self.queued_pages,
            rejected_pages=self.pulled.rejected,
            queue_s=max(0.0, self.admitted - self.arrived),
            pull_s=self.pulled.lookup_s + self.pulled.pull_s,
        )


class BatchScheduler:
    """Runs requests to completion in batches. `submit` is thread-safe; all else runs on the
    scheduler's own thread, started by the constructor. Stop with `stop()`."""

    role = "batch"

    def __init__(self, runtime: ModelRuntime, link: StoreLink, options: SchedulerOptions) -> None:
        self.runtime = runtime
        self.link = link
        self.options = options
        page = runtime.page_tokens
        per_request = -(-runtime.max_context // page)
        capacity = options.kv_capacity_tokens or options.max_batch * 1024
        self.pool = runtime.new_pool(max(per_request, -(-capacity // page)))
        self.rows = (
            KVRows(self.pool, max_rows=options.max_batch, max_tokens=per_request * page)
            if select_backend(None, runtime.device) == "torch"
            else None
        )
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._fetching = 0  # requests whose pages are being fetched
        self._fetched: list[_Sequence] = []  # fetched, to load and start
        self._fetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{self.role}-fetch")
        self._in_flight = InFlight(self.role)
        self._abort = False
        self._shutdown = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=f"strata-{self.role}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished (waiting or running)."""
        return self._in_flight.count

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        return self._in_flight.wait_idle(timeout_s)

    def load(self) -> SchedulerLoad:
        """A snapshot of the queue and the batch, for the router's load reports (any thread)."""
        with self._cond:
            waiting = list(self._waiting)
            starting = list(self._fetched)
            fetching = self._fetching
        active = list(self._active)  # mutated only by the scheduler thread: copy, then read
        running = [*active, *starting]
        return SchedulerLoad(
            queued_prefill_tokens=sum(len(s.tokens) for s in waiting)
            + sum(max(0, len(s.tokens) - 1 - s.computed) for s in running),
            queued_requests=len(waiting) + fetching,
            running_requests=len(running),
            running_context_tokens=sum(len(s.tokens) for s in running),
            free_pages=self.pool.num_free,
            total_pages=self.pool.num_pages,
            running_remaining_tokens=tuple(
                max(0, s.output.limit - len(s.output.tokens)) for s in running
            ),
        )

    # ---- the caller's side -----------------------------------------------------------------

    def submit(self, request: DecodeRequest) -> TokenStream:
        """Queue a request; its events arrive on the returned stream. Raises InvalidRequest
        (bad prompt, token ids or sampling), EngineStopping after `stop()`, EngineBusy when
        `max_waiting` requests wait already. A request the tokens it comes with already finish
        (a stop token, max_tokens, the context) gets a stream with one last, token-less event."""
        runtime = self.runtime
        params = request.sampling
        params.check_vocab(runtime.vocab_size)
        prompt = runtime.prompt_ids(request.prompt_token_ids)
        produced = list(request.output_token_ids)
        bad = [t for t in produced if not isinstance(t, int) or not 0 <= t < runtime.vocab_size]
        if bad:
            raise InvalidRequest(f"output token ids {bad[:4]} are outside the vocabulary")
        output = OutputText(
            runtime.tokenizer,
            params,
            limit=min(params.max_tokens, runtime.max_context - len(prompt)),
            eos_ids=runtime.eos_ids,
        )
        stream = TokenStream(request.request_id)
        finished = output.replay(produced)
        if finished is not None:
            stream.finish_now(len(produced), finished, DecodeStats())
            return stream
        total = min(len(prompt) + output.limit, runtime.max_context)
        seq = _Sequence(
            request=request,
            stream=stream,
            scope=runtime.scope(request.namespace),
            tokens=prompt + produced,
            output=output,
            sampler=Sampler(params),
            pages_needed=self.pool.pages_for(total),
            arrived=time.monotonic(),
        )
        self._in_flight.enter()
        with self._cond:
            if len(self._waiting) >= self.options.max_waiting:
                self._in_flight.exit()
                raise EngineBusy(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(seq)
            self._cond.notify_all()
        return stream

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Take no new requests; let those in flight finish for up to `timeout_s`, then cancel
        what is left; finish publishing and end the thread. False if some were cancelled."""
        busy = self._in_flight.close()
        if busy:
            log.info("%s worker stopping: finishing %d in-flight request(s)", self.role, busy)
        deadline = time.monotonic() + timeout_s
        idle = self._in_flight.wait_idle(timeout_s)
        with self._cond:
            self._abort = not idle
            self._shutdown = True
            self._cond.notify_all()
        self._thread.join(max(1.0, deadline - time.monotonic()))
        self.link.close(max(0.1, deadline - time.monotonic()))
        return idle

    def close(self) -> None:
        self.stop(timeout_s=1.0)

    # ---- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._runnable():
                    if self._shutdown and (self._abort or not self._pending()):
                        break
                    self._cond.wait()
                if not self._runnable():
                    break  # stopping, with nothing left to run (or told to abort)
                fetched, self._fetched = self._fetched, []
            try:
                while fetched:
                    self._start(fetched.pop(0))
                self._admit()
                self._step()
            except Exception as exc:  # a bug or a device error: fail what is running, go on
                failed = [*self._active, *fetched]
                log.exception("%s step failed; failing %d request(s)", self.role, len(failed))
                for seq in failed:
                    self._release(seq)
                    seq.stream.fail(exc)
        self._fetcher.shutdown(wait=True)  # bounded by the store client's deadlines
        for seq in [*self._active, *self._fetched, *self._waiting]:
            self._end(seq, FinishReason.CANCELLED)
        self._waiting.clear()

    def _pending(self) -> bool:
        """Requests accepted and not finished (call with the lock held)."""
        return bool(self._waiting or self._active or self._fetching or self._fetched)

    def _runnable(self) -> bool:
        """Something to do now (call with the lock held): a step to run, fetched pages to load,
        or a waiting request that fits."""
        if self._abort:
            return False
        if self._active or self._fetched:
            return True
        return self._admittable()

    def _admittable(self) -> bool:
        if not self._waiting or len(self._active) + self._fetching >= self.options.max_batch:
            return False
        head = self._waiting[0]
        return head.stream.cancelled or self.pool.num_free >= head.pages_needed

    def _admit(self) -> None:
        """Move waiting requests towards the batch while the batch and the pool have room:
        reserve their pages, and fetch what the store has of them off this thread (running
        requests keep decoding meanwhile; a store without pages to give costs nothing)."""
        while True:
            with self._cond:
                if not self._admittable():
                    return
                seq = self._waiting.popleft()
                fetch = not seq.stream.cancelled and self.link.available
                if fetch:
                    self._fetching += 1
            if seq.stream.cancelled:
                self._end(seq, FinishReason.CANCELLED)
                continue
            seq.admitted = time.monotonic()
            seq.table = self.pool.allocate(seq.pages_needed)
            seq.keys = page_keys(seq.scope, seq.tokens)
            if fetch:
                self._fetcher.submit(self._fetch, seq)
            else:
                self._start(seq)

    def _fetch(self, seq: _Sequence) -> None:
        """On a fetch thread: the store's pages of `seq`, into host memory; then hand it back."""
        try:
            seq.fetched = self.link.fetch(
                seq.scope,
                seq.tokens,
                seq.keys,
                self.pool.page_payload_bytes,
                self.options.pull_io_class,
            )
        finally:
            with self._cond:
                self._fetching -= 1
                self._fetched.append(seq)
                self._cond.notify_all()

    def _start(self, seq: _Sequence) -> None:
        """Load its fetched pages into the pool and join `seq` to the batch."""
        page = self.runtime.page_tokens
        self._active.append(seq)
        if seq.fetched is not None:
            seq.fetched.load_into(self.pool, seq.table)
            seq.pulled = seq.fetched.result
            seq.fetched = None
        seq.computed = min(seq.pulled.pages * page, len(seq.tokens) - 1)
        seq.stored = seq.pulled.pages
        seq.recomputed = len(seq.tokens) - seq.computed

    def _step(self) -> None:
        for seq in [s for s in self._active if s.stream.cancelled]:
            self._end(seq, FinishReason.CANCELLED)
        if not self._active:
            return
        ready = sum(1 for s in self._active if s.computed == len(s.tokens) - 1)
        budget = self.options.step_token_budget
        left = None if budget is None else budget - ready
        for seq in self._active:
            if left is not None and left <= 0:
                break
            left = self._prefill(seq, left)
        batch = [s for s in self._active if s.computed == len(s.tokens) - 1]
        if batch:
            self._decode(batch)
        self.steps += 1

    def _prefill(self, seq: _Sequence, left: int | None) -> int | None:
        """Compute KV for the tokens before `seq`'s last, in chunks, within `left` tokens."""
        target = len(seq.tokens) - 1
        if seq.computed >= target:
            return left
        inputs = torch.tensor(seq.tokens[seq.computed : target], dtype=torch.int64)
        offset = seq.computed
        while seq.computed < target and (left is None or left > 0):
            count = min(target - seq.computed, self.options.chunk_tokens)
            if left is not None:
                count = min(count, left)
                left -= count
            begin = seq.computed - offset
            self.runtime.model.forward(
                inputs[begin : begin + count], None, self.pool, seq.table, seq.computed
            )
            seq.computed += count
            self._publish_full(seq)
        return left

    def _decode(self, batch: list[_Sequence]) -> None:
        """One decode step for `batch`; sample, stream, and end the requests that finish."""
        model = self.runtime.model
        rows = self.rows
        step_rows = None
        if rows is not None:
            for seq in batch:
                if seq.row is None:
                    seq.row = rows.attach(len(seq.table) * self.runtime.page_tokens)
            batch.sort(key=_row_index)
            step_rows = rows.prepare(
                [s.row for s in batch if s.row is not None],
                [s.table for s in batch],
                [s.computed for s in batch],
            )
        logits = model.decode_step(
            torch.tensor([s.tokens[-1] for s in batch], dtype=torch.int64),
            None,
            self.pool,
            [s.table for s in batch],
            [s.computed for s in batch],
            rows=step_rows,
        )
        chosen = sample_tokens(
            logits, [s.sampler for s in batch], [len(s.output.tokens) for s in batch]
        )
        now = time.monotonic()
        page = self.runtime.page_tokens
        ended: list[tuple[_Sequence, TokenEvent]] = []
        for seq, token in zip(batch, chosen, strict=True):
            seq.computed += 1
            step = len(seq.output.tokens)
            piece, reason = seq.output.append(token)
            seq.tokens.append(token)
            if seq.computed % page == 0:
                self._publish_full(seq)
            if reason is None:
                seq.stream.put(TokenEvent(step, token, piece, None, None, now))
            else:
                ended.append((seq, TokenEvent(step, token, piece, reason, seq.stats(page), now)))
        # the highest rows first: a released row is then the last one more often, and nothing
        # moves into its place (requests that end together cost no copy of their rows)
        for seq, event in sorted(ended, key=lambda e: -_row_index(e[0])):
            self._release(seq)
            seq.stream.put(event)

    def _publish_full(self, seq: _Sequence) -> None:
        """Queue the pages of `seq` that filled since the last call."""
        page = self.runtime.page_tokens
        full = seq.computed // page
        if not self.options.publish or full <= seq.stored:
            return
        digest = seq.scope.digest
        while len(seq.keys) < full:
            i = len(seq.keys)
            seq.keys.append(
                chain_key(
                    seq.keys[-1] if seq.keys else digest, seq.tokens[i * page : (i + 1) * page]
                )
            )
        first = seq.stored
        ticket = self.link.publish(
            seq.scope,
            seq.keys[first - 1] if first else digest,
            [seq.tokens[i * page : (i + 1) * page] for i in range(first, full)],
            [self.pool.read_page(seq.table[i]) for i in range(first, full)],
            prefix_tokens=seq.tokens[: first * page],
        )
        if ticket.queued:
            seq.queued_pages += full - first
        seq.stored = full

    def _end(self, seq: _Sequence, reason: FinishReason) -> None:
        """Finish `seq` without a new token (cancelled), freeing what it holds."""
        stats = seq.stats(self.runtime.page_tokens)
        self._release(seq)
        seq.stream.finish_now(len(seq.output.tokens), reason, stats)

    def _release(self, seq: _Sequence) -> None:
        if seq in self._active:
            self._active.remove(seq)
        if seq.row is not None and self.rows is not None:
            self.rows.release(seq.row)
            seq.row = None
        if seq.table:
            self.pool.free(seq.table)
            seq.table = []
        self._in_flight.exit()


def _row_index(seq: _Sequence) -> int:
    return seq.row.index if seq.row is not None else -1
