"""The event stream: page stored / removed / moved between tiers, for watchers (routers, tools).

A bounded ring of recent events with a sequence number. Watchers read from a cursor; one that
falls more than the ring's length behind skips ahead (and sees the jump in `seq`). Publishing
never blocks on a slow watcher.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import deque
from dataclasses import dataclass

from kvstore.keys import Tier


class EventKind(enum.IntEnum):
    STORED = 1
    REMOVED = 2
    MOVED = 3


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    kind: EventKind
    key: bytes
    scope_digest: bytes
    from_tier: Tier | None
    to_tier: Tier | None
    size_bytes: int


class EventLog:
    """Thread-safe bounded event ring with blocking reads."""

    def __init__(self, capacity: int = 65536) -> None:
        # (seq, kind, key, scope digest, from, to, size): Event objects are built only for readers
        self._ring: deque[tuple[int, EventKind, bytes, bytes, Tier | None, Tier | None, int]] = (
            deque(maxlen=capacity)
        )
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False

    def publish(
        self,
        kind: EventKind,
        key: bytes,
        scope_digest: bytes,
        size_bytes: int,
        from_tier: Tier | None = None,
        to_tier: Tier | None = None,
    ) -> None:
        """Append an event and wake watchers. Mutates the ring; never blocks on readers."""
        self.publish_many([(kind, key, scope_digest, size_bytes, from_tier, to_tier)])

    def publish_many(
        self, items: list[tuple[EventKind, bytes, bytes, int, Tier | None, Tier | None]]
    ) -> None:
        """Append several events (kind, key, scope digest, size, from, to) under one lock."""
        if not items:
            return
        with self._cond:
            seq = self._seq
            self._ring.extend(
                (seq + n, kind, key, digest, from_tier, to_tier, size)
                for n, (kind, key, digest, size, from_tier, to_tier) in enumerate(items, 1)
            )
            self._seq = seq + len(items)
            self._cond.notify_all()

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def read(self, after_seq: int, timeout_s: float) -> list[Event]:
        """Events with seq > after_seq; waits up to timeout_s for one. Empty list on timeout/close."""
        with self._cond:
            if self._seq <= after_seq and not self._closed:
                self._cond.wait(timeout_s)
            if not self._ring or self._seq <= after_seq:
                return []
            first = self._ring[0][0]
            start = max(0, after_seq + 1 - first)
            return [Event(*raw) for raw in itertools.islice(self._ring, start, None)]

    def close(self) -> None:
        """Wake every reader; later reads return immediately."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
