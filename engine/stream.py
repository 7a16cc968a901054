"""`TokenStream`: the events of one decode request, handed from the scheduler thread to the
caller as they are produced."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from engine.requests import DecodeResult, DecodeStats, FinishReason, TokenEvent

_END = object()


class TokenStream:
    """Iterate it for the events (blocking), in order; the last has `finish_reason` set. A
    request that failed inside the worker raises its error from the iterator. `cancel()` asks
    the worker to stop the request at its next step (its pages are freed; it ends CANCELLED).
    One consumer; the producer is the worker."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._closed = False

    # ---- consumer side ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, TokenEvent)
            yield item
            if item.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Ask the worker to end the request (idempotent; a finished request stays finished)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def result(self) -> DecodeResult:
        """Wait for the whole stream and collect it (raises what the iterator raises)."""
        tokens: list[int] = []
        times: list[float] = []
        text: list[str] = []
        last: TokenEvent | None = None
        for event in self:
            if event.token_id is not None:
                tokens.append(event.token_id)
                times.append(event.time_s)
            text.append(event.text)
            last = event
        if last is None or last.finish_reason is None:
            raise RuntimeError("the stream ended without a finish reason")
        return DecodeResult(
            request_id=self.request_id,
            token_ids=tuple(tokens),
            text="".join(text),
            finish_reason=last.finish_reason,
            stats=last.stats or DecodeStats(),
            token_times_s=tuple(times),
        )

    # ---- producer side ---------------------------------------------------------------------

    def put(self, event: TokenEvent) -> None:
        """Hand an event over; a last event (one with a finish reason) closes the stream."""
        if self._closed:
            return
        self._events.put(event)
        if event.finish_reason is not None:
            self._closed = True

    def finish_now(self, index: int, reason: FinishReason, stats: DecodeStats) -> None:
        """Close the stream with a last event that carries no token."""
        self.put(TokenEvent(index, None, "", reason, stats, time.monotonic()))

    def fail(self, error: BaseException) -> None:
        """Close the stream with an error its consumer will raise."""
        if not self._closed:
            self._closed = True
            self._events.put(error)
