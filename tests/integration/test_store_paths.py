"""The daemon's API through both data paths: same-host shared memory and gRPC streams.

put / get / lookup / delete / stats give the same results on either path (and with the asyncio
client); lookup returns the longest present prefix with the tier of each page; watchers see pages
stored, moved and removed; /metrics exposes the counters; the standard gRPC health check answers.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from conftest import (
    PAGE_BYTES,
    Clients,
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    buffers,
    chain,
    keys_of,
    make_scope,
    read_back,
    singles,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from client import (
    AsyncStoreClient,
    Event,
    EventKind,
    IoClass,
    LookupResult,
    Page,
    PutStatus,
    Scope,
    StoreClient,
    Tier,
)
from client.contract.errors import CapacityExhausted
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

PATHS = ["shm", "grpc"]
ABSENT = b"\xab" * 16


def transcript(
    client: StoreClient, daemon: RunningDaemon, scope: Scope, pages: list[Page]
) -> list[object]:
    """One fixed sequence of calls; every result, as plain values."""
    keys = keys_of(pages)
    out: list[object] = []
    out.append(client.put(scope, pages).statuses)
    out.append(client.put(scope, pages).statuses)  # a second put stores nothing
    out.append(client.lookup(scope, keys))
    out.append(client.lookup(scope, [*keys[:5], ABSENT, *keys[6:]]).hit_count)  # a gap ends it
    out.append(client.lookup(make_scope("other tenant"), keys).hit_count)  # scopes isolate
    into = buffers(scope, len(keys) + 1)
    got = client.get(scope, [*keys, ABSENT], into, tokens=None)
    out.append([h == p.header for h, p in zip(got.headers, pages, strict=False)])
    out.append(got.headers[-1])
    out.append([bytes(b) == p.payload for b, p in zip(into, pages, strict=False)])
    out.append(
        client.get(make_scope("other tenant"), keys[:2], buffers(scope, 2), tokens=None).headers
    )
    stats = client.stats()
    dram = next(t for t in stats.tiers if t.tier is Tier.DRAM)
    ssd = next(t for t in stats.tiers if t.tier is Tier.SSD)
    out.append((stats.pages, dram.pages, dram.used_bytes, dram.hits, dram.misses, ssd.misses))
    out.append((stats.lookups, stats.lookup_hit_pages, stats.corrupt_dropped))
    daemon.check()
    out.append(client.delete(keys=keys[6:]))
    out.append(client.delete(keys=keys[6:]))  # deleting twice deletes nothing more
    out.append(client.lookup(scope, keys).hit_count)
    out.append(client.delete(scope=scope))
    out.append(client.lookup(scope, keys).hit_count)
    out.append(client.stats().pages)
    daemon.check()
    return out


def expected_transcript(pages: list[Page]) -> list[object]:
    n = len(pages)
    return [
        (PutStatus.STORED,) * n,
        (PutStatus.ALREADY_PRESENT,) * n,
        LookupResult(hit_count=n, tiers=(Tier.DRAM,) * n),
        5,
        0,
        [True] * n,
        None,
        [True] * n,
        (None, None),
        # 8 pages in DRAM; 8 DRAM hits; misses: the absent key + 2 keys of another scope, each
        # looked for in DRAM and then SSD
        (n, n, n * PAGE_BYTES, n, 3, 3),
        (3, n + 5, 0),
        2,
        0,
        6,
        6,
        0,
        0,
    ]


@pytest.mark.parametrize("path", PATHS)
def test_same_results_on_both_paths(
    path: str, daemon: RunningDaemon, clients: Clients, scope: Scope
) -> None:
    pages = chain(scope, 8, seed=1)
    assert transcript(clients.by_path(path), daemon, scope, pages) == expected_transcript(pages)


def test_pages_cross_paths(daemon: RunningDaemon, clients: Clients, scope: Scope) -> None:
    """A page put on one path is read, byte for byte, on the other."""
    via_shm, via_grpc = chain(scope, 6, seed=2), chain(scope, 6, seed=3)
    assert clients.shm.put(scope, via_shm).stored == 6
    assert clients.grpc.put(scope, via_grpc).stored == 6
    assert clients.grpc.put(scope, via_shm).already_present == 6
    assert clients.shm.put(scope, via_grpc).already_present == 6
    for client in (clients.shm, clients.grpc):
        assert_intact(client, scope, via_shm + via_grpc)
        assert client.lookup(scope, keys_of(via_grpc)).hit_count == 6
    assert clients.grpc.corrupt_pages == 0 and clients.shm.corrupt_pages == 0
    daemon.check()


@pytest.mark.parametrize("shared_memory", [True, False], ids=PATHS)
def test_async_client(shared_memory: bool, daemon: RunningDaemon, scope: Scope) -> None:
    pages = chain(scope, 8, seed=4)
    keys = keys_of(pages)

    async def scenario() -> list[object]:
        async with AsyncStoreClient(daemon.address, shared_memory=shared_memory) as client:
            await client.connect()
            assert client.transport == ("shm" if shared_memory else "grpc")
            out: list[object] = [(await client.put(scope, pages)).stored]
            out.append((await client.put(scope, pages)).already_present)
            out.append(await client.lookup(scope, [*keys[:3], ABSENT, *keys[4:]]))
            into = buffers(scope, 9)
            got = await client.get(scope, [*keys, ABSENT], into, tokens=None)
            out.append(got.hit_count)
            out.append(got.headers[-1])
            out.append([bytes(b) == p.payload for b, p in zip(into, pages, strict=False)])
            out.append((await client.stats()).pages)
            out.append(await client.delete(keys=keys[4:]))
            out.append(await client.delete(scope=scope))
            out.append((await client.lookup(scope, keys)).hit_count)
            return out

    assert asyncio.run(scenario()) == [
        8,
        8,
        LookupResult(3, (Tier.DRAM,) * 3),
        8,
        None,
        [True] * 8,
        8,
        4,
        4,
        0,
    ]
    daemon.check()


@pytest.mark.parametrize("path", PATHS)
def test_lookup_reports_tier_per_page(
    path: str, daemon: RunningDaemon, clients: Clients, scope: Scope
) -> None:
    """Pages of one chain in DRAM and on SSD: lookup names each page's tier, in chain order."""
    client = clients.by_path(path)
    pages = chain(scope, 6, seed=5)
    assert client.put(scope, pages[:3]).stored == 3
    assert client.put(scope, pages[3:], tier=Tier.SSD).stored == 3  # shm: goes over gRPC
    result = client.lookup(scope, keys_of(pages))
    assert result.hit_count == 6
    assert result.tiers == (Tier.DRAM,) * 3 + (Tier.SSD,) * 3
    assert [daemon.tier_of(k) for k in keys_of(pages)] == [(Tier.DRAM,)] * 3 + [(Tier.SSD,)] * 3
    # The longest present prefix: a missing middle page hides what follows it.
    assert client.delete(keys=[pages[1].header.key]) == 1
    assert client.lookup(scope, keys_of(pages)) == LookupResult(1, (Tier.DRAM,))
    assert_intact(client, scope, pages[2:])  # get is per key, not per prefix
    daemon.check()


