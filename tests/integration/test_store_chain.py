"""Verified key chains against a live daemon (kvstore/chain.py): a put whose chain does not start
at its scope's digest or at a key of its own scope is refused on every put path with
INVALID_ARGUMENT "chain does not verify", counted, and disturbs nothing — above all, it cannot
pre-publish another namespace's next page (which would turn that tenant's own put into
ALREADY_PRESENT). A child whose parent was evicted or deleted still verifies; a node that holds
none of a page's ancestors verifies it from the put's chain prefixes (a cluster's case).

And the readers' half: every SDK read checks the caller's token ids against each page's header,
so a page served for a key whose tokens are not the caller's (a collision, crafted or not) is a
miss, counted in `GetResult.rejected`, on the sync, async and cluster clients alike."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from conftest import (
    PAGE_TOKENS,
    DaemonFactory,
    RunningDaemon,
    keys_of,
    make_scope,
    payload_for,
    read_back,
    singles,
    tokens_of,
)
from test_store_paths import metric, scrape

from client import (
    AsyncStoreClient,
    ClusterClient,
    IoClass,
    Page,
    PutStatus,
    Scope,
    StoreClient,
    build_pages,
    make_header,
    page_tokens,
)
from client.contract.errors import InvalidArgument
from engine.store_link import StoreLink

pytestmark = pytest.mark.integration

VICTIM, ATTACKER = make_scope("tenant-a"), make_scope("tenant-b")


def prompt_tokens(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + t) % 50_000 for t in range(pages * PAGE_TOKENS)]


def prompt(scope: Scope, seed: int, pages: int) -> list[Page]:
    payloads = [payload_for(seed * 1000 + i, scope.page_payload_bytes) for i in range(pages)]
    return build_pages(scope, prompt_tokens(seed, pages), payloads)


def forged(victim_page: Page, tokens: list[int], seed: int) -> Page:
    """A page of the attacker's scope keyed as the victim's next page: it follows the victim's
    `victim_page` (a key of another scope), so its key is the one the victim will put next."""
    payload = payload_for(seed, ATTACKER.page_payload_bytes)
    return Page(make_header(ATTACKER, victim_page.header.key, tokens, payload), payload)


def client_for(d: RunningDaemon, path: str) -> StoreClient:
    if path == "shm":
        return d.client(shared_memory=True)
    if path == "tcp":
        c = d.client(shared_memory=False)
        assert c.transport == "tcp"
        return c
    if path == "ucx":
        c = d.client(shared_memory=False, ucx=True)
        assert c.transport == "ucx"
        return c
    c = d.client(shared_memory=False, tcp=False)
    assert c.transport == "grpc"
    return c


@pytest.mark.parametrize("path", ["shm", "grpc", "tcp"])
def test_a_page_chained_from_another_namespace_is_refused_and_the_victim_publishes_its_own(
    daemon_factory: DaemonFactory, path: str
) -> None:
    d = daemon_factory(settings={"server.tcp": "true"})
    victim, attacker = d.client(shared_memory=False, tcp=False), client_for(d, path)
    mine = prompt(VICTIM, 1, 3)
    assert victim.put(VICTIM, mine[:2]).stored == 2
    tokens = list(mine[2].header.tokens)
    fake = forged(mine[1], tokens, seed=99)
    # the victim's next key, under the attacker's scope
    assert fake.header.key == mine[2].header.key
    before = d.store.counters.chain_rejected
    with pytest.raises(InvalidArgument, match="chain does not verify"):
        attacker.put(ATTACKER, [fake])
    assert d.store.counters.chain_rejected == before + 1
    d.check()
    assert d.store.stats().active_leases == 0
    # nothing was stored for the attacker; the victim's own put stores its page
    assert d.tier_of(fake.header.key) == ()
    assert victim.put(VICTIM, [mine[2]]).statuses == (PutStatus.STORED,)
    assert read_back(victim, VICTIM, mine) == [bytes(p.payload) for p in mine]
    # and the attacker's own prompts still publish
    theirs = prompt(ATTACKER, 2, 2)
    assert attacker.put(ATTACKER, theirs).stored == 2
    d.check()


@pytest.mark.parametrize("path", ["shm", "grpc"])
def test_a_batch_with_one_bad_link_stores_nothing_of_it_and_disturbs_no_other_page(
    daemon_factory: DaemonFactory, path: str
) -> None:
    d = daemon_factory()
    client = client_for(d, path)
    kept = singles(VICTIM, 3, seed=5)
    assert client.put(VICTIM, kept).stored == 3
    pages = prompt(VICTIM, 3, 4)
    orphan = pages[3]  # follows pages[2], which this put leaves out
    with pytest.raises(InvalidArgument, match="chain does not verify: page 2 "):
        client.put(VICTIM, [*pages[:2], orphan])
    d.check()
    assert d.store.stats().active_leases == 0
    if path == "shm":  # one reservation for the call: none of it was stored
        assert client.lookup(VICTIM, keys_of(pages)).hit_count == 0
    else:  # a stream reserves page by page: the pages before the bad one are stored, intact
        assert client.lookup(VICTIM, keys_of(pages)).hit_count == 2
    assert read_back(client, VICTIM, kept) == [bytes(p.payload) for p in kept]
    assert client.put(VICTIM, pages).stored in (2, 4)
    assert read_back(client, VICTIM, pages) == [bytes(p.payload) for p in pages]
    d.check()


def test_a_child_of_an_evicted_or_deleted_parent_still_verifies(
    daemon_factory: DaemonFactory,
) -> None:
    # 1 MiB of DRAM (64 pages), no SSD: pages leave for good when evicted
    d = daemon_factory(
        dram="1MiB",
        ssd=None,
        settings={"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"},
    )
    client = d.client(shared_memory=True)
    pages = prompt(VICTIM, 4, 4)
    assert client.put(VICTIM, pages[:2]).stored == 2
    for seed in range(4):  # 80 other pages, 20 at a time (a client's share of reservations)
        assert client.put(VICTIM, singles(VICTIM, 20, seed=60 + seed)).stored == 20
    assert client.lookup(VICTIM, keys_of(pages[:2])).hit_count == 0
    assert d.tier_of(pages[1].header.key) == ()
    assert client.put(VICTIM, [pages[2]]).statuses == (PutStatus.STORED,)
    assert client.delete(keys=keys_of(pages[2:3])) == 1
    assert client.put(VICTIM, [pages[3]]).statuses == (PutStatus.STORED,)
    # remembered under its own scope only: another namespace cannot follow it
    fake = forged(pages[3], prompt_tokens(7, 1), seed=7)
    with pytest.raises(InvalidArgument, match="chain does not verify"):
        client.put(ATTACKER, [fake])
    d.check()


def test_chain_prefixes_vouch_for_ancestors_the_node_does_not_hold(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(settings={"server.tcp": "true"})
    tokens = prompt_tokens(8, 5)
    pages = prompt(VICTIM, 8, 5)
    before = tokens[: 3 * PAGE_TOKENS]
    for client in (d.client(shared_memory=True), client_for(d, "grpc"), client_for(d, "tcp")):
        with pytest.raises(InvalidArgument, match="chain does not verify"):
            client.put(VICTIM, [pages[3]])
    shm = d.client(shared_memory=True)
    assert shm.put(VICTIM, [pages[3]], chain_prefixes=[before]).stored == 1
    # a prefix vouches only for keys of the put's own scope: the same tokens do not let
    # the attacker's scope follow the victim's pages
    fake = forged(pages[3], tokens[4 * PAGE_TOKENS :], seed=9)
    with pytest.raises(InvalidArgument, match="chain does not verify"):
        shm.put(ATTACKER, [fake], chain_prefixes=[tokens[: 4 * PAGE_TOKENS]])
    grpc_client = client_for(d, "grpc")
    assert grpc_client.put(VICTIM, [pages[4]], chain_prefixes=[tokens]).stored == 1
    with pytest.raises(InvalidArgument, match="not whole pages"):
        grpc_client.put(VICTIM, [prompt(VICTIM, 9, 2)[1]], chain_prefixes=[tokens[:5]])
    assert read_back(shm, VICTIM, pages[3:]) == [bytes(p.payload) for p in pages[3:]]
    d.check()


def test_refusals_are_counted_on_metrics(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    client = d.client(shared_memory=True)
    mine = prompt(VICTIM, 10, 2)
    client.put(VICTIM, mine[:1])
    for seed in range(3):
        with pytest.raises(InvalidArgument):
            client.put(ATTACKER, [forged(mine[0], prompt_tokens(seed, 1), seed)])
    assert metric(scrape(d.info.metrics_url), "strata_chain_rejected_total") == 3


# ---- every SDK read checks the caller's tokens --------------------------------------------------


def colliding(pages: list[Page]) -> list[tuple[int, ...]]:
    """Token ids a caller would have if its keys collided with `pages`' on page 1: same keys,
    other tokens there (BLAKE2b keys cannot be made to collide; the tokens passed can)."""
    tokens = tokens_of(pages)
    tokens[1] = tuple((t + 1) % 50_000 for t in tokens[1])
    return tokens


@pytest.mark.parametrize(
    "path",
    [
        "shm",
        "grpc",
        "tcp",
        pytest.param(
            "ucx",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"
            ),
        ),
    ],
)
def test_a_page_whose_tokens_are_not_the_callers_is_a_miss(
    daemon_factory: DaemonFactory, path: str
) -> None:
    bulk = {"server.ucx": "true", "server.allow_open": "true"} if path == "ucx" else {}
    d = daemon_factory(settings={"server.tcp": "true", **bulk})
    client = client_for(d, path)
    pages = prompt(VICTIM, 11, 3)
    assert client.put(VICTIM, pages).stored == 3
    into = [bytearray(VICTIM.page_payload_bytes) for _ in pages]
    got = client.get(VICTIM, keys_of(pages), into, tokens=colliding(pages))
    assert [h is not None for h in got.headers] == [True, False, True]
    assert got.rejected == 1 and got.prefix_hits == 1
    assert bytes(into[0]) == bytes(pages[0].payload)
    good = client.get(VICTIM, keys_of(pages), into, tokens=tokens_of(pages))
    assert good.hit_count == 3 and good.rejected == 0
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    # the tokens must fit the keys: one full page of ids per key, checked before any call
    with pytest.raises(InvalidArgument, match="token lists"):
        client.get(VICTIM, keys_of(pages), into, tokens=tokens_of(pages)[:2])
    with pytest.raises(InvalidArgument, match="a page of this scope"):
        client.get(VICTIM, keys_of(pages[:1]), into[:1], tokens=[(1, 2, 3)])
    # a prompt's pages split by `page_tokens`, as the engine does
    ids = prompt_tokens(11, 3)
    assert client.get(VICTIM, keys_of(pages), into, tokens=page_tokens(VICTIM, ids)).hit_count == 3
    d.check()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_the_async_client_checks_tokens_too(
    daemon_factory: DaemonFactory, shared_memory: bool
) -> None:
    d = daemon_factory()
    pages = prompt(VICTIM, 12, 3)

    async def scenario() -> tuple[list[bool], int, int]:
        async with AsyncStoreClient(d.address, shared_memory=shared_memory) as client:
            await client.put(VICTIM, pages)
            into = [bytearray(VICTIM.page_payload_bytes) for _ in pages]
            bad = await client.get(VICTIM, keys_of(pages), into, tokens=colliding(pages))
            good = await client.get(VICTIM, keys_of(pages), into, tokens=tokens_of(pages))
            return [h is not None for h in bad.headers], bad.rejected, good.hit_count

    assert asyncio.run(scenario()) == ([True, False, True], 1, 3)


def test_the_cluster_client_checks_tokens_and_verifies_chains_across_nodes(
    daemon_factory: DaemonFactory,
) -> None:
    nodes = [daemon_factory() for _ in range(3)]
    pages = prompt(VICTIM, 13, 12)
    with ClusterClient(addresses=[n.address for n in nodes], replicas=1) as client:
        # one replica each: most pages land on a node that holds not their parent
        assert client.put(VICTIM, pages).stored == 12
        spread = [len(n.store.index) for n in nodes]
        assert sum(spread) == 12 and max(spread) < 12
        # a continuation alone, with the tokens before it: every node verifies its pages
        tail = prompt(VICTIM, 14, 6)
        ids = prompt_tokens(14, 6)
        result = client.put(VICTIM, tail[3:], prefix_tokens=ids[: 3 * PAGE_TOKENS])
        assert result.stored == 3
        into = [bytearray(VICTIM.page_payload_bytes) for _ in pages]
        got = client.get(VICTIM, keys_of(pages), into, tokens=colliding(pages))
        assert [h is not None for h in got.headers][:3] == [True, False, True]
        assert got.rejected == 1
        good = client.get(VICTIM, keys_of(pages), into, tokens=tokens_of(pages))
        assert good.hit_count == 12
        assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    for n in nodes:
        n.check()


def test_an_engine_publishing_the_middle_of_a_prompt_to_a_cluster_stores_every_page(
    daemon_factory: DaemonFactory,
) -> None:
    """The engine's publisher sends the prompt's earlier tokens with each job, so a cluster node
    that holds none of a page's ancestors still verifies it (and the pull checks the tokens)."""
    nodes = [daemon_factory() for _ in range(3)]
    ids = prompt_tokens(15, 10)
    pages = prompt(VICTIM, 15, 10)
    with ClusterClient(addresses=[n.address for n in nodes], replicas=1) as cluster:
        link = StoreLink(cluster)
        try:
            first = 4  # pages 0..3 were "cached" elsewhere: the job starts at page 4
            ticket = link.publish(
                VICTIM,
                pages[first - 1].header.key,
                [p.header.tokens for p in pages[first:]],
                [bytes(p.payload) for p in pages[first:]],
                prefix_tokens=ids[: first * PAGE_TOKENS],
            )
            assert ticket.wait(30) and ticket.stored == len(pages) - first
            keys = keys_of(pages[first:])
            assert cluster.lookup(VICTIM, keys).hit_count == len(keys)
            head = link.publish(
                VICTIM,
                VICTIM.digest,
                [p.header.tokens for p in pages[:first]],
                [bytes(p.payload) for p in pages[:first]],
            )
            assert head.wait(30) and head.stored == first
            size = VICTIM.page_payload_bytes
            got = link.fetch(VICTIM, ids, keys_of(pages), size, IoClass.NORMAL)
            assert got.result.pages == len(pages) and got.result.rejected == 0
            assert [bytes(b) for b in got.payloads] == [bytes(p.payload) for p in pages]
        finally:
            link.close()
    assert sum(d.store.counters.chain_rejected for d in nodes) == 0
    for n in nodes:
        n.check()
