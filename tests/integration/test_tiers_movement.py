"""Movement between tiers in a running daemon (DESIGN §5, §6).

Demotion on eviction (DRAM -> SSD, GPU -> DRAM), promotion on an SSD hit, write-through, the
second-hit SSD admission policy, prefix-aware eviction (leaves before parents), leased pages that
never move, and I/O classes served critical first. DRAM is 1 MiB (64 pages of 16 KiB) with the
background watermarks at 100% unless a test is about them, so only writes evict, deterministically.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
from conftest import (
    PAGE_BYTES,
    Clients,
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    chain,
    keys_of,
    read_back,
    singles,
)

from client import IoClass, Page, PutStatus, Scope, StoreClient, Tier
from kvstore.events import Event as StoreEvent
from kvstore.events import EventKind as StoreEventKind
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}
DRAM_PAGES = (1 << 20) // PAGE_BYTES  # 64


def small(daemon_factory: DaemonFactory, **settings: str) -> RunningDaemon:
    return daemon_factory(dram="1MiB", settings={**NO_WATERMARKS, **settings})


def put_in_batches(client: StoreClient, scope: Scope, pages: list[Page], batch: int = 8) -> None:
    for i in range(0, len(pages), batch):
        result = client.put(scope, pages[i : i + batch])
        assert result.statuses == (PutStatus.STORED,) * len(pages[i : i + batch])


def tiers_by_lookup(client: StoreClient, scope: Scope, pages: list[Page]) -> list[tuple[Tier, ...]]:
    """Each independent page's tier as lookup reports it (() for absent)."""
    out = []
    for page in pages:
        result = client.lookup(scope, [page.header.key])
        out.append(result.tiers)
    return out


def new_events(d: RunningDaemon, after_seq: int) -> list[StoreEvent]:
    return d.store.events.read(after_seq, timeout_s=0)


def stats_of(client: StoreClient) -> dict[Tier, tuple[int, int, int]]:
    """tier -> (pages, hits, evictions)."""
    return {t.tier: (t.pages, t.hits, t.evictions) for t in client.stats().tiers}


@pytest.fixture
def small_daemon(daemon_factory: DaemonFactory) -> RunningDaemon:
    return small(daemon_factory)


@pytest.fixture
def small_clients(small_daemon: RunningDaemon) -> Clients:
    return Clients(
        small_daemon.client(shared_memory=True), small_daemon.client(shared_memory=False)
    )


# ---- demotion and promotion ---------------------------------------------------------------------


def test_eviction_demotes_oldest_pages_to_ssd(
    small_daemon: RunningDaemon, small_clients: Clients, scope: Scope
) -> None:
    d, c = small_daemon, small_clients
    pages = singles(scope, DRAM_PAGES + 16, seed=20)
    put_in_batches(c.shm, scope, pages)
    d.store.drain()
    d.check()
    # The 16 oldest pages left DRAM for SSD; the newest 64 fill DRAM.
    expected = [(Tier.SSD,)] * 16 + [(Tier.DRAM,)] * DRAM_PAGES
    assert tiers_by_lookup(c.grpc, scope, pages) == expected
    assert [d.tier_of(k) for k in keys_of(pages)] == expected  # no copy left behind in DRAM
    stats = c.grpc.stats()
    assert stats_of(c.grpc) == {Tier.DRAM: (DRAM_PAGES, 0, 16), Tier.SSD: (16, 0, 0)}
    assert (stats.pages, stats.demotions, stats.promotions) == (DRAM_PAGES + 16, 16, 0)
    # Demoted pages are still readable, byte-identical (each read promotes one, demoting another).
    assert_intact(c.grpc, scope, pages[:16])
    for i in range(0, len(pages), 16):  # a get pins all its pages: keep each under DRAM's size
        assert_intact(c.shm, scope, pages[i : i + 16])
    assert c.grpc.corrupt_pages == 0
    d.check()