def test_delete_by_scope_leaves_other_scopes(daemon: RunningDaemon, clients: Clients) -> None:
    a, b = make_scope("tenant a"), make_scope("tenant b")
    pa, pb_ = chain(a, 4, seed=6), chain(b, 4, seed=6)  # same tokens, other scope: other keys
    assert not set(keys_of(pa)) & set(keys_of(pb_))
    clients.shm.put(a, pa)
    clients.grpc.put(b, pb_)
    assert clients.grpc.delete(scope=a) == 4
    assert clients.shm.lookup(a, keys_of(pa)).hit_count == 0
    assert_intact(clients.shm, b, pb_)
    assert clients.shm.stats().pages == 4
    daemon.check()


def test_delete_while_a_reader_holds_the_pages(
    daemon: RunningDaemon, clients: Clients, scope: Scope
) -> None:
    """Deleted pages vanish for every new reader at once; a reader holding them keeps valid bytes
    until it lets go, and then they are gone."""
    pages = chain(scope, 3, seed=9)
    keys = keys_of(pages)
    clients.shm.put(scope, pages)
    stub = daemon.stub()
    held = stub.Acquire(
        pb.AcquireRequest(scope_digest=scope.digest, keys=b"".join(keys)), timeout=10
    )
    assert held.lease_id and [p.present for p in held.pages] == [True] * 3
    assert clients.grpc.delete(keys=keys[1:]) == 2
    for client in (clients.grpc, clients.shm):
        assert client.lookup(scope, keys).hit_count == 1
        assert read_back(client, scope, pages) == [pages[0].payload, None, None]
    assert clients.grpc.delete(keys=keys[1:]) == 0  # already deleted
    dram = daemon.store.tiers.dram
    for slot, page in zip(held.pages, pages, strict=True):  # the holder's bytes are untouched
        assert bytes(dram.view(slot.offset, slot.length)) == page.payload
    assert stub.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released
    assert [daemon.tier_of(k) for k in keys] == [(Tier.DRAM,), (), ()]
    assert clients.grpc.stats().pages == 1
    assert clients.shm.put(scope, pages).statuses == (
        PutStatus.ALREADY_PRESENT,
        PutStatus.STORED,
        PutStatus.STORED,
    )
    assert_intact(clients.grpc, scope, pages)
    daemon.check()


