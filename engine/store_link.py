"""An engine's link to the store: pull verified pages into the KV pool, publish new ones.

The store makes serving faster, never less available (DESIGN §1): every failure here — a store
that is down, slow, full, or serves a page that fails verification — becomes a miss (for a pull)
or a page left unpublished, counted and logged, never an exception for the request.

A pulled page is used only when its header names the key asked for, the request's scope, dtype
and layout, and exactly the request's tokens for that page (DESIGN §3: a hash is not proof).
After an Unavailable error the link stops calling the store for `retry_after_s`, so a dead store
costs one failed call per interval rather than one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from client import (
    CapacityExhausted,
    GetResult,
    IoClass,
    LookupResult,
    Page,
    PutResult,
    Scope,
    Tier,
    Unavailable,
    WritableBuffer,
    page_tokens,
)
from engine.kv_pool import PagedKVPool
from engine.publisher import Publisher, PublishJob, PublishTicket

log = logging.getLogger(__name__)

__all__ = ["Fetched", "LinkStats", "PageStore", "PublishTicket", "PullResult", "StoreLink"]


class PageStore(Protocol):
    """What the engine needs of a store client: `client.StoreClient` (one daemon) and
    `client.ClusterClient` (a cluster; see `engine.store_spec`) are both one."""

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult: ...

    def get(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        into: Sequence[WritableBuffer],
        *,
        tokens: Sequence[Sequence[int]] | None,
        io_class: IoClass | None = None,
        verify: bool | None = None,
    ) -> GetResult: ...

    def put(
        self,
        scope: Scope,
        pages: Sequence[Page],
        *,
        io_class: IoClass | None = None,
        tier: Tier | None = None,
        prefix_tokens: Sequence[int] = (),
    ) -> PutResult: ...


@dataclass(frozen=True, slots=True)
class PullResult:
    """`pages` leading pages of the request are in its pool pages now, verified; `tiers[i]` is
    the tier page i was found in. `rejected` pages were served but failed verification."""

    pages: int = 0
    tiers: tuple[Tier, ...] = ()
    rejected: int = 0
    lookup_s: float = 0.0
    pull_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Counters since the link was made."""

    pulled_pages: int
    rejected_pages: int
    store_errors: int
    published_pages: int
    unpublished_pages: int


