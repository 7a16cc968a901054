"""The background thread that publishes an engine's new pages, so compute never waits on a put.

Jobs are queued in order and put one at a time; a bounded queue (in pages and in payload bytes:
4096 pages of 2 MiB would be 8 GiB) drops a job rather than grow without end when the store is
slower than the engine. Each job has a ticket the
submitter may wait on (a prefill waits for its own pages before it answers, so the decode
worker it hands over to finds them).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from client import Page, Scope, make_header

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishJob:
    """Consecutive full pages of one sequence: page i has `tokens[i]` and `payloads[i]`; the
    first follows `parent` (the key of the page before it, or the scope digest), and
    `prefix_tokens` are the ids of the sequence's pages before it (they let a store node that
    holds none of those pages verify the key chain, kvstore/chain.py)."""

    scope: Scope
    parent: bytes
    tokens: tuple[tuple[int, ...], ...]
    payloads: tuple[bytes, ...]
    prefix_tokens: tuple[int, ...] = ()

    def pages(self) -> list[Page]:
        """The pages with their headers (keys chained from `parent`, checksums computed)."""
        out: list[Page] = []
        parent = self.parent
        for tokens, payload in zip(self.tokens, self.payloads, strict=True):
            header = make_header(self.scope, parent, tokens, payload)
            out.append(Page(header=header, payload=payload))
            parent = header.key
        return out


class PublishTicket:
    """The outcome of one job, once `done`: `stored` pages were new to the store, `present`
    were there already; the rest were dropped, refused or failed."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.stored = 0
        self.present = 0
        self.queued = True  # False: dropped before any put was tried
        self._done = threading.Event()

    @classmethod
    def skipped(cls, pages: int) -> PublishTicket:
        """A ticket for pages that were not queued (no store, store down, queue full)."""
        ticket = cls(pages)
        ticket.queued = False
        ticket._done.set()
        return ticket

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job was put (or given up); False on timeout."""
        return self._done.wait(timeout_s)

    def finish(self, stored: int, present: int = 0) -> None:
        self.stored = stored
        self.present = present
        self._done.set()


class Publisher:
    """Runs `put(job) -> (pages stored, pages already present)` (which must not raise) on one
    daemon thread."""

    def __init__(
        self,
        put: Callable[[PublishJob], tuple[int, int]],
        *,
        max_pending_pages: int = 4096,
        max_pending_bytes: int = 512 << 20,
    ) -> None:
        self._put = put
        self._max_pending = max_pending_pages
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[PublishJob, PublishTicket]] = collections.deque()
        self._pending_pages = 0
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._published = 0
        self._unpublished = 0

    def submit(self, job: PublishJob) -> PublishTicket:
        """Queue a job; returns at once. Dropped (a done ticket, nothing stored) when the queue
        holds `max_pending_pages` (or `max_pending_bytes` of payloads) already or the publisher
        is closed."""
        size = len(job.payloads)
        n_bytes = sum(len(p) for p in job.payloads)
        ticket = PublishTicket(size)
        with self._cond:
            if (
                self._closed
                or self._pending_pages + size > self._max_pending
                or self._pending_bytes + n_bytes > self._max_pending_bytes
            ):
                self._unpublished += size
                log.debug("publish queue full or closed: %d page(s) dropped", size)
                return PublishTicket.skipped(size)
            self._queue.append((job, ticket))
            self._pending_pages += size
            self._pending_bytes += n_bytes
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="strata-publish", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return ticket

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is empty and no put is running; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queue (up to `timeout_s`), then stop; later jobs are dropped."""
        self.drain(timeout_s)
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._pending_pages = 0
            self._pending_bytes = 0
            self._cond.notify_all()
        with self._cond:
            self._unpublished += sum(len(job.payloads) for job, _ in dropped)
        for _, ticket in dropped:
            ticket.finish(0)
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def counts(self) -> tuple[int, int]:
        """(pages stored, pages dropped, refused or failed) so far."""
        with self._cond:
            return self._published, self._unpublished

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job, ticket = self._queue.popleft()
                self._busy = True
            stored = present = 0
            try:
                stored, present = self._put(job)
            except Exception:  # the callback must not raise; never let the thread die of it
                log.exception("publishing %d page(s) failed", len(job.payloads))
            finally:
                with self._cond:
                    self._busy = False
                    self._pending_pages -= len(job.payloads)
                    self._pending_bytes -= sum(len(p) for p in job.payloads)
                    self._published += stored
                    self._unpublished += len(job.payloads) - stored - present
                    self._cond.notify_all()
                ticket.finish(stored, present)
