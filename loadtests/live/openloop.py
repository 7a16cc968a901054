"""The open-loop scheduler: requests leave at the arrival process's times, whoever is still busy.

`OpenLoop(intended, fire, spawn=...)` walks the schedule on its own clock: it sleeps until each
intended send time and hands the request to `spawn` (a new greenlet under locust, a new thread in
tests), so a slow server delays no later request — the client never waits for a response before
sending the next one (no coordinated omission). Each dispatch is stamped with its intended and
actual send time; latencies are then counted from the intended time, and the lag (actual minus
intended) says whether the client kept its schedule. `run()` returns a `Schedule`: what was sent,
the lags, and whether the client fell behind (p99 lag over `max_lag_s`).

Bounded: at most len(intended) dispatches, none after `deadline_s`; `stop()` ends it early.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Schedule:
    intended: int  # requests on the schedule (within the deadline)
    sent: int
    lags_s: tuple[float, ...]
    max_lag_s: float
    p99_lag_s: float
    behind: bool  # the client fell behind its schedule

    @property
    def mean_lag_s(self) -> float:
        return sum(self.lags_s) / len(self.lags_s) if self.lags_s else 0.0


def _p99(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def thread_spawn(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


class OpenLoop:
    def __init__(
        self,
        intended: Sequence[float],
        fire: Callable[[int, float, float], None],
        *,
        spawn: Callable[[Callable[[], None]], object] = thread_spawn,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        deadline_s: float = math.inf,
        max_lag_s: float = 0.05,
    ) -> None:
        """`fire(index, intended_s, sent_s)` sends request `index` (times from the run's start)."""
        if any(b < a for a, b in itertools.pairwise(intended)):
            raise ValueError("the schedule must be sorted")
        self.intended = list(intended)
        self.fire = fire
        self.spawn = spawn
        self.clock = clock
        self.sleep = sleep
        self.deadline_s = deadline_s
        self.max_lag_s = max_lag_s
        self.t0 = 0.0
        self.sent = 0
        self._stop = threading.Event()

    def now(self) -> float:
        """Seconds since the run started (the clock every record uses)."""
        return self.clock() - self.t0

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> Schedule:
        self.t0 = self.clock()
        lags: list[float] = []
        due = [t for t in self.intended if t <= self.deadline_s]
        for index, t in enumerate(due):
            if self._stop.is_set():
                break
            delay = t - self.now()
            if delay > 0:
                self.sleep(delay)
            sent = self.now()
            lags.append(max(0.0, sent - t))
            self.sent += 1
            self.spawn(lambda i=index, t=t, s=sent: self.fire(i, t, s))
        p99 = _p99(lags)
        return Schedule(
            len(due), self.sent, tuple(lags), max(lags, default=0.0), p99, p99 > self.max_lag_s
        )
