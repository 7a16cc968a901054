"""Small value types the daemon's layers share: tiers and I/O classes.

Their integer values equal the wire enums in proto/kvstore_pb/store.proto, so the service layer
converts by value. Page keys themselves are opaque 16-byte `bytes` (DESIGN §3).
"""

from __future__ import annotations

import enum

from client.scope import KEY_BYTES

__all__ = ["KEY_BYTES", "IoClass", "Tier"]


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
