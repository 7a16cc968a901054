"""The daemon's storage tiers (DESIGN §5): GPU slab, shared-memory DRAM slab, RocksDB on SSD.

Tiers store bytes at offsets or under keys; they know nothing of leases, residency or eviction
(the index, policy and mover above them decide). `GpuTier` is not imported here, so importing
this package never pulls in torch: import it from `kvstore.tiers.gpu`.
"""

from __future__ import annotations

from kvstore.tiers.buddy import BuddyAllocator
from kvstore.tiers.dram import DramTier, segment_path
from kvstore.tiers.ssd import ScanResult, SsdTier

__all__ = ["BuddyAllocator", "DramTier", "ScanResult", "SsdTier", "segment_path"]