def test_ssd_hit_is_promoted_to_dram(
    small_daemon: RunningDaemon, small_clients: Clients, scope: Scope
) -> None:
    d, c = small_daemon, small_clients
    pages = singles(scope, 8, seed=21)
    assert c.grpc.put(scope, pages, tier=Tier.SSD).stored == 8
    assert tiers_by_lookup(c.shm, scope, pages) == [(Tier.SSD,)] * 8
    before = c.grpc.stats()
    assert read_back(c.grpc, scope, pages[:3]) == [p.payload for p in pages[:3]]
    after = c.grpc.stats()
    assert after.promotions - before.promotions == 3
    assert tiers_by_lookup(c.shm, scope, pages) == [(Tier.DRAM,)] * 3 + [(Tier.SSD,)] * 5
    # the SSD copy stays: a promoted page that is evicted again costs no SSD write
    assert [d.tier_of(k) for k in keys_of(pages[:3])] == [(Tier.DRAM, Tier.SSD)] * 3
    hits = {t.tier: t.hits for t in after.tiers}
    assert hits == {Tier.DRAM: 0, Tier.SSD: 3}
    # a second read is a DRAM hit: no further promotion
    assert_intact(c.shm, scope, pages[:3])
    assert c.grpc.stats().promotions == after.promotions
    assert {t.tier: t.hits for t in c.grpc.stats().tiers} == {Tier.DRAM: 3, Tier.SSD: 3}
    d.check()


def test_background_demotion_to_low_watermark(daemon_factory: DaemonFactory, scope: Scope) -> None:
    """Above the high watermark (95%) the mover demotes, oldest first, down to the low one (85%)."""
    d = daemon_factory(dram="1MiB")
    client = d.client(shared_memory=True)
    pages = singles(scope, DRAM_PAGES, seed=22)
    put_in_batches(client, scope, pages)
    d.store.drain()
    low = int(0.85 * DRAM_PAGES)  # 54 pages
    assert [d.tier_of(k) for k in keys_of(pages)] == (
        [(Tier.SSD,)] * (DRAM_PAGES - low) + [(Tier.DRAM,)] * low
    )
    assert client.stats().demotions == DRAM_PAGES - low
    assert_intact(d.client(shared_memory=False), scope, pages)
    d.check()


def test_leased_pages_never_move(
    small_daemon: RunningDaemon, small_clients: Clients, scope: Scope
) -> None:
    d, c = small_daemon, small_clients
    pages = singles(scope, DRAM_PAGES + 8, seed=23)
    put_in_batches(c.shm, scope, pages[:DRAM_PAGES])
    stub = d.stub()
    held = stub.Acquire(
        pb.AcquireRequest(scope_digest=scope.digest, keys=b"".join(keys_of(pages[:4]))), timeout=10
    )
    assert held.lease_id and all(p.present for p in held.pages)
    put_in_batches(c.shm, scope, pages[DRAM_PAGES:])  # 8 evictions: not the 4 leased oldest
    assert [d.tier_of(k) for k in keys_of(pages[:12])] == [(Tier.DRAM,)] * 4 + [(Tier.SSD,)] * 8
    assert stub.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released
    d.check()


# ---- write-through and admission ------------------------------------------------------------------


def test_write_through_copies_every_put_to_ssd(daemon_factory: DaemonFactory, scope: Scope) -> None:
    d = daemon_factory(settings={"ssd.write_mode": "write-through"})
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    pages = chain(scope, 8, seed=24)
    shm.put(scope, pages[:4])
    rpc.put(scope, pages[4:])
    d.store.drain()
    assert [d.tier_of(k) for k in keys_of(pages)] == [(Tier.DRAM, Tier.SSD)] * 8
    assert shm.lookup(scope, keys_of(pages)).tiers == (Tier.DRAM,) * 8  # served from DRAM
    ssd = d.store.tiers.ssd
    assert ssd is not None
    for page in pages:  # the SSD copy is the page itself
        stored = ssd.read(page.header.key)
        assert stored is not None and stored == (page.header, page.payload)
    assert stats_of(rpc)[Tier.SSD][0] == 8 and stats_of(rpc)[Tier.DRAM][0] == 8
    assert rpc.stats().demotions == 0
    d.check()


def test_write_back_is_the_default(daemon: RunningDaemon, clients: Clients, scope: Scope) -> None:
    pages = chain(scope, 4, seed=25)
    clients.shm.put(scope, pages)
    daemon.store.drain()
    assert [daemon.tier_of(k) for k in keys_of(pages)] == [(Tier.DRAM,)] * 4
    assert stats_of(clients.grpc)[Tier.SSD][0] == 0


