"""`PrefillWorker`: the prefill half of a disaggregated engine (DESIGN §1, §8).

For one prompt: look its page keys up in the store, pull the hit pages straight into the KV
pool (io class NORMAL) and verify them, compute the missed tokens in chunks, publish each full
page as its chunk completes (in the background, io class BACKGROUND: the next chunk never waits
for a put), sample the first token, and answer with it, the page keys and how it went. Before it
answers it waits (bounded) for its own pages to be in the store, so the decode worker it hands
over to finds them.

A store that is absent, down, full or serves bad pages only makes a prefill compute more.
Prefills run one at a time per worker (the pool holds one prompt); callers queue on a lock.

Programmatic use (benchmarks):

    worker = PrefillWorker(checkpoint_dir, StoreClient(addr), page_tokens=16, chunk_tokens=256)
    result = worker.prefill(token_ids, SamplingParams(), namespace="t1")
    result.first_token, result.hit_tokens.total, result.computed_tokens, result.timings.compute_s
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from client import IoClass, Scope, page_keys
from engine.checkpoint import Checkpoint
from engine.kv_pool import PagedKVPool
from engine.lifecycle import InFlight
from engine.output import OutputText
from engine.publisher import PublishTicket
from engine.requests import PrefillResult, PrefillTimings, TierTokens
from engine.runtime import ModelRuntime, as_runtime
from engine.sampling import Sampler, SamplingParams
from engine.store_link import PageStore, PullResult, StoreLink

log = logging.getLogger(__name__)


class PrefillWorker:
    """Computes prompts' KV into the store and samples their first token. Thread-safe.

    `model` is a checkpoint (folder or loaded) or a ModelRuntime to share. `chunk_tokens` is
    the most tokens one forward pass takes. `await_publish` makes `prefill` wait up to
    `publish_timeout_s` for its pages to reach the store before it returns.
    """

    def __init__(
        self,
        model: ModelRuntime | Checkpoint | str | Path,
        store: PageStore | None,
        *,
        page_tokens: int | None = None,
        chunk_tokens: int = 256,
        max_context: int | None = None,
        device: torch.device | str | None = None,
        publish: bool = True,
        await_publish: bool = True,
        publish_timeout_s: float = 5.0,
        store_retry_after_s: float = 1.0,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.runtime = as_runtime(
            model, page_tokens=page_tokens, max_context=max_context, device=device
        )
        self.link = StoreLink(store, retry_after_s=store_retry_after_s)
        self.chunk_tokens = chunk_tokens
        self.publish = publish
        self.await_publish = await_publish
        self.publish_timeout_s = publish_timeout_s
        runtime = self.runtime
        self.pool: PagedKVPool = runtime.new_pool(-(-runtime.max_context // runtime.page_tokens))
        self._lock = threading.Lock()
        self._in_flight = InFlight("prefill")

    @property
    def in_flight(self) -> int:
        """Prefills running or waiting for the worker."""
        return self._in_flight.count

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        return self._in_flight.wait_idle(timeout_s)

    def prefill(
        self,
        token_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        *,
        text: str = "",
        namespace: str = "",
        request_id: str = "",
        use_cache: bool = True,
    ) -> PrefillResult:
        """Prefill a prompt (token ids, or `text` to tokenize) in the scope `namespace`.

        `use_cache` False skips the store lookup (the prompt is computed in full; its pages are
        still published). Mutates the store (publishes), never the caller's data. Raises
        InvalidRequest for a bad prompt or sampling value, EngineStopping after `stop()`.
        """
        arrived = time.perf_counter()
        params = sampling if sampling is not None else SamplingParams()
        runtime = self.runtime
        params.check_vocab(runtime.vocab_size)
        ids = runtime.prompt_ids(token_ids, text)
        scope = runtime.scope(namespace)
        self._in_flight.enter()
        try:
            with self._lock:
                return self._prefill(ids, params, scope, request_id, use_cache, arrived)
        finally:
            self._in_flight.exit()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Take no new prefills, wait up to `timeout_s` for those in flight, then finish
        publishing. False if some were still running at the deadline."""
        busy = self._in_flight.close()
        if busy:
            log.info("prefill worker stopping: finishing %d in-flight request(s)", busy)
        deadline = time.monotonic() + timeout_s
        idle = self._in_flight.wait_idle(timeout_s)
        self.link.close(max(0.1, deadline - time.monotonic()))
        return idle

    def close(self) -> None:
        """`stop()` without waiting for work in flight beyond a short grace."""
        self.stop(timeout_s=1.0)

    # ---- one prefill -----------------------------------------------------------------------

    def _prefill(
        self,
        ids: list[int],
        params: SamplingParams,
        scope: Scope,
        request_id: str,
        use_cache: bool,
        arrived: float,
    ) -> PrefillResult:
        runtime, pool = self.runtime, self.pool
        began = time.perf_counter()
        count, page = len(ids), runtime.page_tokens
        keys = page_keys(scope, ids)
        table = pool.allocate(pool.pages_for(count))
        tickets: list[PublishTicket] = []
        try:
            pulled = (
                self.link.pull(scope, ids, keys, pool, table, IoClass.NORMAL)
                if use_cache
                else PullResult()
            )
            start = min(pulled.pages * page, count - 1)  # the last token is always computed
            published = pulled.pages  # pages below this are in the store or queued for it
            inputs = torch.tensor(ids, dtype=torch.int64)
            computing = time.perf_counter()
            logits = None
            for begin in range(start, count, self.chunk_tokens):
                end = min(count, begin + self.chunk_tokens)
                logits = runtime.model.forward(inputs[begin:end], None, pool, table, begin)
                full = end // page
                if self.publish and full > published:
                    tickets.append(self._publish(scope, keys, ids, table, published, full))
                    published = full
            assert logits is not None
            runtime.synchronize()
            sampling = time.perf_counter()
            first = Sampler(params).sample(logits, step=0)
            output = OutputText(
                runtime.tokenizer,
                params,
                limit=min(params.max_tokens, runtime.max_context - count),
                eos_ids=runtime.eos_ids,
            )
            piece, reason = output.append(first)
            sampled = time.perf_counter()
        finally:
            pool.free(table)
        if self.await_publish and tickets:
            deadline = time.monotonic() + self.publish_timeout_s
            for ticket in tickets:
                ticket.wait(max(0.0, deadline - time.monotonic()))
        done = time.perf_counter()
        return PrefillResult(
            request_id=request_id,
            first_token=first,
            first_text=piece,
            finish_reason=reason,
            prompt_token_ids=tuple(ids),
            page_keys=tuple(keys),
            hit_tokens=TierTokens.of_pages(pulled.tiers, page),
            computed_tokens=count - start,
            published_pages=sum(t.stored for t in tickets if t.done),
            rejected_pages=pulled.rejected,
            timings=PrefillTimings(
                queue_s=began - arrived,
                lookup_s=pulled.lookup_s,
                pull_s=pulled.pull_s,
                compute_s=sampling - computing,
                sample_s=sampled - sampling,
                publish_wait_s=done - sampled,
                total_s=done - arrived,
            ),
        )

    def _publish(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        ids: Sequence[int],
        table: Sequence[int],
        first: int,
        end: int,
    ) -> PublishTicket:
        """Queue pages [first, end) of the prompt (copied out of the pool now)."""
        page = self.runtime.page_tokens
        return self.link.publish(
            scope,
            keys[first - 1] if first else scope.digest,
            [ids[i * page : (i + 1) * page] for i in range(first, end)],
            [self.pool.read_page(table[i]) for i in range(first, end)],
            prefix_tokens=ids[: first * page],
        )
