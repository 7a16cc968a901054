"""The store under SSD faults: an I/O error on an SSD read (not a checksum failure) releases every
pin and slot it took, is counted, answers as a miss, and leaves the store consistent; a page
whose read failed is still there when the disk recovers. Faults come from the SSD tier's test
hook (kvstore/tiers/faults.py) and from a real failing file (a segment file replaced by a
directory: reads fail with EISDIR, even as root)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import (
    PAGE_BYTES,
    Clients,
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    keys_of,
    payload_for,
    read_back,
    singles,
    tokens_of,
)

import kvstore.store as store_module
from client import Page, PutStatus, Scope, StoreClient
from kvstore.tiers.faults import SsdFaults

pytestmark = pytest.mark.integration

NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}


def on_ssd_only(d: RunningDaemon, client: StoreClient, scope: Scope, count: int) -> list:
    """Put `count` pages, then push them all out of DRAM to SSD (by filling DRAM with others)."""
    pages = singles(scope, count, seed=5)
    assert client.put(scope, pages).statuses == (PutStatus.STORED,) * count
    for round_ in range(4):  # a page pinned for a moment (the mover checks puts) stays: again
        filler = singles(scope, 64, seed=6 + round_)
        for i in range(0, len(filler), 8):
            client.put(scope, filler[i : i + 8])
        d.store.drain()
        if all(d.tier_of(p.header.key) == (3,) for p in pages):
            return pages
    raise AssertionError("pages should be on SSD only")


@pytest.fixture
def small(daemon_factory: DaemonFactory) -> RunningDaemon:
    return daemon_factory(dram="1MiB", settings=NO_WATERMARKS)


@pytest.mark.parametrize("path", ["shm", "grpc"])
def test_ssd_read_error_is_a_miss_and_leaks_nothing(
    small: RunningDaemon, scope: Scope, path: str
) -> None:
    clients = Clients(small.client(shared_memory=True), small.client(shared_memory=False))
    client = clients.by_path(path)
    pages = on_ssd_only(small, client, scope, 4)
    ssd = small.store.tiers.ssd
    assert ssd is not None
    before = small.store.counters.ssd_read_errors
    ssd.faults = SsdFaults(read_error_rate=1.0)
    for _ in range(3):  # every retry would leak again if the first one did
        assert read_back(client, scope, pages) == [None] * 4
        small.check()
    assert small.store.counters.ssd_read_errors - before >= 4
    assert small.store.stats().active_leases == 0
    with small.store._lock:
        assert all(small.store.index.get(p.header.key).leases == 0 for p in pages)
    # the pages are still there, and come back once the disk does
    ssd.faults = SsdFaults()
    assert_intact(client, scope, pages)
    small.check()
    # a delete really removes them (the bug: a pin leaked by the failed read kept them forever)
    assert client.delete(keys=[p.header.key for p in pages]) == 4
    assert all(small.tier_of(p.header.key) == () for p in pages)
    small.check()


def test_partial_read_errors_serve_the_rest(small: RunningDaemon, scope: Scope) -> None:
    client = small.client(shared_memory=True)
    pages = on_ssd_only(small, client, scope, 8)
    ssd = small.store.tiers.ssd
    assert ssd is not None
    ssd.faults = SsdFaults(read_error_rate=0.5, seed=3)
    got = read_back(client, scope, pages)
    served = [g for g in got if g is not None]
    assert 0 < len(served) < 8
    for g, p in zip(got, pages, strict=True):
        assert g is None or g == bytes(p.payload)
    small.check()
    ssd.faults = SsdFaults()
    assert_intact(client, scope, pages)
    small.check()


def test_a_segment_file_that_is_a_directory(small: RunningDaemon, scope: Scope) -> None:
    client = small.client(shared_memory=True)
    pages = on_ssd_only(small, client, scope, 4)
    ssd = small.store.tiers.ssd
    assert ssd is not None
    ssd._files.close()  # forget the open read descriptors: the next read opens the path
    folder = Path(small.config.ssd_path) / "segments"
    moved: list[tuple[Path, Path]] = []
    for seg in sorted(folder.glob("*.seg")):
        keep = seg.with_suffix(".keep")
        os.rename(seg, keep)
        os.mkdir(seg)
        moved.append((seg, keep))
    assert moved
    before = small.store.counters.ssd_read_errors
    for _ in range(2):
        assert read_back(client, scope, pages) == [None] * 4
        small.check()
    assert small.store.counters.ssd_read_errors > before
    assert small.store.stats().active_leases == 0
    for seg, keep in moved:
        shutil.rmtree(seg)
        os.rename(keep, seg)
    assert_intact(client, scope, pages)
    small.check()


# ---- same-host puts are checked ------------------------------------------------------------------


def bad_page(scope: Scope, seed: int) -> Page:
    """A page whose payload is not the one its header's checksum was computed over (computed
    now: a same-host put then sends it, where it would otherwise leave it to the daemon)."""
    good = singles(scope, 1, seed=seed)[0]
    assert good.header.payload_checksum  # computed over the good payload
    return Page(good.header, payload_for(seed + 99_999, scope.page_payload_bytes))


@pytest.mark.parametrize("reader", ["shm", "grpc"])
def test_a_same_host_put_that_fails_its_checksum_is_never_served(
    daemon_factory: DaemonFactory, scope: Scope, reader: str
) -> None:
    d = daemon_factory()
    clients = Clients(d.client(shared_memory=True), d.client(shared_memory=False))
    bad = bad_page(scope, 80)
    good = singles(scope, 3, seed=81)
    assert clients.shm.put(scope, [bad, *good]).stored == 4  # the writer is not slowed down
    # read before the daemon's own pass: the get checks it on the spot
    got = clients.by_path(reader).get(
        scope,
        keys_of([bad, *good]),
        [bytearray(PAGE_BYTES) for _ in range(4)],
        tokens=tokens_of([bad, *good]),
        verify=False,
    )
    assert got.headers[0] is None and all(h is not None for h in got.headers[1:])
    assert d.store.counters.shm_put_corrupt == 1
    assert d.tier_of(bad.header.key) == ()  # dropped
    assert_intact(clients.shm, scope, good)
    d.check()


def test_the_mover_checks_same_host_puts_off_the_writers_path(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    shm = d.client(shared_memory=True)
    bad = bad_page(scope, 90)
    good = singles(scope, 2, seed=91)
    shm.put(scope, [bad, *good])
    d.store.drain()  # one pass of the mover checks them
    assert d.tier_of(bad.header.key) == ()
    assert d.store.counters.shm_put_corrupt == 1
    assert d.store.counters.corrupt_dropped >= 1
    with d.store._lock:
        assert not d.store._unverified
    assert read_back(shm, scope, [bad]) == [None]
    assert_intact(shm, scope, good)
    d.check()


def test_the_movers_check_of_a_page_that_moved_to_another_slot_meanwhile_says_nothing(
    daemon_factory: DaemonFactory, scope: Scope, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mover checks a same-host put lock free. If, meanwhile, the page leaves its slot (to
    SSD), another page takes that slot, and the page comes back (promoted) into a different slot
    whose generation happens to equal the old one's, the checksum it computed is of another
    page's bytes: it must not drop the good page as corrupt."""
    d = daemon_factory(settings=NO_WATERMARKS)
    d.store.mover.stop()  # this test runs the mover's steps itself, in a chosen order
    shm = d.client(shared_memory=True)
    (page,) = singles(scope, 1, seed=95)
    assert page.header.payload_checksum  # computed: the put sends it, the daemon checks it
    shm.put(scope, [page])
    store, dram = d.store, d.store.tiers.dram
    key = page.header.key
    with store._lock:
        entry = store.index.get(key)
        assert entry is not None and entry.dram is not None and key in store._unverified
        old_slot = entry.dram
    real = store_module.payload_checksum
    other: list[int] = []

    def meanwhile(view: memoryview) -> int:
        if not other:  # once, between the check's copy of the view and its result
            assert store.mover.copy_to_ssd(entry, clear_dram=True)  # the slot is freed...
            slot = dram.allocate(PAGE_BYTES)  # ...and taken by other bytes
            assert slot == old_slot
            other.append(slot)
            with dram.view(slot, PAGE_BYTES) as v:
                v[:] = payload_for(96)
            acq = store.acquire(scope.digest, [key])  # promoted into a fresh slot
            assert acq.pages[0] is not None and acq.pages[0].offset != old_slot
            assert acq.pages[0].generation == dram.generation(acq.pages[0].offset)
            store.release(acq.lease_id)
        return real(view)

    monkeypatch.setattr(store_module, "payload_checksum", meanwhile)
    with store._lock:  # the fresh slot's generation equals the old one's at the check
        assert dram.generation(old_slot) == 0
    store.verify_same_host_puts()
    assert other, "the check never ran"
    dram.free(other[0])
    assert store.counters.shm_put_corrupt == 0
    assert d.tier_of(key) != ()
    assert read_back(shm, scope, [page]) == [bytes(page.payload)]
    d.check()