def test_second_hit_admission(daemon_factory: DaemonFactory, scope: Scope) -> None:
    """Only pages read since they were written earn an SSD write when DRAM evicts them."""
    d = small(daemon_factory, **{"ssd.admission": "second-hit"})
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    first = singles(scope, DRAM_PAGES, seed=26)
    put_in_batches(shm, scope, first)
    assert read_back(rpc, scope, first[:4]) == [p.payload for p in first[:4]]  # read once
    later = singles(scope, DRAM_PAGES, seed=27)
    put_in_batches(shm, scope, later)  # evicts every page of `first`
    d.store.drain()
    assert [d.tier_of(k) for k in keys_of(first)] == [(Tier.SSD,)] * 4 + [()] * (DRAM_PAGES - 4)
    assert [d.tier_of(k) for k in keys_of(later)] == [(Tier.DRAM,)] * DRAM_PAGES
    stats = rpc.stats()
    assert (stats.pages, stats.demotions) == (DRAM_PAGES + 4, 4)
    assert stats_of(rpc)[Tier.DRAM][2] == DRAM_PAGES  # 64 evictions, 60 of them dropped
    assert read_back(rpc, scope, first[3:6]) == [first[3].payload, None, None]
    d.check()


# ---- the GPU tier (on the cpu device) -----------------------------------------------------------


def test_gpu_tier_on_cpu(daemon_factory: DaemonFactory, scope: Scope) -> None:
    pytest.importorskip("torch")
    d = daemon_factory(
        settings={
            "gpu.enabled": "true",
            "gpu.device": "cpu",
            "gpu.capacity_bytes": f"{4 * PAGE_BYTES}",
        }
    )
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    info = rpc.node_info()
    assert [(t.tier, t.device) for t in info.tiers] == [
        (Tier.GPU, "cpu"),
        (Tier.DRAM, ""),
        (Tier.SSD, ""),
    ]
    pages = singles(scope, 6, seed=28)
    assert shm.put(scope, pages[:2], tier=Tier.GPU).stored == 2  # shm client: over gRPC
    assert rpc.put(scope, pages[2:4], tier=Tier.GPU).stored == 2
    assert [d.tier_of(k) for k in keys_of(pages[:4])] == [(Tier.GPU,)] * 4
    assert tiers_by_lookup(rpc, scope, pages[:4]) == [(Tier.GPU,)] * 4
    # GPU full: two more pages push the two oldest down into DRAM (copied, not dropped)
    before = d.store.events.last_seq
    assert rpc.put(scope, pages[4:], tier=Tier.GPU).stored == 2
    assert [d.tier_of(k) for k in keys_of(pages)] == [(Tier.DRAM,)] * 2 + [(Tier.GPU,)] * 4
    moved = [
        (e.key, e.from_tier, e.to_tier)
        for e in new_events(d, before)
        if e.kind is StoreEventKind.MOVED
    ]
    assert moved == [
        (pages[0].header.key, Tier.GPU, Tier.DRAM),
        (pages[4].header.key, Tier.DRAM, Tier.GPU),
        (pages[1].header.key, Tier.GPU, Tier.DRAM),
        (pages[5].header.key, Tier.DRAM, Tier.GPU),
    ]
    stats = rpc.stats()
    assert stats.demotions == 2
    assert stats_of(rpc)[Tier.GPU] == (4, 0, 2)
    # reads: GPU pages are served through a DRAM copy and stay in the GPU tier
    assert_intact(rpc, scope, pages)
    assert_intact(shm, scope, pages)
    assert tiers_by_lookup(rpc, scope, pages) == [(Tier.DRAM,)] * 2 + [(Tier.GPU,)] * 4
    hits = {t.tier: t.hits for t in rpc.stats().tiers}
    assert hits == {Tier.GPU: 8, Tier.DRAM: 4, Tier.SSD: 0}
    assert rpc.stats().promotions == 0  # a DRAM copy of a GPU page is not a promotion
    d.check()