class StoreLink:
    """Pulls and publishes for one worker. `store` None: every pull misses, nothing is
    published. Pulls run on the caller's thread; publishing on a background thread. `clock`
    (monotonic seconds) times the outage back-off."""

    def __init__(
        self,
        store: PageStore | None,
        *,
        retry_after_s: float = 1.0,
        max_pending_pages: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self._quiet = False  # a failure or a full store was logged; log again after a success
        self._pulled = self._rejected = self._errors = 0
        self._publisher = Publisher(self._put, max_pending_pages=max_pending_pages)

    # ---- pulling ---------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """A store is configured and not in its outage back-off: a pull may find pages."""
        return self.store is not None and self._usable()

    def pull(
        self,
        scope: Scope,
        token_ids: Sequence[int],
        keys: Sequence[bytes],
        pool: PagedKVPool,
        block_table: Sequence[int],
        io_class: IoClass,
    ) -> PullResult:
        """Load the longest run of leading pages `keys` (of `token_ids`) the store has into the
        pool pages `block_table[:len(keys)]` — on a CPU pool straight into the pages' memory.
        Pages the store served but that fail verification end the run and are zeroed in the
        pool. Runs on the thread that owns the pool. Never raises for a store problem."""
        on_cpu = pool.device.type == "cpu"
        pages = list(block_table[: len(keys)])

        def buffers(count: int) -> list[WritableBuffer]:
            if on_cpu:
                return [pool.page_bytes_view(p) for p in pages[:count]]
            return [bytearray(pool.page_payload_bytes) for _ in range(count)]

        got = self._fetch(scope, token_ids, keys, io_class, buffers)
        for i in range(got.served):
            if i >= got.result.pages:
                pool.tensor[pages[i]].zero_()  # a partial or rejected copy must not linger
            elif not on_cpu:
                pool.load_page(pages[i], got.buffers[i])
        return got.result

    def fetch(
        self,
        scope: Scope,
        token_ids: Sequence[int],
        keys: Sequence[bytes],
        page_payload_bytes: int,
        io_class: IoClass,
    ) -> Fetched:
        """Like `pull`, into host buffers of its own instead of a pool: for a thread that does
        not own the pool (the pages go in later with `Fetched.load_into`). Thread-safe."""
        got = self._fetch(
            scope,
            token_ids,
            keys,
            io_class,
            lambda count: [bytearray(page_payload_bytes) for _ in range(count)],
        )
        return Fetched(got.result, got.buffers[: got.result.pages])

    def _fetch(
        self,
        scope: Scope,
        token_ids: Sequence[int],
        keys: Sequence[bytes],
        io_class: IoClass,
        buffers: Callable[[int], list[WritableBuffer]],
    ) -> _Got:
        """Lookup, get into `buffers(hit count)`, verify. `served` buffers were handed to get."""
        store = self.store
        if store is None or not keys or not self._usable():
            return _Got(PullResult(), (), 0)
        start = time.perf_counter()
        try:
            found = store.lookup(scope, keys)
        except Exception as exc:
            self._failed("lookup", exc)
            return _Got(PullResult(lookup_s=time.perf_counter() - start), (), 0)
        self._reachable()
        looked = time.perf_counter()
        count = found.hit_count
        if count == 0:
            return _Got(PullResult(lookup_s=looked - start), (), 0)
        into = buffers(count)
        try:
            # the SDK delivers a page only if it is the one asked for: key, scope, KV format and
            # exactly these tokens (a collision is a miss, counted in `rejected`); verify=True
            # checks payload checksums where bytes cross a network (gRPC, TCP, UCX); on the
            # same-host path every copy is fenced by its slot generation instead (a torn or
            # reused slot is a miss) and no payload is hashed (client/transports/shm.py)
            tokens = page_tokens(scope, token_ids)[:count]
            got = store.get(scope, keys[:count], into, tokens=tokens, io_class=io_class, verify=True)
            usable, rejected = got.prefix_hits, got.rejected
        except Exception as exc:
            self._failed("get", exc)
            usable = rejected = 0
        if rejected:
            log.warning(
                "%d page(s) served for scope %s failed verification; computing them instead",
                rejected,
                scope.digest.hex()[:12],
            )
        with self._lock:
            self._pulled += usable
            self._rejected += rejected
        result = PullResult(
            pages=usable,
            tiers=tuple(found.tiers[:usable]),
            rejected=rejected,
            lookup_s=looked - start,
            pull_s=time.perf_counter() - looked,
        )
        return _Got(result, tuple(into), count)

    # ---- publishing ------------------------------------------------------------------------

    def publish(
        self,
        scope: Scope,
        parent: bytes,
        page_tokens: Sequence[Sequence[int]],
        payloads: Sequence[bytes],
        prefix_tokens: Sequence[int] = (),
    ) -> PublishTicket:
        """Queue full pages for the store (io class BACKGROUND): page i has tokens
        `page_tokens[i]` and payload `payloads[i]`, and follows `parent` (the key of the page
        before the first, or the scope digest), whose prompt's earlier pages hold
        `prefix_tokens` (sent along: a cluster node verifies the key chain from them). Returns
        at once; `ticket.wait()` to know the
        outcome. Dropped (not queued) when the store is absent or down, or the queue is full."""
        job = PublishJob(
            scope,
            parent,
            tuple(tuple(t) for t in page_tokens),
            tuple(payloads),
            tuple(prefix_tokens),
        )
        if self.store is None or not self._usable():
            return PublishTicket.skipped(len(payloads))
        return self._publisher.submit(job)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page was published or given up; False on timeout."""
        return self._publisher.drain(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish queued publishing (up to `timeout_s`) and stop the background thread."""
        self._publisher.close(timeout_s)

    @property
    def stats(self) -> LinkStats:
        with self._lock:
            pulled, rejected, errors = self._pulled, self._rejected, self._errors
        published, unpublished = self._publisher.counts()
        return LinkStats(pulled, rejected, errors, published, unpublished)

    def _put(self, job: PublishJob) -> tuple[int, int]:
        """Publisher callback: put one job's pages; (stored, already present), (0, 0) after any
        failure."""
        store = self.store
        if store is None or not self._usable():
            return 0, 0
        try:
            pages = job.pages()
            result = store.put(
                job.scope, pages, io_class=IoClass.BACKGROUND, prefix_tokens=job.prefix_tokens
            )
        except CapacityExhausted as exc:
            self._log_once(
                logging.INFO, "store full, pages not published (until it has room): %s", exc
            )
            return 0, 0
        except Exception as exc:
            self._failed("put", exc)
            return 0, 0
        self._reachable()
        return result.stored, result.already_present

    # ---- store health ----------------------------------------------------------------------

    def _usable(self) -> bool:
        with self._lock:
            return not self._down or self.clock() >= self._down_until

    def _failed(self, call: str, exc: Exception) -> None:
        with self._lock:
            self._errors += 1
            if isinstance(exc, Unavailable):
                was_down = self._down
                self._down = True
                self._down_until = self.clock() + self.retry_after_s
            else:
                was_down = True
        if isinstance(exc, Unavailable):
            if not was_down:
                log.info(
                    "store unavailable (%s failed: %s); computing without it, retrying in %.1f s",
                    call,
                    exc,
                    self.retry_after_s,
                )
        else:
            self._log_once(
                logging.WARNING,
                "store %s failed, treated as a miss: %s",
                call,
                f"{type(exc).__name__}: {exc}",
            )

    def _log_once(self, level: int, message: str, *args: object) -> None:
        """Log at `level` the first time since the last successful call, at DEBUG after."""
        with self._lock:
            quiet, self._quiet = self._quiet, True
        log.log(logging.DEBUG if quiet else level, message, *args)

    def _reachable(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
            self._quiet = False
        if was_down:
            log.info("store reachable again")


@dataclass(frozen=True, slots=True)
class Fetched:
    """Verified leading pages in host memory, not yet in any pool: `payloads[i]` is page i."""

    result: PullResult
    payloads: tuple[WritableBuffer, ...]

    def load_into(self, pool: PagedKVPool, block_table: Sequence[int]) -> None:
        """Copy the pages into `block_table[:len(payloads)]` (on the thread owning the pool)."""
        for page, payload in zip(block_table, self.payloads, strict=False):
            pool.load_page(page, payload)


@dataclass(frozen=True, slots=True)
class _Got:
    result: PullResult
    buffers: tuple[WritableBuffer, ...]
    served: int
