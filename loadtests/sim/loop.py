"""The simulator's event loop: a heap of (time, sequence, callback) on a virtual clock.

A small heap loop rather than SimPy: the engines here are state machines that schedule their next
iteration themselves, so SimPy's processes and resources would add a generator per engine and a
second scheduler without removing any code; the heap keeps ties deterministic (insertion order
breaks them, never object identity), costs one push and one pop per event, and lets the invariant
"time never goes backwards" be checked at one place: `at` refuses a time before `now`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class SimError(RuntimeError):
    """The simulation broke one of its invariants (a bug in the model, not bad input)."""


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[object, ...]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` at virtual time `t` (>= now)."""
        if not t >= self.now or math.isnan(t):
            raise SimError(f"event at {t} is before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: object) -> None:
        self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float = math.inf, max_events: int = 50_000_000) -> None:
        """Process events in time order up to `until` (bounded by `max_events`)."""
        while self._heap and self._heap[0][0] <= until:
            if self.events >= max_events:
                raise SimError(f"more than {max_events} events: the model does not settle")
            t, _, fn, args = heapq.heappop(self._heap)
            if t < self.now:
                raise SimError(f"time went backwards: {t} < {self.now}")
            self.now = t
            self.events += 1
            fn(*args)

    @property
    def pending(self) -> int:
        return len(self._heap)
