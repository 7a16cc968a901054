"""Small value types the daemon's layers share: tiers and I/O classes.

Their integer values equal the wire enums in proto/kvstore_pb/store.proto, so the service layer
converts by value. Page keys themselves are opaque 16-byte `bytes` (DESIGN §3).
"""

from __future__ import annotations

import enum

from client.contract.scope import KEY_BYTES
from kvstore.errors import InvalidArgument

__all__ = ["KEY_BYTES", "IoClass", "Tier", "io_class_from_wire", "tier_from_wire"]


class Tier(enum.IntEnum):
    """Storage tiers, fastest first."""

    GPU = 1
    DRAM = 2
    SSD = 3


class IoClass(enum.IntEnum):
    """I/O classes, served in this order; background is also capped in bytes per second."""

    CRITICAL = 1
    NORMAL = 2
    BACKGROUND = 3


def io_class_from_wire(value: int) -> IoClass:
    """The I/O class a request names (0, unspecified, is NORMAL); InvalidArgument if unknown."""
    if value == 0:
        return IoClass.NORMAL
    try:
        return IoClass(value)
    except ValueError:
        raise InvalidArgument(f"unknown I/O class {value}") from None


def tier_from_wire(value: int) -> Tier | None:
    """The tier a request names (0, unspecified, is None); InvalidArgument if unknown."""
    if value == 0:
        return None
    try:
        return Tier(value)
    except ValueError:
        raise InvalidArgument(f"unknown tier {value}") from None
