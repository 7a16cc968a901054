"""I/O classes hold on every path (DESIGN §6): same-host copies, SSD reads, synchronous
demotions and the bulk (TCP) path pass the scheduler in their class, and background work waiting
for its turn never keeps a critical get from the threads it needs."""

from __future__ import annotations

import threading

import pytest
from conftest import PAGE_BYTES, DaemonFactory, read_back, singles

from client import IoClass, Scope, StoreClient

pytestmark = pytest.mark.integration

NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}


def test_every_path_passes_the_scheduler_in_its_class(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(dram="1MiB", settings=NO_WATERMARKS)
    sched = d.store.scheduler
    shm = d.client(shared_memory=True)

    def admitted(io_class: IoClass) -> int:
        return sched.admitted_bytes(io_class)

    # same-host put and get, in the background class: the client's copies count there
    before = admitted(IoClass.BACKGROUND)
    pages = singles(scope, 8, seed=1)
    shm.put(scope, pages, io_class=IoClass.BACKGROUND)
    bg = d.client(shared_memory=True, io_class=IoClass.BACKGROUND)
    assert read_back(bg, scope, pages) == [bytes(p.payload) for p in pages]
    assert admitted(IoClass.BACKGROUND) - before >= 2 * 8 * PAGE_BYTES
    # a normal put past a full DRAM: its synchronous demotions are background I/O
    before = admitted(IoClass.BACKGROUND)
    more = singles(scope, 64, seed=2)
    for i in range(0, 64, 16):
        shm.put(scope, more[i : i + 16])
    assert d.tier_of(pages[0].header.key) == (3,)  # demoted
    assert admitted(IoClass.BACKGROUND) - before >= 8 * PAGE_BYTES
    # a critical get of SSD pages: the SSD reads are admitted as critical, with their bytes
    before = admitted(IoClass.CRITICAL)
    crit = d.client(shared_memory=True, io_class=IoClass.CRITICAL)
    assert read_back(crit, scope, pages[:4]) == [bytes(p.payload) for p in pages[:4]]
    assert admitted(IoClass.CRITICAL) - before >= 2 * 4 * PAGE_BYTES  # the reads and the copies
    d.check()


def test_background_waits_on_the_tcp_path_do_not_hold_a_critical_get(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """The one I/O slot is held; a dozen background TCP gets queue for it (more than the
    event loop's default thread pool holds); a critical get still reaches the scheduler's
    queue at once, and is served first when the slot frees."""
    d = daemon_factory(settings={"io.concurrency": "1", "server.tcp": "true"})
    pages = singles(scope, 13, seed=3)
    d.client(shared_memory=True).put(scope, pages)
    sched = d.store.scheduler
    results: dict[int, list[bytes | None]] = {}
    threads: list[threading.Thread] = []
    clients: list[StoreClient] = []

    def get(n: int, io_class: IoClass) -> None:
        client = StoreClient(d.address, shared_memory=False, tcp=True, io_class=io_class)
        clients.append(client)
        client.connect()
        t = threading.Thread(
            target=lambda: results.__setitem__(n, read_back(client, scope, [pages[n]]))
        )
        t.start()
        threads.append(t)

    try:
        with sched.admit(IoClass.BACKGROUND, 0):  # the one slot is busy
            for n in range(12):
                get(n, IoClass.BACKGROUND)
            # as many as the daemon's background threads hold (8: more than the loop's default
            # pool on this machine); the rest wait for one of those threads
            assert sched.wait_for_depth(IoClass.BACKGROUND, 8, timeout_s=30)
            get(12, IoClass.CRITICAL)
            assert sched.wait_for_depth(IoClass.CRITICAL, 1, timeout_s=10), (
                "the critical get never reached the scheduler: no thread was free for it"
            )
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
    finally:
        for c in clients:
            c.close()
    assert results == {n: [bytes(pages[n].payload)] for n in range(13)}
    d.check()