def test_a_daemon_with_sync_writes_keeps_its_ssd_pages_across_a_restart(
    daemon_factory: DaemonFactory, scope: Scope, tmp_path: Path
) -> None:
    settings = {**NO_WATERMARKS, "ssd.sync_writes": "true"}
    d = daemon_factory(dram="1MiB", settings=settings, data_dir=tmp_path / "synced")
    client = d.client(shared_memory=True)
    pages = on_ssd_only(d, client, scope, 6)
    d.stop()
    again = daemon_factory(dram="1MiB", settings=settings, data_dir=tmp_path / "synced")
    assert again.store.rebuilt_pages >= 6
    assert_intact(again.client(shared_memory=False), scope, pages)
    again.check()


def test_ssd_write_errors_drop_victims_and_leak_nothing(small: RunningDaemon, scope: Scope) -> None:
    """A disk that fails every write: puts past a full DRAM still succeed (the pages that had to
    leave are dropped, whole), the errors are counted, and the store stays consistent."""
    client = small.client(shared_memory=True)
    ssd = small.store.tiers.ssd
    assert ssd is not None
    ssd.faults = SsdFaults(write_error_rate=1.0)
    pages = singles(scope, 96, seed=7)
    for i in range(0, len(pages), 8):
        assert client.put(scope, pages[i : i + 8]).stored == 8
        small.check()
    small.store.drain()
    assert small.store.counters.ssd_write_errors > 0
    got = read_back(client, scope, pages[-16:])
    assert got == [bytes(p.payload) for p in pages[-16:]]  # the newest are in DRAM
    for g, p in zip(read_back(client, scope, pages[:16]), pages[:16], strict=True):
        assert g is None or g == bytes(p.payload)
    assert small.store.stats().active_leases == 0
    small.check()
