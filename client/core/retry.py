"""Deadlines and retries of the store clients: which calls are retried, after how long, and
when to give up (DESIGN §6, STYLE: every call has a deadline; only idempotent calls retry).

Pure: the clock is read, nothing else. `retried` runs one call's attempts as a plan
(client/core/steps.py): it yields a `Pause` before each retry, so the blocking and the asyncio
shells sleep their own way.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import Message

from client.contract.errors import CapacityExhausted, DeadlineExceeded, StrataError
from client.core.requests import malformed
from client.core.steps import Call, M, Pause, Plan, R

log = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 0.5
RETRY_AFTER_KEY = "retry-after-ms"
RETRY_AFTER_S_KEY = "x-strata-retry-after"  # the same hint in seconds


# Calls that may be repeated without changing the outcome. Put, Reserve and Commit are not.
IDEMPOTENT_METHODS = frozenset(
    {"NodeInfo", "Lookup", "Get", "Acquire", "Release", "Renew", "Delete", "Stats"}
)


def retry_after_s(trailing: Iterable[tuple[str, str | bytes]] | None) -> float:
    """The server's retry hint from trailing metadata, in seconds (default 0.5 s):
    `x-strata-retry-after` (seconds) or `retry-after-ms`."""
    for key, value in trailing or ():
        scale = {RETRY_AFTER_KEY: 1000.0, RETRY_AFTER_S_KEY: 1.0}.get(key.lower())
        if scale is None:
            continue
        text = value.decode() if isinstance(value, bytes) else value
        try:
            hint = float(text)
        except ValueError:
            break
        if hint >= 0:
            return hint / scale
        break
    return DEFAULT_RETRY_AFTER_S


class Deadline:
    """The one deadline of a client call, shared by all its attempts."""

    __slots__ = ("_end",)

    def __init__(self, timeout_s: float) -> None:
        self._end = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        return max(0.0, self._end - time.monotonic())


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Jittered exponential backoff for idempotent calls; a server's retry hint wins if longer."""

    retries: int
    base_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def attempts_for(self, method: str) -> int:
        return 1 + (self.retries if method in IDEMPOTENT_METHODS else 0)

    def delay_s(self, attempt: int, error: StrataError, deadline: Deadline) -> float | None:
        """Seconds to wait before retrying after failed attempt `attempt` (0-based), or None
        to give up: the error is not retryable, or the wait would pass the deadline."""
        if not error.retryable or isinstance(error, DeadlineExceeded):
            return None
        ceiling = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        delay = random.uniform(ceiling / 2, ceiling)
        if isinstance(error, CapacityExhausted):
            delay = max(delay, error.retry_after_s)
        if delay >= deadline.remaining_s():
            return None
        return delay


def retried(
    method: str,
    policy: RetryPolicy,
    timeout_s: float,
    attempt: Callable[[float], Plan[R]],
    *,
    first: int = 0,
) -> Plan[R]:
    """Run the plan `attempt(timeout_s_left)` until it succeeds, within one deadline of
    `timeout_s`: a typed error is retried (after a `Pause`) when the method is idempotent, the
    error retryable and the wait inside the deadline; otherwise it is raised. `first`: how many
    attempts were made already (the backoff goes on from there)."""
    deadline = Deadline(timeout_s)
    attempts = policy.attempts_for(method)
    for n in range(first, attempts):
        try:
            return (yield from attempt(max(deadline.remaining_s(), 0.001)))
        except StrataError as error:
            delay = policy.delay_s(n, error, deadline) if n + 1 < attempts else None
            if delay is None:
                raise
            log.debug("%s failed (%s); retrying in %.3f s", method, error, delay)
            yield Pause(delay)
    raise AssertionError("unreachable")


def call(
    method: str, request: Message, reply_type: type[M], policy: RetryPolicy, timeout_s: float
) -> Plan[M]:
    """The unary control call `method`, retried as `retried` says; its reply, checked to be a
    `reply_type` (a malformed-reply StrataError, never retried, otherwise).

    The first attempt is yielded from here directly (one generator level, no deadline object:
    the common case of a control call on the hot path); only a failure goes on to `retried`,
    with what is left of the same deadline."""
    started = time.monotonic()
    try:
        reply = yield Call(method, request, timeout_s)
    except StrataError as error:
        if policy.attempts_for(method) < 2:
            raise
        reply = yield from _after_first_failure(
            method, request, policy, timeout_s - (time.monotonic() - started), error
        )
    if not isinstance(reply, reply_type):
        raise malformed(f"{method} answered {type(reply).__name__}")
    return reply


def _after_first_failure(
    method: str, request: Message, policy: RetryPolicy, left_s: float, error: StrataError
) -> Plan[object]:
    """The attempts of `call` after its first one failed with `error`, within `left_s`."""
    deadline = Deadline(left_s)
    delay = policy.delay_s(0, error, deadline)
    if delay is None:
        raise error
    log.debug("%s failed (%s); retrying in %.3f s", method, error, delay)
    yield Pause(delay)

    def attempt(timeout: float) -> Plan[object]:
        return (yield Call(method, request, timeout))

    return (yield from retried(method, policy, deadline.remaining_s(), attempt, first=1))