# ---- watch ----------------------------------------------------------------------------------


class Watcher:
    """Collects a client's watch stream on a thread; `start()` returns once the stream is live."""

    def __init__(self, client: StoreClient, prime: StoreClient) -> None:
        self.events: queue.Queue[Event | BaseException] = queue.Queue()
        self._client = client
        self._stream = client.watch(None, timeout_s=30)
        self._prime = prime
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.events.put(event)
        except BaseException as exc:
            self.events.put(exc)

    def start(self) -> None:
        """The server takes its cursor when the Watch handler starts, which the client cannot
        observe: publish pages of a private scope until one of their events arrives (bounded)."""
        self._thread.start()
        prime = make_scope("watch priming")
        for i, page in enumerate(singles(prime, 50, seed=99)):
            self._prime.put(prime, [page])
            try:
                self.events.get(timeout=0.2 + 0.1 * i)
            except queue.Empty:
                continue
            while True:  # drop the rest of the priming events
                try:
                    self.events.get(timeout=0.5)
                except queue.Empty:
                    break
            return
        raise AssertionError("the watch stream never delivered an event")

    def take(self, count: int, scope: Scope) -> list[Event]:
        out: list[Event] = []
        while len(out) < count:
            item = self.events.get(timeout=10)
            if isinstance(item, BaseException):
                raise item
            if item.scope_digest == scope.digest:
                out.append(item)
        return out

    def close(self) -> None:
        """Closing its client ends the stream (the iterator just stops)."""
        self._client.close()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


@pytest.fixture
def watcher(daemon: RunningDaemon, clients: Clients) -> Iterator[Watcher]:
    w = Watcher(daemon.client(shared_memory=False), clients.grpc)
    w.start()
    yield w
    w.close()


def test_watch_sees_stored_moved_removed(
    daemon: RunningDaemon, clients: Clients, watcher: Watcher, scope: Scope
) -> None:
    pages = chain(scope, 3, seed=7)
    keys = keys_of(pages)
    clients.shm.put(scope, pages[:2])
    clients.grpc.put(scope, pages[2:], tier=Tier.SSD)
    events = watcher.take(4, scope)
    assert [(e.kind, e.key, e.from_tier, e.to_tier, e.size_bytes) for e in events] == [
        (EventKind.STORED, keys[0], None, Tier.DRAM, PAGE_BYTES),
        (EventKind.STORED, keys[1], None, Tier.DRAM, PAGE_BYTES),
        (EventKind.STORED, keys[2], None, Tier.DRAM, PAGE_BYTES),
        (EventKind.MOVED, keys[2], Tier.DRAM, Tier.SSD, PAGE_BYTES),  # placed on SSD
    ]
    assert_intact(clients.grpc, scope, pages[2:])  # an SSD hit is promoted into DRAM
    (promoted,) = watcher.take(1, scope)
    assert (promoted.kind, promoted.key, promoted.from_tier, promoted.to_tier) == (
        EventKind.MOVED,
        keys[2],
        Tier.SSD,
        Tier.DRAM,
    )
    assert clients.shm.delete(keys=keys[:1]) == 1
    (removed,) = watcher.take(1, scope)
    assert (removed.kind, removed.key, removed.from_tier, removed.to_tier) == (
        EventKind.REMOVED,
        keys[0],
        Tier.DRAM,
        None,
    )
    seqs = [e.seq for e in events] + [promoted.seq, removed.seq]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(e.scope_digest == scope.digest for e in events)
    watcher.close()
    assert watcher.events.empty()  # the stream ended quietly, with no error
    daemon.check()


