"""The threads a blocking client runs the stripes of a large TCP batch on (client/core/stripes.py).

`StripeWorkers.run_all(calls)` runs the first call in the caller's thread and each other one on
an idle thread of a small persistent pool of daemon threads, started as first needed, so the
socket I/O of every stripe (which releases the GIL) overlaps. When many threads stripe at once
through one client and no thread is idle, a stripe runs in its caller's thread after the
caller's own: no call ever waits for another call's stripes. `close()` stops the threads.
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


class _Worker:
    """One daemon thread and the queue of the jobs handed to it."""

    __slots__ = ("jobs", "thread")

    def __init__(self, name: str, pool: StripeWorkers) -> None:
        self.jobs: queue.SimpleQueue[_Job[object] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=pool._work, args=(self,), name=name, daemon=True)


class StripeWorkers:
    """Up to `size` daemon threads named `name`, started as the calls first need them. Each
    call's stripes go to idle threads, one each, so they run at the same time; a stripe that
    finds none idle runs in the caller's thread after its own."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = max(size, 1)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._closed = False

    def run_all(self, calls: Sequence[Callable[[], T]], wait_s: float) -> list[T]:
        """Run every one of `calls` (the first in this thread, the others alongside it) and
        return their results in order once all have ended; the first call's exception (or,
        after it, the first other one's) is raised once all have ended. The calls should catch
        what they expect to raise: an exception here loses the other results. Each call bounds
        its own time (its deadline); one still running `wait_s` after this thread's own ended
        raises TimeoutError (a safety net: it is then left to end on its own)."""
        jobs = [_Job(call) for call in calls[1:]]
        for job in jobs:
            worker = self._take_idle()
            if worker is None:
                break  # the rest run here
            worker.jobs.put(job)  # type: ignore[arg-type]
        first = _Job(calls[0])
        first.claim()
        first.run()
        for job in jobs:  # one no worker took (or started) yet: run it here
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
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.jobs.put(None)
        for worker in workers:
            worker.thread.join(_JOIN_S)

    def _take_idle(self) -> _Worker | None:
        """An idle worker, started now if all are busy and there is room; None: none."""
        with self._lock:
            if self._closed:
                return None
            if self._idle:
                return self._idle.pop()
            if len(self._all) >= self._size:
                return None
            worker = _Worker(f"{self._name}-{len(self._all) + 1}", self)
            self._all.append(worker)
        worker.thread.start()
        return worker

    def _work(self, worker: _Worker) -> None:
        while True:
            job = worker.jobs.get()
            if job is None:
                return
            if job.claim():
                job.run()
            with self._lock:
                if self._closed:
                    return
                self._idle.append(worker)
