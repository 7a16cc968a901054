"""DramTier: slots in a /dev/shm segment that a second mapping (a client) sees."""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tiers.dram import DramTier, segment_path

pytestmark = pytest.mark.unit

CAPACITY = 1 << 20


def _name() -> str:
    return f"strata-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def name() -> Iterator[str]:
    segment = _name()
    yield segment
    segment_path(segment).unlink(missing_ok=True)


@pytest.fixture
def tier(name: str) -> Iterator[DramTier]:
    t = DramTier(CAPACITY, name)
    yield t
    t.close()


def test_segment_is_created_with_the_capacity(tier: DramTier, name: str) -> None:
    path = Path("/dev/shm") / name
    assert tier.path == path
    assert tier.segment_name == name
    st = os.stat(path)
    # the slots, then one 8-byte generation counter per 4 KiB granule, rounded to 4 KiB
    assert tier.capacity_bytes == CAPACITY == tier.generations_offset
    assert st.st_size == tier.size_bytes == CAPACITY + 4096 * -(-(CAPACITY // 4096 * 8) // 4096)
    assert st.st_mode & 0o777 == 0o600
    assert tier.used_bytes == 0


def test_freeing_a_slot_advances_its_generation_in_the_segment(tier: DramTier, name: str) -> None:
    """The read fence: a same-host reader that sees the generation it was given after its copy
    knows the slot was not freed (nor reused) meanwhile."""
    offset = tier.allocate(16384)
    assert offset is not None
    before = tier.generation(offset)
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        client = mmap.mmap(fd, tier.size_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    try:
        table = memoryview(client)[tier.generations_offset :].cast("Q")
        i = offset // tier.generation_granule_bytes
        assert table[i] == before
        tier.free(offset)
        assert tier.generation(offset) == table[i] == before + 1
        again = tier.allocate(4096)  # a smaller slot at the same place: still a new generation
        assert again == offset and tier.generation(again) == before + 1
        with pytest.raises(InvalidArgument):
            tier.view(tier.capacity_bytes - 8, 16)  # the table is not slot space
        table.release()
    finally:
        client.close()


def test_write_through_a_view_and_read_back(tier: DramTier) -> None:
    payload = os.urandom(10_000)
    offset = tier.allocate(len(payload))
    assert offset is not None
    assert tier.used_bytes == tier.slot_bytes(offset) == 16384
    with tier.view(offset, len(payload)) as view:
        assert not view.readonly
        view[:] = payload
    with tier.view(offset, len(payload)) as again:
        assert bytes(again) == payload
    # Views are zero-copy: two views of one range see each other's writes.
    a = tier.view(offset, 4)
    b = tier.view(offset, 4)
    a[:] = b"ABCD"
    assert bytes(b) == b"ABCD"
    a.release()
    b.release()


def test_a_second_mapping_sees_the_bytes(tier: DramTier, name: str) -> None:
    payload = os.urandom(65536)
    offset = tier.allocate(len(payload))
    assert offset is not None
    with tier.view(offset, len(payload)) as view:
        view[:] = payload
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        client = mmap.mmap(fd, tier.size_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    try:
        assert client[offset : offset + len(payload)] == payload
        # And the other way round: a client writing into a reserved slot.
        other = tier.allocate(100)
        assert other is not None and other != offset
        client[other : other + 5] = b"hello"
        with tier.view(other, 5) as view:
            assert bytes(view) == b"hello"
    finally:
        client.close()


def test_stale_segment_is_replaced(name: str, caplog: pytest.LogCaptureFixture) -> None:
    path = segment_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"stale bytes from a crashed daemon")
    os.close(fd)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.dram"):
        tier = DramTier(CAPACITY, name)
    try:
        assert any("stale" in r.getMessage() for r in caplog.records)
        assert os.stat(path).st_size == tier.size_bytes
        with tier.view(0, 11) as view:
            assert bytes(view) == bytes(11)  # a fresh, zeroed segment, not the stale bytes
    finally:
        tier.close()
    assert not path.exists()


def test_close_unlinks_and_is_idempotent(name: str) -> None:
    tier = DramTier(CAPACITY, name)
    path = tier.path
    assert path.exists()
    tier.close()
    assert not path.exists()
    assert tier.closed
    tier.close()
    with pytest.raises(Unavailable):
        tier.allocate(10)
    with pytest.raises(Unavailable):
        tier.view(0, 10)


def test_close_without_unlink_keeps_the_file(name: str) -> None:
    tier = DramTier(CAPACITY, name)
    tier.close(unlink=False)
    assert os.stat(segment_path(name)).st_size == tier.size_bytes


def test_close_with_live_views_does_not_raise(name: str) -> None:
    tier = DramTier(CAPACITY, name)
    offset = tier.allocate(4096)
    assert offset is not None
    view = tier.view(offset, 4096)
    view[:3] = b"xyz"
    tier.close()  # must not raise BufferError
    assert not tier.path.exists()
    assert bytes(view[:3]) == b"xyz"  # the mapping lives as long as the view
    view.release()


def test_full_tier_returns_none_until_a_slot_is_freed(tier: DramTier) -> None:
    slot = 64 << 10
    offsets = [tier.allocate(slot) for _ in range(CAPACITY // slot)]
    assert None not in offsets
    assert tier.used_bytes == CAPACITY
    assert tier.largest_free_slot() == 0
    assert tier.allocate(slot) is None
    assert tier.allocate(1) is None
    first = offsets[0]
    assert first is not None
    assert tier.free(first) == slot
    assert tier.allocate(slot) == first
    tier.check_integrity()


def test_errors(tier: DramTier) -> None:
    with pytest.raises(InvalidArgument):
        tier.allocate(0)
    with pytest.raises(InvalidArgument):
        tier.allocate(CAPACITY + 1)
    with pytest.raises(InvalidArgument):
        tier.view(CAPACITY - 10, 11)
    with pytest.raises(InvalidArgument):
        tier.view(-1, 1)
    with pytest.raises(InvalidArgument):
        tier.free(0)
    with pytest.raises(InvalidArgument):
        DramTier(CAPACITY, "a/b")
    assert tier.used_bytes == 0


def test_segments_of_daemons_that_are_gone_are_reclaimed(tmp_path: Path) -> None:
    import subprocess
    import sys

    from kvstore.tiers.dram import ephemeral_segment_name, reclaim_ephemeral_segments

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    names = {
        f"strata-{gone.pid}-0123abcd": False,  # its process is gone: removed
        ephemeral_segment_name(): True,  # this process: kept
        "strata-7700": True,  # a named segment (a daemon on a fixed port): never touched
        f"strata-{gone.pid}-not-hex!": True,
        "other": True,
    }
    # a daemon in another PID namespace: its pid looks gone from here, but it holds the flock
    held = f"strata-{gone.pid}-0badcafe"
    names[held] = True
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    import fcntl

    fd = os.open(tmp_path / held, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert reclaim_ephemeral_segments(tmp_path) == 1
        assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}
    finally:
        os.close(fd)
    assert reclaim_ephemeral_segments(tmp_path) == 1  # the lock is gone: now it is stale
    assert held not in {p.name for p in tmp_path.iterdir()}


def test_a_segment_held_by_a_running_daemon_is_not_replaced(tier: DramTier, name: str) -> None:
    """Start-up never unlinks a live daemon's segment that happens to have the same name."""
    offset = tier.allocate(4096)
    assert offset is not None
    with tier.view(offset, 4) as view:
        view[:] = b"live"
    with pytest.raises(Unavailable, match="in use"):
        DramTier(CAPACITY, name)
    with tier.view(offset, 4) as view:
        assert bytes(view) == b"live"
    assert tier.path.exists()
