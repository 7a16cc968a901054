"""Admission of long-lived gRPC streams: a few clients must not take every server thread.

The gRPC server is threaded: a streaming call (Put, Get, Watch) holds one thread for as long
as it lasts, and a stalled put or a Watch can last forever. `StreamGate` lets at most `slots`
streams in at once, and at most `per_client` from one client (one gRPC peer, i.e. one
connection); a stream beyond either is refused at once (CapacityExhausted: RESOURCE_EXHAUSTED
with a retry hint), so it never waits on a thread, and the threads beyond `slots` stay free for
unary calls. BACKGROUND streams (prefetch, publishing, Watch) get at most half of the slots, so
background work waiting for its turn never keeps a critical or normal get from a thread.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.errors import CapacityExhausted
from kvstore.keys import IoClass

__all__ = ["StreamGate"]


class StreamGate:
    """Counts streams in progress, in total and per client."""

    def __init__(self, slots: int, per_client: int, retry_after_s: float = 0.5) -> None:
        self._slots = slots
        self._per_client = per_client
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._total = 0
        self._background = 0
        self._by_client: dict[str, int] = {}

    @contextmanager
    def enter(self, client: str, io_class: IoClass = IoClass.NORMAL) -> Iterator[None]:
        """Hold a stream slot for the `with` body; raises CapacityExhausted when none is free."""
        background = io_class is IoClass.BACKGROUND
        with self._lock:
            mine = self._by_client.get(client, 0)
            if (
                self._total >= self._slots
                or mine >= self._per_client
                or (background and self._background >= max(1, self._slots // 2))
            ):
                raise CapacityExhausted(
                    f"too many streams in progress ({self._total} of {self._slots}; "
                    f"{mine} of {self._per_client} for this client): retry later",
                    retry_after_s=self._retry_after_s,
                )
            self._total += 1
            self._background += background
            self._by_client[client] = mine + 1
        try:
            yield
        finally:
            with self._lock:
                self._total -= 1
                self._background -= background
                left = self._by_client[client] - 1
                if left:
                    self._by_client[client] = left
                else:
                    del self._by_client[client]

    @property
    def in_progress(self) -> int:
        with self._lock:
            return self._total
