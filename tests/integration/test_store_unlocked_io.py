"""No disk I/O under the store lock (DESIGN §5; kvstore/store.py): demotion writes when DRAM is
full, puts placed on SSD, SSD reads, RocksDB deletes and segment compaction all run with the
store lock free, so a slow disk never stalls lookups and DRAM gets."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from conftest import (
    PAGE_BYTES,
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    keys_of,
    read_back,
    singles,
)

from client import Scope, Tier
from kvstore.tiers.faults import SsdFaults

pytestmark = pytest.mark.integration

NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}
DRAM_PAGES = (1 << 20) // PAGE_BYTES


def watch_disk_io(d: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every SSD tier disk operation made while the calling thread holds the store
    lock (the list stays empty when the rule holds)."""
    ssd = d.store.tiers.ssd
    assert ssd is not None
    lock = d.store._lock
    bad: list[str] = []

    def guard(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object, **kwargs: object) -> object:
            if lock._is_owned():  # type: ignore[attr-defined]
                bad.append(name)
            return fn(*args, **kwargs)

        return wrapped

    files = ssd._files
    for name in ("append", "read_into", "sync"):
        monkeypatch.setattr(files, name, guard(name, getattr(files, name)))
    for name in ("_delete_keys", "_compact_some", "_compact_sparse"):
        if hasattr(ssd, name):
            monkeypatch.setattr(ssd, name, guard(name, getattr(ssd, name)))
    return bad


def test_no_disk_io_under_the_store_lock(
    daemon_factory: DaemonFactory, scope: Scope, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon_factory(dram="1MiB", settings=NO_WATERMARKS)
    bad = watch_disk_io(d, monkeypatch)
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    pages = singles(scope, DRAM_PAGES * 2, seed=1)
    for i in range(0, len(pages), 16):  # past a full DRAM: every put demotes pages to SSD
        assert shm.put(scope, pages[i : i + 16]).stored == 16
    placed = singles(scope, 4, seed=2)
    assert rpc.put(scope, placed, tier=Tier.SSD).stored == 4  # placed on SSD before it returns
    assert all(d.tier_of(k) == (Tier.SSD,) for k in keys_of(placed))
    for i in range(0, DRAM_PAGES, 16):  # SSD hits promoted (reads), demoting others (writes)
        assert_intact(shm, scope, pages[i : i + 16])
    assert shm.delete(keys=keys_of(pages[: DRAM_PAGES // 2])) == DRAM_PAGES // 2
    d.store.drain()  # the mover's pass: tombstones and a compaction step, also unlocked
    assert bad == [], f"disk I/O under the store lock: {sorted(set(bad))}"
    assert d.store.tiers.ssd is not None and not d.store.tiers.ssd._tombstones
    d.check()


def test_a_slow_disk_write_does_not_stall_lookups_and_dram_gets(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """A put that must demote a page to a disk that hangs: meanwhile, other calls are served
    (ordered by events, not timed: were the lock held, the lookup would wait for the disk)."""
    d = daemon_factory(dram="1MiB", settings=NO_WATERMARKS)
    shm = d.client(shared_memory=True)
    resident = singles(scope, DRAM_PAGES, seed=3)
    for i in range(0, len(resident), 16):
        shm.put(scope, resident[i : i + 16])
    ssd = d.store.tiers.ssd
    assert ssd is not None
    writing, release = threading.Event(), threading.Event()

    class HangingDisk(SsdFaults):
        def before_write(self, what: str) -> None:
            writing.set()
            assert release.wait(30), "the test never let the disk go"

    ssd.faults = HangingDisk()
    more = singles(scope, 1, seed=4)
    result: list[object] = []
    writer = threading.Thread(target=lambda: result.append(shm.put(scope, more)))
    writer.start()
    try:
        assert writing.wait(30), "the put did not reach the disk"
        other = d.client(shared_memory=True, timeout_s=5.0, retries=0)
        hot = resident[-8:]  # the newest pages: still in DRAM
        assert other.lookup(scope, keys_of(hot)).hit_count == 8
        assert read_back(other, scope, hot) == [bytes(p.payload) for p in hot]
        assert other.stats().pages >= DRAM_PAGES
    finally:
        release.set()
        writer.join(30)
    assert not writer.is_alive()
    ssd.faults = SsdFaults()
    assert_intact(shm, scope, more)
    d.check()


@pytest.mark.parametrize("path", ["put", "get"])
def test_room_taken_by_another_call_meanwhile_is_made_again(
    daemon_factory: DaemonFactory, scope: Scope, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A call makes DRAM room with the store lock free (the pages that must go are written to
    SSD first); another call may take that room before it allocates. It must then make room
    again, not fail the put (CapacityExhausted) or report an SSD hit as a miss."""
    d = daemon_factory(dram="1MiB", settings=NO_WATERMARKS)
    client = d.client(shared_memory=True)
    dram = d.store.tiers.dram
    old = singles(scope, 8, seed=40)
    client.put(scope, old)
    for round_ in range(4):  # push `old` out to SSD: DRAM full of other pages (all only there)
        filler = singles(scope, DRAM_PAGES, seed=41 + round_)
        for i in range(0, len(filler), 8):
            client.put(scope, filler[i : i + 8])
        if all(d.tier_of(p.header.key) == (Tier.SSD,) for p in old):
            break
    assert all(d.tier_of(p.header.key) == (Tier.SSD,) for p in old)
    plan = d.store.tiers.plan_dram_room
    stolen: list[int] = []

    def plan_then_steal(page_bytes: int, count: int = 1) -> list:
        victims = plan(page_bytes, count)
        if not victims and not stolen:  # room made: another call takes it at once
            while (slot := dram.allocate(PAGE_BYTES)) is not None:
                stolen.append(slot)
            assert stolen
        return victims

    monkeypatch.setattr(d.store.tiers, "plan_dram_room", plan_then_steal)
    if path == "put":
        new = singles(scope, 1, seed=50)
        assert client.put(scope, new).stored == 1
        got = read_back(client, scope, new)
        assert got == [bytes(new[0].payload)]
    else:
        assert read_back(client, scope, old[:1]) == [bytes(old[0].payload)]
    assert stolen
    monkeypatch.undo()
    for slot in stolen:
        dram.free(slot)
    d.check()