def test_watch_filters_by_scope(daemon: RunningDaemon, clients: Clients, scope: Scope) -> None:
    other = make_scope("other tenant")
    watching = daemon.client(shared_memory=False)
    stream = watching.watch(scope, timeout_s=30)
    got: queue.Queue[Event] = queue.Queue()

    def run() -> None:
        for ev in stream:
            got.put(ev)

    threading.Thread(target=run, daemon=True).start()
    # Prime within the watched scope (see Watcher.start), then publish to both scopes.
    primed = False
    for i, page in enumerate(singles(scope, 40, seed=98)):
        clients.shm.put(scope, [page])
        try:
            got.get(timeout=0.2 + 0.1 * i)
            primed = True
            break
        except queue.Empty:
            continue
    assert primed, "the watch stream never delivered an event"
    while not got.empty():
        got.get_nowait()
    clients.shm.put(other, chain(other, 2, seed=8))
    mine = chain(scope, 1, seed=8)
    clients.shm.put(scope, mine)
    first = got.get(timeout=10)
    assert (first.kind, first.key, first.scope_digest) == (
        EventKind.STORED,
        mine[0].header.key,
        scope.digest,
    )
    watching.close()


def test_watch_times_out(clients: Clients, scope: Scope) -> None:
    from client import DeadlineExceeded

    stream = clients.grpc.watch(scope, timeout_s=0.3)
    with pytest.raises(DeadlineExceeded):
        list(stream)