def test_gpu_placement_that_cannot_be_honoured_stays_in_dram(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    pytest.importorskip("torch")
    d = daemon_factory(
        settings={
            "gpu.enabled": "true",
            "gpu.device": "cpu",
            "gpu.capacity_bytes": f"{2 * PAGE_BYTES}",
        }
    )
    rpc = d.client(shared_memory=False)
    pages = singles(scope, 3, seed=29)
    rpc.put(scope, pages[:2], tier=Tier.GPU)
    stub = d.stub()
    held = stub.Acquire(
        pb.AcquireRequest(scope_digest=scope.digest, keys=b"".join(keys_of(pages[:2]))), timeout=10
    )
    # every GPU page is leased: the new page cannot go there, but it is stored all the same
    assert rpc.put(scope, pages[2:], tier=Tier.GPU).statuses == (PutStatus.STORED,)
    assert d.tier_of(pages[2].header.key) == (Tier.DRAM,)
    assert_intact(rpc, scope, pages)
    assert stub.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released
    d.check()


# ---- prefix-aware eviction ------------------------------------------------------------------------


def test_eviction_takes_leaves_before_parents(
    small_daemon: RunningDaemon, small_clients: Clients, scope: Scope
) -> None:
    """A chain is the oldest data in DRAM, yet it shrinks from its tail: a child is useless
    without its parent, so plain LRU (which would drop its first pages) is not what happens."""
    d, c = small_daemon, small_clients
    prompt = chain(scope, 8, seed=30)
    others = singles(scope, DRAM_PAGES - 8 + 4, seed=31)
    c.shm.put(scope, prompt)
    put_in_batches(c.shm, scope, others[: DRAM_PAGES - 8])  # DRAM is now exactly full
    before = d.store.events.last_seq
    c.shm.put(scope, others[DRAM_PAGES - 8 :])  # 4 evictions
    d.store.drain()
    assert c.grpc.lookup(scope, keys_of(prompt)).tiers == (Tier.DRAM,) * 4 + (Tier.SSD,) * 4
    demoted = [e.key for e in new_events(d, before) if e.kind is StoreEventKind.MOVED]
    assert demoted == [p.header.key for p in reversed(prompt[4:])]  # page 7, then 6, 5, 4
    assert all(d.tier_of(k) == (Tier.DRAM,) for k in keys_of(others))
    assert_intact(c.grpc, scope, prompt)
    d.check()


def test_reused_leaves_outlive_one_off_leaves(
    small_daemon: RunningDaemon, small_clients: Clients, scope: Scope
) -> None:
    """Among leaves, pages hit twice (protected) leave after pages hit less, even older ones."""
    d, c = small_daemon, small_clients
    pages = singles(scope, DRAM_PAGES + 4, seed=32)
    put_in_batches(c.shm, scope, pages[:DRAM_PAGES])
    for _ in range(2):
        assert read_back(c.grpc, scope, pages[:2]) == [p.payload for p in pages[:2]]
    for _ in range(1):
        assert read_back(c.grpc, scope, pages[2:4]) == [p.payload for p in pages[2:4]]
    put_in_batches(c.shm, scope, pages[DRAM_PAGES:], batch=4)
    # one-off leaves, least recently used first: pages 4..7 (pages 2, 3 were read more recently)
    assert [d.tier_of(k) for k in keys_of(pages[:8])] == [(Tier.DRAM,)] * 4 + [(Tier.SSD,)] * 4
    d.check()


# ---- I/O classes ----------------------------------------------------------------------------------


def test_critical_reads_go_before_background_under_contention(
    daemon_factory: DaemonFactory, scope: Scope, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One I/O slot, held: queued gets are then served critical, normal, background — the
    reverse of their arrival order."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    d = daemon_factory(settings={"io.concurrency": "1"})
    pages = singles(scope, 3, seed=33)
    d.client(shared_memory=True).put(scope, pages)
    scheduler = d.store.scheduler
    original = scheduler.admit
    granted: list[IoClass] = []

    @contextlib.contextmanager
    def spy(io_class: IoClass, nbytes: int, timeout_s: float | None = None) -> Iterator[None]:
        with original(io_class, nbytes, timeout_s):
            granted.append(IoClass(io_class))  # in the slot: grant order, exactly
            yield

    monkeypatch.setattr(scheduler, "admit", spy)
    results: dict[IoClass, list[bytes | None]] = {}
    threads = []
    with original(IoClass.BACKGROUND, 0):  # the one slot is busy
        for io_class, page in zip(
            (IoClass.BACKGROUND, IoClass.NORMAL, IoClass.CRITICAL), pages, strict=True
        ):
            client = d.client(shared_memory=False, io_class=io_class)

            def run(
                client: StoreClient = client, io_class: IoClass = io_class, page: Page = page
            ) -> None:
                results[io_class] = read_back(client, scope, [page])

            t = threading.Thread(target=run)
            t.start()
            threads.append(t)
            assert scheduler.wait_for_depth(io_class, 1, timeout_s=10)  # queued in the daemon
        with urllib.request.urlopen(d.info.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        depth = {
            s.labels["io_class"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "strata_io_queue_depth"
            for s in f.samples
        }
        assert depth == {"critical": 1.0, "normal": 1.0, "background": 1.0}
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert granted == [IoClass.CRITICAL, IoClass.NORMAL, IoClass.BACKGROUND]
    assert results == {
        IoClass.BACKGROUND: [pages[0].payload],
        IoClass.NORMAL: [pages[1].payload],
        IoClass.CRITICAL: [pages[2].payload],
    }
    d.check()
