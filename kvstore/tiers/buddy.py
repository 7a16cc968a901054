"""A power-of-two buddy allocator over a byte range: the slot manager of the DRAM and GPU tiers.

The range `[0, capacity_bytes)` is covered by maximal aligned power-of-two "top" blocks (the
binary decomposition of the capacity, largest first), so a capacity that is not a power of two
wastes nothing beyond rounding down to `min_block_bytes`. A request is rounded up to the next
power-of-two multiple of `min_block_bytes`; a free block of that order is taken, or the smallest
larger one is split. Freeing coalesces a block with its buddy (`offset ^ size`) while the buddy is
free at the same order. Each order keeps its free offsets in a set, so every operation costs
O(log capacity): there is no scan over blocks.

The allocator only does arithmetic on offsets; it owns no memory and is not thread-safe (the tiers
that use it hold a lock around it).
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument

__all__ = ["BuddyAllocator"]


class BuddyAllocator:
    """Power-of-two buddy allocator over offsets in `[0, capacity_bytes)`.

    `capacity_bytes` is rounded down to a multiple of `min_block_bytes`, which must be a power of
    two. Raises InvalidArgument when the rounded capacity is zero.
    """

    __slots__ = ("_allocated", "_capacity", "_free", "_max_order", "_min_block", "_used")

    def __init__(self, capacity_bytes: int, min_block_bytes: int = 4096) -> None:
        if min_block_bytes <= 0 or min_block_bytes & (min_block_bytes - 1):
            raise InvalidArgument(f"min_block_bytes must be a power of two, got {min_block_bytes}")
        units = capacity_bytes // min_block_bytes if capacity_bytes > 0 else 0
        if units == 0:
            raise InvalidArgument(
                f"capacity {capacity_bytes} bytes is smaller than one {min_block_bytes}-byte block"
            )
        self._min_block = min_block_bytes
        self._capacity = units * min_block_bytes
        self._max_order = units.bit_length() - 1
        # _free[k]: offsets of free blocks of size min_block << k.
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        # offset -> order of every allocated block.
        self._allocated: dict[int, int] = {}
        self._used = 0
        offset = 0
        for order in range(self._max_order, -1, -1):
            if units >> order & 1:
                self._free[order].add(offset)
                offset += min_block_bytes << order

    # ---- queries -------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes: the constructor's capacity rounded down to a multiple of min_block_bytes."""
        return self._capacity

    @property
    def min_block_bytes(self) -> int:
        return self._min_block

    @property
    def max_block_bytes(self) -> int:
        """The largest block this allocator can ever hand out (its largest top block)."""
        return self._min_block << self._max_order

    @property
    def used_bytes(self) -> int:
        """Sum of the sizes of the allocated blocks (after rounding up), not of the requests."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def allocated_blocks(self) -> int:
        return len(self._allocated)

    def block_size_for(self, nbytes: int) -> int:
        """The block size a request of `nbytes` would take; raises like `allocate`. Pure."""
        return self._min_block << self._order_for(nbytes)

    def largest_free_block(self) -> int:
        """Size of the largest free block (0 when nothing is free): the largest request that fits."""
        for order in range(self._max_order, -1, -1):
            if self._free[order]:
                return self._min_block << order
        return 0

    def block_bytes(self, offset: int) -> int:
        """Size of the allocated block at `offset`; raises InvalidArgument if none is allocated there."""
        order = self._allocated.get(offset)
        if order is None:
            raise InvalidArgument(f"no allocated block at offset {offset}")
        return self._min_block << order

    # ---- mutations -----------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> int | None:
        """Allocate a block of at least `nbytes`; mutates. Returns its offset, or None if none fits.

        Raises InvalidArgument when `nbytes <= 0` or larger than `max_block_bytes` (a request that
        could never fit, as opposed to one that does not fit now).
        """
        order = self._order_for(nbytes)
        found = order
        while found <= self._max_order and not self._free[found]:
            found += 1
        if found > self._max_order:
            return None
        offset = self._free[found].pop()
        while found > order:  # split, keeping the low half and freeing the high half
            found -= 1
            self._free[found].add(offset + (self._min_block << found))
        self._allocated[offset] = order
        self._used += self._min_block << order
        return offset

    def allocate_many(self, nbytes: int, count: int) -> list[int]:
        """Allocate up to `count` blocks of at least `nbytes` each, leaving the same blocks
        allocated and free as `allocate` called that many times would (in one call); mutates.
        Returns their offsets: fewer than `count` when space runs out."""
        order = self._order_for(nbytes)
        size = self._min_block << order
        free, allocated = self._free, self._allocated
        out: list[int] = []
        while len(out) < count:
            if free[order]:
                offset = free[order].pop()
                allocated[offset] = order
                out.append(offset)
                self._used += size
                continue
            found = order + 1
            while found <= self._max_order and not free[found]:
                found += 1
            if found > self._max_order:
                break
            # carve the smallest larger block: its first units are taken, the rest is freed as
            # the aligned blocks one-by-one splitting would have left (no two free buddies)
            base = free[found].pop()
            units = 1 << (found - order)
            take = min(units, count - len(out))
            for u in range(take):
                allocated[base + u * size] = order
                out.append(base + u * size)
            self._used += take * size
            u = take
            while u < units:
                k = (u & -u).bit_length() - 1
                while u + (1 << k) > units:
                    k -= 1
                free[order + k].add(base + u * size)
                u += 1 << k
        return out

    def free(self, offset: int) -> int:
        """Free the block at `offset` and coalesce it with free buddies; mutates.

        Returns the size of the block freed. Raises InvalidArgument for an offset that is not
        the start of an allocated block (never allocated, or already freed).
        """
        order = self._allocated.pop(offset, None)
        if order is None:
            raise InvalidArgument(
                f"free of offset {offset}: no allocated block there (double free?)"
            )
        size = self._min_block << order
        self._used -= size
        while order < self._max_order:
            buddy = offset ^ (self._min_block << order)
            peers = self._free[order]
            if buddy not in peers:
                break
            peers.remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)
        return size

    def check_integrity(self) -> None:
        """Raise AssertionError unless the block map is sound. Pure; O(blocks log blocks).

        Checks: every block is aligned to its size and inside the capacity; free and allocated
        blocks are disjoint and tile `[0, capacity_bytes)` exactly; no free block has a free buddy
        of the same order (they would have been coalesced); `used_bytes` is the sum of the
        allocated blocks.
        """
        blocks: list[tuple[int, int, bool]] = []
        for order, offsets in enumerate(self._free):
            size = self._min_block << order
            for offset in offsets:
                blocks.append((offset, size, False))
                buddy = offset ^ size
                if buddy in offsets:
                    raise AssertionError(
                        f"free buddies {offset} and {buddy} of size {size} not merged"
                    )
        used = 0
        for offset, order in self._allocated.items():
            size = self._min_block << order
            blocks.append((offset, size, True))
            used += size
        if used != self._used:
            raise AssertionError(f"used_bytes {self._used} != sum of allocated blocks {used}")
        blocks.sort()
        cursor = 0
        for offset, size, allocated in blocks:
            if offset % size:
                raise AssertionError(f"block at {offset} is not aligned to its size {size}")
            if offset != cursor:
                kind = "allocated" if allocated else "free"
                raise AssertionError(
                    f"{kind} block at {offset}: expected the next block at {cursor}"
                )
            cursor = offset + size
        if cursor != self._capacity:
            raise AssertionError(f"blocks cover [0, {cursor}), capacity is {self._capacity}")

    # ---- helpers -------------------------------------------------------------------------------

    def _order_for(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"allocation size must be a positive int, got {nbytes!r}")
        units = -(-nbytes // self._min_block)
        order = (units - 1).bit_length()
        if order > self._max_order:
            raise InvalidArgument(
                f"allocation of {nbytes} bytes exceeds the largest block, {self.max_block_bytes} bytes"
            )
        return order

    def __repr__(self) -> str:
        return (
            f"BuddyAllocator(capacity_bytes={self._capacity}, used_bytes={self._used}, "
            f"blocks={len(self._allocated)})"
        )
