"""`InFlight`: counts a worker's requests in flight, so it can stop taking new ones and wait
(bounded) for the rest to finish — what SIGTERM asks of every worker."""

from __future__ import annotations

import threading
import time

from engine.errors import EngineStopping


class InFlight:
    """A gate and a counter. `enter()` admits a request (EngineStopping once `close()` was
    called), `exit()` marks it done, `wait_idle(timeout)` waits for the count to reach zero."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._count = 0
        self._closed = False

    @property
    def count(self) -> int:
        with self._cond:
            return self._count

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def enter(self) -> None:
        with self._cond:
            if self._closed:
                raise EngineStopping(f"the {self.name} worker is stopping")
            self._count += 1

    def exit(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def close(self) -> int:
        """Take no new requests; returns how many are in flight now."""
        with self._cond:
            self._closed = True
            return self._count

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until nothing is in flight; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True
