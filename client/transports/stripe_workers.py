"""The threads a blocking client runs the stripes of a large TCP batch on (client/core/stripes.py).

`StripeWorkers.run_all(calls)` runs the first call in the caller's thread and the others on a
few persistent daemon threads, started on first use, so the socket I/O of every stripe (which
releases the GIL) overlaps. A stripe no worker has picked up by the time the caller's own is
done runs in the caller's thread next: many threads striping at once through one client never
wait on each other's stripes for longer than their own calls take. `close()` stops the threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_JOIN_S = 1.0


class _Job(Generic[T]):
    """One call handed to the workers: whoever claims it first (a worker or the caller) runs
    it; `done` is set once its outcome is in."""

    __slots__ = ("_claim", "call", "done", "error", "value")

    def __init__(self, call: Callable[[], T]) -> None:
        self.call = call
        self._claim = threading.Lock()
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def claim(self) -> bool:
        return self._claim.acquire(blocking=False)

    def run(self) -> None:
        try:
            self.value = self.call()
        except BaseException as exc:  # handed to the caller, which decides
            self.error = exc
        finally:
            self.done.set()

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class StripeWorkers:
    """Up to `size` daemon threads named `name`, started as the calls first need them."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = max(size, 1)
        self._jobs: queue.SimpleQueue[_Job[object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def run_all(self, calls: Sequence[Callable[[], T]], wait_s: float) -> list[T]:
        """Run every one of `calls` (the first in this thread, the others alongside it) and
        return their results in order once all have ended; the first call's exception (or,
        after it, the first other one's) is raised once all have ended. The calls should catch
        what they expect to raise: an exception here loses the other results. Each call bounds
        its own time (its deadline); one still running `wait_s` after this thread's own ended
        raises TimeoutError (a safety net: it is then left to end on its own)."""
        jobs = [_Job(call) for call in calls[1:]]
        if jobs:
            self._start(len(jobs))
            for job in jobs:
                self._jobs.put(job)  # type: ignore[arg-type]
        first = _Job(calls[0])
        first.claim()
        first.run()
        for job in jobs:  # one no worker took yet: run it here
            if job.claim():
                job.run()
        for job in jobs:
            if not job.done.wait(wait_s):
                raise TimeoutError(f"a stripe ran {wait_s:.1f} s past the others")
        return [first.outcome(), *(job.outcome() for job in jobs)]

    def close(self) -> None:
        """Stop the threads (each ends after the call it runs, if any). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(_JOIN_S)

    def _start(self, wanted: int) -> None:
        with self._lock:
            if self._closed:
                return  # the caller's thread runs every call itself
            while len(self._threads) < min(wanted, self._size):
                thread = threading.Thread(
                    target=self._work,
                    name=f"{self._name}-{len(self._threads) + 1}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.claim():
                job.run()
