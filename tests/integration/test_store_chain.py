"""Verified key chains against a live daemon (kvstore/chain.py): a put whose chain does not start
at its scope's digest or at a key of its own scope is refused on every put path with
INVALID_ARGUMENT "chain does not verify", counted, and disturbs nothing — above all, it cannot
pre-publish another namespace's next page (which would turn that tenant's own put into
ALREADY_PRESENT). A child whose parent was evicted or deleted still verifies; a node that holds
none of a page's ancestors verifies it from the put's chain prefixes (a cluster's case)."""

from __future__ import annotations

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
)
from test_store_paths import metric, scrape

from client import Page, PutStatus, Scope, StoreClient, build_pages, make_header
from client.errors import InvalidArgument

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
    with pytest.raises(InvalidArgument, match="chain does not verify: page"):
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
