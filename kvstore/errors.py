"""The daemon's typed errors: the same classes the SDK raises, so one mapping covers both ends."""

from __future__ import annotations

from client.contract.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    PermissionDenied,
    StrataError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "CapacityExhausted",
    "Corrupt",
    "DeadlineExceeded",
    "InvalidArgument",
    "LeaseExpired",
    "PermissionDenied",
    "StrataError",
    "Unauthenticated",
    "Unavailable",
]