# ---- metrics and health -------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_prometheus_metrics(daemon_factory: DaemonFactory, scope: Scope) -> None:
    """Every counter the design names is exported, with the values the calls imply."""
    # 1 MiB DRAM = 64 pages; watermarks at 100% so only the writes below evict, deterministically.
    d = daemon_factory(
        dram="1MiB",
        clock=True,
        settings={
            "dram.high_watermark": "1.0",
            "dram.low_watermark": "1.0",
        },
    )
    assert d.info.metrics_url.startswith("http://127.0.0.1:")
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    pages = singles(scope, 72, seed=10)
    for i in range(0, 64, 8):
        shm.put(scope, pages[i : i + 8])
    rpc.put(scope, pages[64:], io_class=IoClass.BACKGROUND)  # 8 oldest pages go to SSD
    d.store.drain()
    assert [d.tier_of(k) for k in keys_of(pages[:9])] == [(Tier.SSD,)] * 8 + [(Tier.DRAM,)]
    assert read_back(rpc, scope, pages[60:64]) == [p.payload for p in pages[60:64]]  # DRAM hits
    assert read_back(rpc, scope, pages[:2]) == [p.payload for p in pages[:2]]  # SSD hits
    assert read_back(shm, scope, [chain(make_scope("x"), 1)[0]]) == [None]  # a miss
    # a page whose payload does not match its header's checksum: dropped as corrupt
    bad = singles(scope, 1, seed=11)[0]
    stub = d.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(
            iter(
                [
                    pb.PutRequest(begin=pb.PutBegin(scope=scope.encode(), page_count=1)),
                    pb.PutRequest(
                        chunk=pb.PageChunk(
                            index=0,
                            header=bad.header.encode(),
                            offset=0,
                            data=os.urandom(PAGE_BYTES),
                        )
                    ),
                ]
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    # a reservation that runs out: its slot stays quarantined until its writer's late call
    late = stub.Reserve(
        pb.ReserveRequest(
            scope=scope.encode(), headers=[singles(scope, 1, seed=12)[0].header.encode()]
        ),
        timeout=10,
    )
    assert d.clock is not None
    d.clock.advance(3600)
    d.store.reap_leases()
    assert d.store.quarantine.blocks == 1
    assert not stub.Release(pb.ReleaseRequest(lease_id=late.lease_id), timeout=10).released
    assert d.store.quarantine.blocks == 0
    shm.close()  # waits for its lease releases
    d.check()

    m = scrape(d.info.metrics_url)
    K = PAGE_BYTES
    # hits by the tier that served them; misses by every tier consulted in vain
    assert [metric(m, "strata_hits_total", tier=t) for t in ("gpu", "dram", "ssd")] == [0, 4, 2]
    assert [metric(m, "strata_misses_total", tier=t) for t in ("gpu", "dram", "ssd")] == [0, 3, 1]
    # bytes by path, direction and I/O class
    assert metric(m, "strata_bytes_total", path="shm", direction="in", io_class="normal") == 64 * K
    assert (
        metric(m, "strata_bytes_total", path="grpc", direction="in", io_class="background") == 8 * K
    )
    assert metric(m, "strata_bytes_total", path="grpc", direction="out", io_class="normal") == 6 * K
    assert metric(m, "strata_bytes_total", path="ssd", direction="out", io_class="normal") == 2 * K
    # 8 puts past a full DRAM, 2 promotions and the corrupt put's reservation each evicted one
    # DRAM page, and every one of them was demoted to SSD (written there, counted there)
    assert metric(m, "strata_evictions_total", tier="dram") == 11
    assert metric(m, "strata_demotions_total", from_tier="dram", to_tier="ssd") == 11
    assert (
        metric(m, "strata_bytes_total", path="ssd", direction="in", io_class="background") == 11 * K
    )
    assert metric(m, "strata_promotions_total", from_tier="ssd", to_tier="dram") == 2
    assert metric(m, "strata_corrupt_pages_dropped_total") == 1
    assert metric(m, "strata_lease_expiries_total") == 1
    assert metric(m, "strata_writes_refused_full_total") == 0
    for io_class in ("critical", "normal", "background"):
        assert metric(m, "strata_io_queue_depth", io_class=io_class) == 0
    assert metric(m, "strata_active_leases") == 0
    assert metric(m, "strata_tier_pages", tier="dram") == 63
    assert metric(m, "strata_tier_pages", tier="ssd") == 11
    assert metric(m, "strata_tier_capacity_bytes", tier="dram") == 1 << 20
    assert metric(m, "strata_tier_used_bytes", tier="dram") == 63 * K
    # the Stats RPC reads the same counters
    stats = rpc.stats()
    assert (stats.demotions, stats.promotions, stats.corrupt_dropped, stats.lease_expiries) == (
        11,
        2,
        1,
        1,
    )
    assert {t.tier: (t.hits, t.misses, t.evictions) for t in stats.tiers} == {
        Tier.DRAM: (4, 3, 11),
        Tier.SSD: (2, 1, 0),
    }


def test_health_check_serving(daemon: RunningDaemon) -> None:
    channel = grpc.insecure_channel(daemon.address)
    daemon.channels.append(channel)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "strata.store.v1.Store"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_same_host_put_is_counted_in_its_io_class(
    daemon: RunningDaemon, clients: Clients, scope: Scope
) -> None:
    pages = chain(scope, 2, seed=12)
    clients.shm.put(scope, pages, io_class=IoClass.BACKGROUND)
    clients.grpc.put(scope, chain(scope, 2, seed=13), io_class=IoClass.BACKGROUND)
    moved = dict(daemon.store.counters.bytes_moved)
    assert moved.get(("grpc", "in", IoClass.BACKGROUND)) == 2 * PAGE_BYTES  # the gRPC path does
    assert moved.get(("shm", "in", IoClass.BACKGROUND)) == 2 * PAGE_BYTES


@pytest.mark.usefixtures("pipelined_small_batches")
def test_a_large_same_host_put_goes_in_parts(daemon_factory: DaemonFactory, scope: Scope) -> None:
    """Puts of 16 pages or more are pipelined (each part's reservation asked for as the one
    before it is granted, each part committed as soon as it is copied): every page stored and
    intact, no lease left behind."""
    d = daemon_factory(dram="8MiB", ssd=None)
    shm = d.client(shared_memory=True)
    pages = chain(scope, 40, seed=61)
    assert shm.put(scope, pages[:25]).stored == 25
    assert [s.name for s in shm.put(scope, pages).statuses] == (
        ["ALREADY_PRESENT"] * 25 + ["STORED"] * 15
    )
    assert_intact(shm, scope, pages)
    # (the reads' releases are one-way: they may land just after)
    assert wait_for(lambda: d.store.stats().active_leases == 0, timeout_s=10)
    d.check()


@pytest.mark.usefixtures("pipelined_small_batches")
def test_a_pipelined_put_whose_second_part_fails_leaves_no_lease(
    daemon_factory: DaemonFactory, scope: Scope, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon_factory(dram="8MiB", ssd=None)
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    real_reserve = d.store.reserve
    calls: list[int] = []

    def second_fails(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # the second part's reservation
            raise CapacityExhausted("no room (injected)", retry_after_s=0.5)
        return real_reserve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(d.store, "reserve", second_fails)
    pages = chain(scope, 32, seed=63)  # parts of 1, 15, 15 and 1 pages
    with pytest.raises(CapacityExhausted):
        shm.put(scope, pages)
    assert len(calls) == 2  # the third part was never asked for
    assert wait_for(lambda: d.store.stats().active_leases == 0, timeout_s=10)
    d.check()
    stored = [p for p in pages if rpc.lookup(scope, [p.header.key]).hit_count]
    assert stored in ([], pages[:1])  # the first part may have been committed
    assert_intact(rpc, scope, stored)
    monkeypatch.setattr(d.store, "reserve", real_reserve)
    assert shm.put(scope, pages).stored == 32 - len(stored)  # and the store serves on
    assert_intact(shm, scope, pages)


@pytest.mark.usefixtures("pipelined_small_batches")
def test_a_large_same_host_get_goes_in_parts_and_serves_every_page_it_holds(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """Large gets send their parts' Acquires at once (parts of 1, 3 and 28 pages for 32): the
    pages held come back intact in their buffers, in order, misses in any part stay misses (a
    part of misses only, a part with some), and every lease goes back."""
    d = daemon_factory(dram="8MiB", ssd=None)
    shm = d.client(shared_memory=True)
    pages = chain(scope, 32, seed=67)
    gone = (0, 2, 5, 20)  # the first part all missed, the others in part
    assert shm.put(scope, pages).stored == 32
    assert shm.delete(keys=[pages[i].header.key for i in gone]) == len(gone)
    held = [p for i, p in enumerate(pages) if i not in gone]
    into = buffers(scope, 32)
    got = shm.get(scope, [p.header.key for p in pages], into, tokens=None)
    for i, p in enumerate(pages):
        if i in gone:
            assert got.headers[i] is None
        else:
            assert got.headers[i] == p.header and bytes(into[i]) == p.payload
    assert got.hit_count == len(held)
    assert wait_for(lambda: d.store.stats().active_leases == 0, timeout_s=10)
    d.check()


def test_a_same_host_get_of_missing_keys_is_a_counted_miss_without_a_lease(
    clients: Clients, daemon: RunningDaemon, scope: Scope
) -> None:
    """The all-miss shortcut of the same-host get (no segment check, no copy, no release):
    each key is still a miss, counted once in DRAM; a partial hit after it is still served."""
    pages = chain(scope, 2)
    clients.shm.put(scope, pages)
    before = clients.shm.stats().tiers
    dram_misses = next(t.misses for t in before if t.tier is Tier.DRAM)
    got = clients.shm.get(scope, [ABSENT, bytes(range(16))], buffers(scope, 2), tokens=None)
    assert got.headers == (None, None) and got.hit_count == 0
    after = clients.shm.stats()
    assert next(t.misses for t in after.tiers if t.tier is Tier.DRAM) == dram_misses + 2
    assert daemon.store.stats().active_leases == 0
    into = buffers(scope, 2)
    partial = clients.shm.get(scope, [pages[0].header.key, ABSENT], into, tokens=None)
    assert partial.headers == (pages[0].header, None)
    assert bytes(into[0]) == pages[0].payload
