"""Buddy-allocated slots of one tier's byte range: the part the DRAM and GPU tiers share.

A tier subclasses `SlotSpace` and adds the bytes themselves (a shared-memory map, a device slab);
`_ensure_open` is its hook to refuse allocation after close. Allocation is thread-safe.
"""

from __future__ import annotations

import threading

from kvstore.tiers.buddy import BuddyAllocator


class SlotSpace:
    """`capacity_bytes` of offsets carved into power-of-two slots by a buddy allocator."""

    def __init__(self, capacity_bytes: int, min_block_bytes: int = 4096) -> None:
        self._alloc = BuddyAllocator(capacity_bytes, min_block_bytes)
        self._lock = threading.Lock()

    def _ensure_open(self) -> None:
        """Raise Unavailable once the tier is closed (subclasses override)."""

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated slots (requests rounded up to powers of two)."""
        return self._alloc.used_bytes

    @property
    def allocated_blocks(self) -> int:
        """Number of slots currently allocated."""
        return self._alloc.allocated_blocks

    def slot_bytes_for(self, nbytes: int) -> int:
        """Slot size a request of `nbytes` takes; raises InvalidArgument like `allocate`. Pure."""
        return self._alloc.block_size_for(nbytes)

    def largest_free_slot(self) -> int:
        """The largest request `allocate` could satisfy right now (0 when full)."""
        with self._lock:
            return self._alloc.largest_free_block()

    def slot_bytes(self, offset: int) -> int:
        """Size of the allocated slot at `offset`; raises InvalidArgument if there is none."""
        with self._lock:
            return self._alloc.block_bytes(offset)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the slot map is sound (see BuddyAllocator.check_integrity)."""
        with self._lock:
            self._alloc.check_integrity()

    def allocate(self, nbytes: int) -> int | None:
        """Reserve a slot of at least `nbytes`; mutates. Returns its offset, or None when full.

        Raises InvalidArgument for `nbytes <= 0` or larger than the largest slot; Unavailable
        after close. The slot's previous contents are not cleared.
        """
        self._ensure_open()
        with self._lock:
            return self._alloc.allocate(nbytes)

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        """Reserve up to `count` slots of at least `nbytes` under one lock; mutates. Returns
        their offsets, fewer than `count` when the tier is full. Raises as `allocate`."""
        self._ensure_open()
        with self._lock:
            return self._alloc.allocate_many(nbytes, count)

    def free(self, offset: int) -> int:
        """Release the slot at `offset`; mutates. Returns the slot size.

        Raises InvalidArgument for an offset that is not an allocated slot (or a double free).
        """
        with self._lock:
            return self._alloc.free(offset)
