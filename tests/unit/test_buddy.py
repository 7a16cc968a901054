"""BuddyAllocator: random allocate/free sequences against a model, plus the edge cases."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvstore.errors import InvalidArgument
from kvstore.tiers.buddy import BuddyAllocator

pytestmark = pytest.mark.unit

MIN = 4096


class BuddyMachine(RuleBasedStateMachine):
    """The model: a dict offset -> block size of what is allocated."""

    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BuddyAllocator(MIN, MIN)
        self.live: dict[int, int] = {}

    @initialize(units=st.integers(min_value=1, max_value=200), min_shift=st.sampled_from([0, 3]))
    def setup(self, units: int, min_shift: int) -> None:
        min_block = MIN >> min_shift
        self.alloc = BuddyAllocator(units * min_block + min_block // 2, min_block)
        assert self.alloc.capacity_bytes == units * min_block

    @rule(target=blocks, nbytes=st.integers(min_value=1, max_value=300 * MIN))
    def allocate(self, nbytes: int) -> int:
        if nbytes > self.alloc.max_block_bytes:
            with pytest.raises(InvalidArgument):
                self.alloc.allocate(nbytes)
            return -1
        want = self.alloc.block_size_for(nbytes)
        assert want >= nbytes and want & (want - 1) == 0
        largest = self.alloc.largest_free_block()
        offset = self.alloc.allocate(nbytes)
        if offset is None:
            assert largest < want, f"{want} bytes fit in the free {largest}-byte block"
            return -1
        assert largest >= want
        assert offset % want == 0
        assert offset >= 0 and offset + want <= self.alloc.capacity_bytes
        assert offset not in self.live
        assert self.alloc.block_bytes(offset) == want
        self.live[offset] = want
        return offset

    @rule(offset=consumes(blocks))
    def free(self, offset: int) -> None:
        if offset < 0:
            return
        size = self.live.pop(offset)
        assert self.alloc.free(offset) == size
        with pytest.raises(InvalidArgument):
            self.alloc.free(offset)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_integrity()
        assert self.alloc.used_bytes == sum(self.live.values())
        assert self.alloc.allocated_blocks == len(self.live)
        end = 0
        for offset in sorted(self.live):
            assert offset >= end, "allocated blocks overlap"
            end = offset + self.live[offset]
        if not self.live:
            # Everything free again: fully coalesced into the top blocks.
            assert self.alloc.largest_free_block() == self.alloc.max_block_bytes


TestBuddyStateful = BuddyMachine.TestCase
TestBuddyStateful.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_full_capacity_then_everything_coalesces() -> None:
    alloc = BuddyAllocator(1 << 20, MIN)
    offsets = [alloc.allocate(MIN) for _ in range(256)]
    assert None not in offsets
    assert sorted(o for o in offsets if o is not None) == [i * MIN for i in range(256)]
    assert alloc.used_bytes == 1 << 20
    assert alloc.largest_free_block() == 0
    assert alloc.allocate(1) is None
    alloc.check_integrity()
    for offset in offsets:
        assert offset is not None
        assert alloc.free(offset) == MIN
    assert alloc.used_bytes == 0
    assert alloc.largest_free_block() == 1 << 20
    assert alloc.allocate(1 << 20) == 0
    alloc.check_integrity()


def test_capacity_not_a_power_of_two_is_covered_by_top_blocks() -> None:
    alloc = BuddyAllocator(7 * MIN, MIN)  # top blocks: 4, 2 and 1 units
    assert alloc.capacity_bytes == 7 * MIN
    assert alloc.max_block_bytes == 4 * MIN
    assert alloc.largest_free_block() == 4 * MIN
    with pytest.raises(InvalidArgument):
        alloc.allocate(4 * MIN + 1)
    offsets = {alloc.allocate(MIN) for _ in range(7)}
    assert offsets == {i * MIN for i in range(7)}
    assert alloc.allocate(MIN) is None
    assert alloc.used_bytes == 7 * MIN
    alloc.check_integrity()
    for offset in offsets:
        assert offset is not None
        alloc.free(offset)
    alloc.check_integrity()
    # The tail blocks never merge past the capacity: sizes 4, 2, 1 units again.
    assert [alloc.allocate(4 * MIN), alloc.allocate(2 * MIN), alloc.allocate(MIN)] == [
        0,
        4 * MIN,
        6 * MIN,
    ]


def test_capacity_rounds_down_to_min_block() -> None:
    alloc = BuddyAllocator(10_000, MIN)
    assert alloc.capacity_bytes == 2 * MIN
    alloc.check_integrity()


def test_requests_round_up_to_power_of_two_blocks() -> None:
    alloc = BuddyAllocator(1 << 20, MIN)
    offset = alloc.allocate(MIN + 1)
    assert offset == 0
    assert alloc.block_bytes(0) == 2 * MIN
    assert alloc.used_bytes == 2 * MIN
    third = alloc.allocate(3 * MIN)
    assert third is not None and alloc.block_bytes(third) == 4 * MIN
    assert alloc.used_bytes == 6 * MIN


def test_fragmentation_refuses_a_larger_block_until_buddies_free() -> None:
    alloc = BuddyAllocator(8 * MIN, MIN)
    offsets = [alloc.allocate(MIN) for _ in range(8)]
    for offset in offsets[::2]:
        assert offset is not None
        alloc.free(offset)
    assert alloc.free_bytes == 4 * MIN
    assert alloc.largest_free_block() == MIN
    assert alloc.allocate(2 * MIN) is None
    alloc.check_integrity()
    for offset in offsets[1::2]:
        assert offset is not None
        alloc.free(offset)
    assert alloc.largest_free_block() == 8 * MIN
    alloc.check_integrity()


def test_errors() -> None:
    alloc = BuddyAllocator(64 * MIN, MIN)
    for bad in (0, -1):
        with pytest.raises(InvalidArgument):
            alloc.allocate(bad)
    with pytest.raises(InvalidArgument):
        alloc.allocate(64 * MIN + 1)
    with pytest.raises(InvalidArgument):
        alloc.free(0)
    offset = alloc.allocate(MIN)
    assert offset == 0
    with pytest.raises(InvalidArgument):
        alloc.free(MIN // 2)  # inside a block, not its start
    assert alloc.free(0) == MIN
    with pytest.raises(InvalidArgument):
        alloc.free(0)
    with pytest.raises(InvalidArgument):
        alloc.block_bytes(0)
    with pytest.raises(InvalidArgument):
        BuddyAllocator(1 << 20, 3000)
    with pytest.raises(InvalidArgument):
        BuddyAllocator(MIN - 1, MIN)
    assert alloc.used_bytes == 0


def test_check_integrity_catches_a_broken_map() -> None:
    alloc = BuddyAllocator(8 * MIN, MIN)
    offset = alloc.allocate(MIN)
    assert offset is not None
    alloc._used += 1  # white box: break the accounting
    with pytest.raises(AssertionError, match="used_bytes"):
        alloc.check_integrity()


def test_allocate_many_matches_allocating_one_by_one() -> None:
    one, many = BuddyAllocator(1 << 20, MIN), BuddyAllocator(1 << 20, MIN)
    for alloc in (one, many):
        held = [alloc.allocate(3 * MIN) for _ in range(5)]  # leaves split blocks behind
        alloc.free(held[1])  # type: ignore[arg-type]
        alloc.free(held[3])  # type: ignore[arg-type]
    singles = [one.allocate(2 * MIN) for _ in range(40)]
    batch = many.allocate_many(2 * MIN, 40)
    assert sorted(batch) == sorted(o for o in singles if o is not None)
    assert many.used_bytes == one.used_bytes
    assert many._free == one._free  # the same free blocks left behind
    many.check_integrity()
    for n in (1, 3, 8, 100):  # carving larger blocks, across several of them
        a, b = BuddyAllocator(1 << 20, MIN), BuddyAllocator(1 << 20, MIN)
        seq = [a.allocate(MIN) for _ in range(n)]
        assert sorted(b.allocate_many(MIN, n)) == sorted(o for o in seq if o is not None)
        assert (a._free, a.used_bytes) == (b._free, b.used_bytes)
        b.check_integrity()


def test_allocate_many_stops_when_full() -> None:
    alloc = BuddyAllocator(1 << 20, MIN)
    got = alloc.allocate_many(64 * MIN, 20)
    assert len(got) == 4 and len(set(got)) == 4  # 1 MiB holds four 256 KiB blocks
    assert alloc.allocate_many(MIN, 3) == []
    alloc.check_integrity()
    with pytest.raises(InvalidArgument):
        alloc.allocate_many(0, 2)
