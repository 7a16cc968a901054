"""Per-namespace byte quotas per tier ([[quota]] tables, kvstore/quota.py) against a live daemon:
a namespace at its DRAM quota makes room from its own pages, and when none can leave its put is
RESOURCE_EXHAUSTED with a retry hint while other namespaces keep serving; a namespace's SSD quota
holds the same way; pages of a namespace over its share leave a full tier first; usage and
refusals per namespace are on /metrics; a bad [[quota]] table is a clear config error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
from conftest import PAGE_BYTES, DaemonFactory, RunningDaemon, keys_of, make_scope, singles
from test_store_paths import metric, scrape

from client import CapacityExhausted, IoClass, Page, Scope, StoreClient, Tier
from client.transports._wire import put_requests
from kvstore.config import load_config
from kvstore.errors import InvalidArgument
from kvstore.index import Index, PageEntry
from kvstore.keys import Tier as StoreTier
from kvstore.quota import NamespaceQuota, Quotas, parse_quotas

pytestmark = pytest.mark.integration

A, B = make_scope("tenant-a"), make_scope("tenant-b")
PAGES = 8  # tenant-a's DRAM quota, in pages


def quota_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "quota.toml"
    path.write_text(body)
    return path


def quota_daemon(
    daemon_factory: DaemonFactory, tmp_path: Path, *, ssd: str | None = "64MiB", extra: str = ""
) -> RunningDaemon:
    body = f'[[quota]]\nnamespace = "tenant-a"\ndram = "{PAGES * PAGE_BYTES}"\n{extra}'
    return daemon_factory(
        dram="2MiB",
        ssd=ssd,
        config_file=quota_file(tmp_path, body),
        settings={"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"},
    )


def dram_bytes(d: RunningDaemon, scope: Scope) -> int:
    with d.store._lock:
        return d.store.index.namespace_bytes(scope.namespace, Tier.DRAM)


def ssd_bytes(d: RunningDaemon, scope: Scope) -> int:
    with d.store._lock:
        return d.store.index.namespace_bytes(scope.namespace, Tier.SSD)


def put_each(client: StoreClient, scope: Scope, pages: list[Page]) -> None:
    for page in pages:
        assert client.put(scope, [page]).stored == 1


def test_a_namespace_at_its_dram_quota_makes_room_from_its_own_pages(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path)
    client = d.client(shared_memory=True)
    theirs = singles(B, 12, seed=2)
    put_each(client, B, theirs)
    mine = singles(A, 3 * PAGES, seed=1)
    put_each(client, A, mine)
    assert dram_bytes(d, A) == PAGES * PAGE_BYTES  # at the quota, never over it
    # the oldest of tenant-a's pages went to SSD (nothing of them lost); tenant-b's stayed
    assert all(d.tier_of(p.header.key) == (Tier.SSD,) for p in mine[:PAGES])
    assert all(Tier.DRAM in d.tier_of(p.header.key) for p in mine[-PAGES:])
    assert all(Tier.DRAM in d.tier_of(p.header.key) for p in theirs)
    assert client.lookup(A, keys_of(mine[:1])).hit_count == 1
    d.check()


def test_without_ssd_the_namespace_loses_its_own_oldest_pages_not_another_namespaces(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path, ssd=None)
    client = d.client(shared_memory=False)
    theirs = singles(B, 12, seed=4)
    put_each(client, B, theirs)
    mine = singles(A, 2 * PAGES, seed=3)
    put_each(client, A, mine)
    assert dram_bytes(d, A) == PAGES * PAGE_BYTES
    assert client.lookup(A, keys_of(mine[:1])).hit_count == 0  # evicted
    assert all(d.tier_of(p.header.key) == (Tier.DRAM,) for p in mine[PAGES:])
    assert all(d.tier_of(p.header.key) == (Tier.DRAM,) for p in theirs)
    d.check()


@pytest.mark.parametrize("path", ["shm", "grpc"])
def test_a_put_past_the_quota_is_resource_exhausted_with_a_retry_hint_and_others_serve(
    daemon_factory: DaemonFactory, tmp_path: Path, path: str
) -> None:
    d = quota_daemon(daemon_factory, tmp_path)
    client = d.client(shared_memory=path == "shm")
    mine = singles(A, PAGES + 1, seed=5)
    assert client.put(A, mine[:PAGES]).stored == PAGES
    held = d.store.acquire(A.digest, keys_of(mine[:PAGES]))  # a reader pins them all
    assert held.lease_id
    before = d.store.counters.quota_refused["tenant-a"]
    with pytest.raises(CapacityExhausted) as refused:
        client.put(A, mine[PAGES:])
    assert refused.value.retry_after_s == pytest.approx(d.store.tiers.retry_after_s)
    assert "quota" in str(refused.value)
    assert d.store.counters.quota_refused["tenant-a"] == before + 1
    d.check()
    assert d.store.stats().active_leases == 1  # the reader's only: nothing of the put leaked
    # a put bigger than the whole quota is refused at once, moving nothing out of DRAM (a
    # gRPC stream too: at its PutBegin, from the page count it announces)
    with pytest.raises(CapacityExhausted, match="put less at once"):
        client.put(A, singles(A, PAGES + 1, seed=50))
    # tenant-b keeps serving, and tenant-a's pages are intact
    assert client.put(B, singles(B, 4, seed=6)).stored == 4
    assert client.lookup(A, keys_of(mine[:PAGES])).hit_count == PAGES
    # once the reader is done, tenant-a's put makes its room and goes through
    assert d.store.release(held.lease_id)
    assert client.put(A, mine[PAGES:]).stored == 1
    d.check()


PUT_PATHS = {  # how a client is made for each put path, and the daemon settings it needs
    "shm": ({}, {"shared_memory": True}),
    "grpc": ({}, {"shared_memory": False}),
    "tcp": ({"server.tcp": "true"}, {"shared_memory": False}),
    "ucx": (
        {"server.ucx": "true", "server.allow_open": "true"},
        {"shared_memory": False, "ucx": True},
    ),
}


@pytest.mark.parametrize("path", sorted(PUT_PATHS))
def test_a_put_bigger_than_the_whole_quota_is_refused_alike_on_every_path(
    daemon_factory: DaemonFactory, tmp_path: Path, path: str
) -> None:
    """Nothing pinned, so room could be made: the gRPC stream, which reserves page by page,
    stored such a put page by page (pushing the namespace's own pages out of DRAM) where a batch
    reserve refused it. Every path now refuses it before storing anything."""
    if path == "ucx" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (the `ucx` extra)")
    settings, kwargs = PUT_PATHS[path]
    body = f'[[quota]]\nnamespace = "tenant-a"\ndram = "{PAGES * PAGE_BYTES}"\n'
    d = daemon_factory(
        dram="2MiB",
        config_file=quota_file(tmp_path, body),
        settings={"dram.high_watermark": "1.0", "dram.low_watermark": "1.0", **settings},
    )
    client = d.client(**kwargs)  # type: ignore[arg-type]
    assert client.transport == path
    mine = singles(A, PAGES, seed=60)
    assert client.put(A, mine).stored == PAGES
    before = d.store.counters.quota_refused["tenant-a"]
    with pytest.raises(CapacityExhausted, match="put less at once") as refused:
        client.put(A, singles(A, PAGES + 1, seed=61))
    assert refused.value.retry_after_s == pytest.approx(d.store.tiers.retry_after_s)
    assert d.store.counters.quota_refused["tenant-a"] == before + 1
    # nothing moved: tenant-a's pages are all still in DRAM, and nothing of the put was stored
    assert all(d.tier_of(p.header.key) == (Tier.DRAM,) for p in mine)
    assert d.store.stats().pages == PAGES
    assert d.store.stats().active_leases == 0
    d.check()


def test_a_put_stream_may_not_send_more_pages_than_its_begin_announced(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The stream's size check trusts PutBegin.page_count: a page past it is refused at once
    (it was stored, and the count mismatch only noticed at the end of the stream)."""
    d = quota_daemon(daemon_factory, tmp_path)
    pages = singles(A, 3, seed=62)
    views = [memoryview(bytes(p.payload)) for p in pages]
    requests = list(
        put_requests(A, pages, views, io_class=IoClass.NORMAL, tier=None, chunk_bytes=1 << 20)
    )
    requests[0].begin.page_count = 1
    with pytest.raises(grpc.RpcError) as raised:
        d.stub().Put(iter(requests), timeout=10)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "past the 1 pages PutBegin announced" in (raised.value.details() or "")
    assert d.tier_of(pages[1].header.key) == ()
    d.check()


def test_a_namespaces_quota_covers_its_sub_namespaces(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Pages of "tenant-a#<salt>" (the router's cache_salt pages) count toward tenant-a's quota
    and make room from tenant-a's own pages: a tenant cannot hold more than its quota by using
    many salts, and the per-namespace metrics name tenant-a only (not one label per salt)."""
    d = quota_daemon(daemon_factory, tmp_path, ssd=None)
    client = d.client(shared_memory=False)
    salted = [make_scope(f"tenant-a#salt-{i}") for i in range(3)]
    theirs = singles(B, 4, seed=80)
    put_each(client, B, theirs)
    for i, scope in enumerate(salted):
        put_each(client, scope, singles(scope, PAGES, seed=81 + i))
        assert dram_bytes(d, A) == PAGES * PAGE_BYTES  # salts and all: never over the quota
    # the last salt's pages are the ones left; tenant-b's are untouched
    assert d.store.stats().pages == PAGES + len(theirs)
    assert all(d.tier_of(p.header.key) == (Tier.DRAM,) for p in theirs)
    with pytest.raises(CapacityExhausted, match="put less at once"):
        client.put(salted[0], singles(salted[0], PAGES + 1, seed=90))
    with d.store._lock:
        assert sorted(d.store.index.namespaces()) == ["tenant-a", "tenant-b"]
    samples = scrape(d.info.metrics_url)
    named = {dict(labels).get("namespace") for _, labels in samples} - {None}
    assert named == {"tenant-a", "tenant-b"}  # no label per salt
    assert metric(samples, "strata_namespace_bytes", namespace="tenant-a", tier="dram") == (
        PAGES * PAGE_BYTES
    )
    d.check()


def test_the_retry_hint_travels_in_trailing_metadata(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path)
    client = d.client(shared_memory=False)
    mine = singles(A, PAGES + 1, seed=7)
    client.put(A, mine[:PAGES])
    held = d.store.acquire(A.digest, keys_of(mine[:PAGES]))
    views = [memoryview(bytes(p.payload)) for p in mine[PAGES:]]
    stub = d.stub()
    requests = put_requests(
        A, mine[PAGES:], views, io_class=IoClass.NORMAL, tier=None, chunk_bytes=1 << 20
    )
    with pytest.raises(grpc.RpcError) as raised:
        stub.Put(requests, timeout=10)
    err = raised.value
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.trailing_metadata() or ())
    assert float(trailing["x-strata-retry-after"]) == pytest.approx(d.store.tiers.retry_after_s)
    d.store.release(held.lease_id)
    d.check()


def test_an_ssd_quota_keeps_a_namespace_to_its_share_of_the_ssd(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path, extra=f'ssd = "{4 * PAGE_BYTES}"\n')
    client = d.client(shared_memory=True)
    theirs = singles(B, 6, seed=9)
    client.put(B, theirs, tier=Tier.SSD)
    mine = singles(A, 2 * PAGES + 4, seed=8)
    put_each(client, A, mine)  # each DRAM overflow goes to SSD, where the quota holds
    d.store.drain()
    assert ssd_bytes(d, A) <= 4 * PAGE_BYTES
    assert dram_bytes(d, A) == PAGES * PAGE_BYTES
    assert all(Tier.SSD in d.tier_of(p.header.key) for p in theirs)  # not evicted for tenant-a
    d.check()


def test_pages_of_a_namespace_over_its_share_leave_a_full_tier_first(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path)  # DRAM: 2 MiB = 128 pages
    client = d.client(shared_memory=True)
    mine = singles(A, 2 * PAGES, seed=10)
    put_each(client, A, mine)  # the first PAGES went to SSD
    into = [bytearray(PAGE_BYTES) for _ in range(PAGES)]
    read = client.get(
        A, keys_of(mine[:PAGES]), into, tokens=[p.header.tokens for p in mine[:PAGES]]
    )
    assert read.hit_count == PAGES  # read back into DRAM: tenant-a holds twice its share now
    assert dram_bytes(d, A) == 2 * PAGES * PAGE_BYTES
    # tenant-b fills DRAM: tenant-a's pages over its share leave first, tenant-b's first pages stay
    theirs = singles(B, 128 - PAGES, seed=11)
    for start in range(0, len(theirs), 16):
        client.put(B, theirs[start : start + 16])
    assert dram_bytes(d, A) <= PAGES * PAGE_BYTES
    assert all(Tier.DRAM in d.tier_of(p.header.key) for p in theirs[:16])
    d.check()


def test_namespace_usage_and_refusals_are_on_metrics(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    d = quota_daemon(daemon_factory, tmp_path)
    client = d.client(shared_memory=True)
    mine = singles(A, PAGES + 1, seed=12)
    client.put(A, mine[:PAGES])
    client.put(B, singles(B, 3, seed=13))
    held = d.store.acquire(A.digest, keys_of(mine[:PAGES]))
    with pytest.raises(CapacityExhausted):
        client.put(A, mine[PAGES:])
    d.store.release(held.lease_id)
    m = scrape(d.info.metrics_url)
    used = metric(m, "strata_namespace_bytes", namespace="tenant-a", tier="dram")
    assert used == PAGES * PAGE_BYTES
    assert metric(m, "strata_namespace_bytes", namespace="tenant-b", tier="dram") == 3 * PAGE_BYTES
    limit = metric(m, "strata_namespace_quota_bytes", namespace="tenant-a", tier="dram")
    assert limit == PAGES * PAGE_BYTES
    assert metric(m, "strata_quota_refused_total", namespace="tenant-a") == 1


def test_quota_tables_parse_and_bad_ones_are_clear_errors(tmp_path: Path) -> None:
    good = quota_file(
        tmp_path,
        '[[quota]]\nnamespace = "a"\ndram = "1GiB"\nssd = "4GiB"\n'
        '[[quota]]\ndefault = true\ndram = "256MiB"\n',
    )
    config = load_config(good, env={})
    assert config.quota == (
        NamespaceQuota("a", 1 << 30, 4 << 30),
        NamespaceQuota("", 256 << 20, 0, default=True),
    )
    quotas = Quotas(config.quota)
    assert quotas.limit("a", Tier.DRAM) == 1 << 30 and quotas.limit("a", Tier.SSD) == 4 << 30
    assert quotas.limit("other", Tier.DRAM) == 256 << 20  # the default
    assert quotas.limit("other", Tier.SSD) == 0  # no limit
    assert not Quotas().enabled
    empty = parse_quotas([{"namespace": "", "dram": "1MiB"}])  # the empty namespace, by name
    assert (
        Quotas(empty).limit("", Tier.DRAM) == 1 << 20 and Quotas(empty).limit("x", Tier.DRAM) == 0
    )
    for body, why in (
        ('[[quota]]\nnamespace = "a"\ndram = "lots"\n', "not a size"),
        ('[[quota]]\nnamespace = "a"\nram = "1GiB"\n', "unknown key"),
        ('[[quota]]\ndram = "1GiB"\n', "exactly one of"),
        ('[[quota]]\nnamespace = "a"\ndefault = true\n', "exactly one of"),
        ('[[quota]]\nnamespace = "a"\n[[quota]]\nnamespace = "a"\n', "two"),
        ("[[quota]]\ndefault = true\n[[quota]]\ndefault = true\n", "more than one"),
        ('quota = "a"\n', "array of tables"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            load_config(quota_file(tmp_path, body), env={})
    with pytest.raises(InvalidArgument, match="must be a string"):
        parse_quotas([{"namespace": 3}])


def test_the_index_counts_bytes_per_namespace_and_orders_its_own_pages() -> None:
    """Pure: per-namespace bytes per tier follow residency; a namespace's own candidates come
    least recently used first, pinned ones never; the counts go with the scope's last page."""
    index = Index()
    a = [
        PageEntry(bytes([i]) * 16, A.digest, A.digest, b"h", 100, dram=i * 100) for i in range(1, 4)
    ]
    b = PageEntry(bytes([9]) * 16, B.digest, B.digest, b"h", 100, dram=900)
    for entry in [*a, b]:
        index.insert(entry)
    index.name_scope(A.digest, "tenant-a")
    index.name_scope(B.digest, "tenant-b")
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 300
    assert index.namespace_bytes("tenant-b", StoreTier.DRAM) == 100
    index.touch(a[0].key)  # now the most recent of tenant-a's
    index.pin(a[1].key)
    own = index.digests_of("tenant-a")
    assert [e.key for e in index.scope_candidates(StoreTier.DRAM, own)] == [a[2].key, a[0].key]
    index.set_residency(a[2].key, StoreTier.SSD, True)
    index.set_residency(a[2].key, StoreTier.DRAM, None)
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 200
    assert index.namespace_bytes("tenant-a", StoreTier.SSD) == 100
    index.check_integrity()
    index.unpin(a[1].key)
    for entry in a:
        index.remove(entry.key)
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 0
    assert index.namespace_of(A.digest) is None and index.namespaces() == ["tenant-b"]
    index.check_integrity()


def test_a_namespace_of_many_scopes_keeps_one_running_count_per_tier() -> None:
    """Pure: a namespace's bytes per tier are kept as its scopes' pages come and go (a tenant's
    cache salts are many scopes of one namespace: a put's quota check must not sum them all),
    and check_integrity recomputes them."""
    index = Index()
    scopes = [make_scope(f"tenant-a#{i}") for i in range(50)]
    for i, scope in enumerate(scopes):
        key = (i + 1).to_bytes(16, "big")
        if i % 2:  # named before its page arrives, or after: both count
            index.name_scope(scope.digest, "tenant-a")
        index.insert(PageEntry(key, scope.digest, scope.digest, b"h", 10, dram=i * 16))
        index.name_scope(scope.digest, "tenant-a")
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 500
    first = (1).to_bytes(16, "big")
    index.set_residency(first, StoreTier.SSD, True)
    index.set_residency(first, StoreTier.DRAM, None)
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 490
    assert index.namespace_bytes("tenant-a", StoreTier.SSD) == 10
    index.check_integrity()
    index._ns_bytes["tenant-a"][1] += 1  # a drifted count is caught
    with pytest.raises(RuntimeError, match="per-namespace byte counts"):
        index.check_integrity()
    index._ns_bytes["tenant-a"][1] -= 1
    for i in range(50):
        index.remove((i + 1).to_bytes(16, "big"))
    assert index.namespace_bytes("tenant-a", StoreTier.DRAM) == 0 and index.namespaces() == []
    index.check_integrity()
