"""Typed errors shared by the SDK and the daemon.

A miss is a result, never an error. Only the daemon's service layer turns these into gRPC status
codes, and only the SDK turns status codes back into them (client/contract/errors.py is that one mapping).
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""

    retryable: bool = False


class InvalidArgument(StrataError):
    """The request is malformed: bad key, bad header, wrong scope or layout, too many keys."""


class CapacityExhausted(StrataError):
    """A tier is full and nothing in it can be evicted. Retry after `retry_after_s`."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float = 0.5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LeaseExpired(StrataError):
    """A lease id is unknown or has run out; the pages it covered may have moved."""


class Unavailable(StrataError):
    """The daemon cannot be reached (or is shutting down). Idempotent calls retry this."""

    retryable = True


class DeadlineExceeded(Unavailable):
    """A call did not complete within its deadline."""


class Corrupt(StrataError):
    """Bytes failed verification (bad magic, header checksum or payload checksum)."""


class Unauthenticated(StrataError):
    """The call carried no token, or one that names no principal (gRPC UNAUTHENTICATED)."""


class PermissionDenied(StrataError):
    """The caller's principal may not do this to this namespace (gRPC PERMISSION_DENIED)."""
