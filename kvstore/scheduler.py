"""I/O admission by class (DESIGN §6): critical before normal before background, background capped.

At most `concurrency` data operations run at once. A waiting operation is granted a slot only when
it is the first of the most urgent non-empty class queue (CRITICAL < NORMAL < BACKGROUND, FIFO
within a class), so a stream of background work never delays a decode waiting to start.

Background bytes also pass a token bucket of `background_bytes_per_s` (0 = uncapped). The bucket
holds one second's worth; an operation may start once the bucket holds `min(nbytes, rate)` and
then takes all `nbytes`, going into debt, so a single operation larger than the burst still
passes and the average rate still holds. A background operation waiting for tokens holds no slot.

Thread-safe: one lock and one Condition; waiting is on the Condition, the rate wait uses the
injected `sleep` with the lock released (tests pass a fake clock and sleep).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvstore.errors import DeadlineExceeded, InvalidArgument
from kvstore.keys import IoClass

__all__ = ["IoScheduler"]

_ORDER = (IoClass.CRITICAL, IoClass.NORMAL, IoClass.BACKGROUND)
_SLACK_BYTES = 0.5  # float tolerance when comparing tokens to a need


class IoScheduler:
    """Admits data operations by I/O class; see the module doc for the rules."""

    def __init__(
        self,
        concurrency: int,
        background_bytes_per_s: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Raises InvalidArgument if `concurrency` < 1 or `background_bytes_per_s` < 0."""
        if concurrency < 1:
            raise InvalidArgument(f"concurrency must be >= 1, not {concurrency}")
        if background_bytes_per_s < 0:
            raise InvalidArgument("background_bytes_per_s must be >= 0 (0 = uncapped)")
        self._concurrency = concurrency
        self._rate = background_bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[IoClass, deque[object]] = {c: deque() for c in _ORDER}
        self._running = 0
        self._admitted = dict.fromkeys(_ORDER, 0)
        self._tokens = float(background_bytes_per_s)  # starts full
        self._refilled_at = clock()
        self._observers = 0  # threads in wait_for_depth; enqueues notify only when > 0

    @contextmanager
    def admit(
        self, io_class: IoClass, nbytes: int, timeout_s: float | None = None
    ) -> Iterator[None]:
        """Block until the operation may run, hold a slot for the `with` body, then free it.

        Raises InvalidArgument if `nbytes` < 0, DeadlineExceeded if not admitted within
        `timeout_s` (measured on the injected clock; None = wait as long as it takes).
        """
        if nbytes < 0:
            raise InvalidArgument(f"nbytes must be >= 0, not {nbytes}")
        self._acquire(IoClass(io_class), nbytes, timeout_s)
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def running(self) -> int:
        """Operations holding a slot now."""
        with self._cond:
            return self._running

    def queue_depths(self) -> dict[IoClass, int]:
        """Operations waiting now, per class (including a background one waiting for tokens)."""
        with self._cond:
            return {c: len(q) for c, q in self._queues.items()}

    def admitted_bytes(self, io_class: IoClass) -> int:
        """Bytes admitted so far in `io_class` (a counter for metrics)."""
        with self._cond:
            return self._admitted[IoClass(io_class)]

    def wait_for_depth(self, io_class: IoClass, depth: int, timeout_s: float) -> bool:
        """Block until at least `depth` operations of `io_class` are queued, or `timeout_s`
        (real seconds) passes; returns whether they are. For tests and shutdown sequencing."""
        with self._cond:
            self._observers += 1
            try:
                return self._cond.wait_for(
                    lambda: len(self._queues[io_class]) >= depth, timeout=timeout_s
                )
            finally:
                self._observers -= 1

    # ---- internals --------------------------------------------------------------------------

    def _acquire(self, io_class: IoClass, nbytes: int, timeout_s: float | None) -> None:
        ticket = object()
        deadline = None if timeout_s is None else self._clock() + timeout_s
        queue = self._queues[io_class]
        with self._cond:
            queue.append(ticket)
            if self._observers:
                self._cond.notify_all()
            try:
                while True:
                    if self._running < self._concurrency and self._head() is ticket:
                        wait_s = (
                            self._take_tokens(nbytes) if io_class is IoClass.BACKGROUND else 0.0
                        )
                        if wait_s <= 0:
                            queue.popleft()
                            self._running += 1
                            self._admitted[io_class] += nbytes
                            self._cond.notify_all()  # the next head may fit another free slot
                            return
                        if deadline is not None and self._clock() + wait_s > deadline:
                            raise DeadlineExceeded(f"background rate cap: {wait_s:.3f}s to wait")
                        self._cond.release()  # sleep for tokens without blocking anyone
                        try:
                            self._sleep(wait_s)
                        finally:
                            self._cond.acquire()
                        continue
                    if deadline is None:
                        self._cond.wait()
                        continue
                    left = deadline - self._clock()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"{io_class.name.lower()} I/O was not admitted in time"
                        )
                    self._cond.wait(left)
            except BaseException:
                queue.remove(ticket)
                self._cond.notify_all()  # a new head may now be able to go
                raise

    def _head(self) -> object | None:
        """The first ticket of the most urgent non-empty queue (lock held)."""
        for io_class in _ORDER:
            queue = self._queues[io_class]
            if queue:
                return queue[0]
        return None

    def _take_tokens(self, nbytes: int) -> float:
        """Take `nbytes` from the background bucket and return 0, or return the seconds to wait
        until it holds enough (lock held). Uncapped when the rate is 0."""
        if self._rate == 0:
            return 0.0
        now = self._clock()
        elapsed = max(0.0, now - self._refilled_at)
        self._tokens = min(float(self._rate), self._tokens + elapsed * self._rate)
        self._refilled_at = now
        need = min(nbytes, self._rate)
        if self._tokens + _SLACK_BYTES >= need:
            self._tokens -= nbytes
            return 0.0
        return (need - self._tokens) / self._rate
