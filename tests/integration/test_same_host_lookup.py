"""The lookup's fast path (kvstore/index.py `prefix_tier_codes`, `Store.lookup` on packed keys):
the same answers as the entry-by-entry walk it replaced — the longest present prefix of the
scope, the fastest tier of each hit, a page deleted while leased ending it — and the same
refusals."""

from __future__ import annotations

import grpc
import pytest
from conftest import DaemonFactory, chain, make_scope

from client import Scope
from client.contract.errors import InvalidArgument
from kvstore.keys import Tier
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration


def test_a_lookup_answers_the_present_prefix_with_each_pages_fastest_tier(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(settings={"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"})
    shm, remote = d.client(shared_memory=True), d.client(shared_memory=False)
    pages = chain(scope, 12, seed=400)
    keys = [p.header.key for p in pages]
    assert shm.put(scope, pages[:10]).stored == 10
    d.store.drain()
    for i in (2, 3):  # on SSD only now
        with d.store._lock:
            entry = d.store.index.get(keys[i])
        assert entry is not None and d.store.mover.copy_to_ssd(entry, clear_dram=True)
    want = (Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD, *(Tier.DRAM,) * 6)
    for client in (shm, remote):
        got = client.lookup(scope, keys)
        assert (got.hit_count, got.tiers) == (10, want)
    assert d.store.lookup(scope.digest, keys).tiers == want  # a list of keys
    assert d.store.lookup(scope.digest, b"".join(keys)).codes == bytes(int(t) for t in want)
    # the reply message (built from its wire form) is the one the generated class builds
    reply = d.stub().Lookup(pb.LookupRequest(scope_digest=scope.digest, keys=b"".join(keys)))
    assert reply == pb.LookupResponse(hit_count=10, tiers=[int(t) for t in want])
    # another scope's digest, a short key, an absent first key: the prefix ends there
    assert d.store.lookup(make_scope("other").digest, keys).hit_count == 0
    assert d.store.lookup(scope.digest, [*keys[:4], b"short", *keys[5:]]).hit_count == 4
    assert d.store.lookup(scope.digest, [bytes(16), *keys]).hit_count == 0
    d.check()


def test_a_page_deleted_while_leased_ends_the_prefix_for_new_lookups(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    shm = d.client(shared_memory=True)
    pages = chain(scope, 6, seed=410)
    keys = [p.header.key for p in pages]
    assert shm.put(scope, pages).stored == 6
    held = d.store.acquire(scope.digest, keys[3:4])
    assert held.lease_id and held.pages[0] is not None
    assert shm.delete(keys=keys[3:4]) == 1  # doomed: gone for new readers, kept for the holder
    assert shm.lookup(scope, keys).hit_count == 3
    d.store.release(held.lease_id)
    assert shm.lookup(scope, keys).hit_count == 3  # and gone for good once released
    d.check()


def test_a_lookup_of_malformed_or_too_many_keys_is_refused(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(settings={"limits.max_keys_per_call": "64"})
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        d.store.lookup(scope.digest, bytes(16 * 3 + 5))
    with pytest.raises(InvalidArgument, match="65 keys"):
        d.store.lookup(scope.digest, bytes(16 * 65))
    with pytest.raises(InvalidArgument, match="65 keys"):
        d.store.lookup(scope.digest, [bytes(16)] * 65)
    with pytest.raises(InvalidArgument, match="scope digest"):
        d.store.lookup(b"short", bytes(16))
    # over the lane, the same refusals come back as INVALID_ARGUMENT and the daemon serves on
    shm = d.client(shared_memory=True)
    stub = shm._ready().stub  # the lane stub: send a packed field the SDK would never build
    with pytest.raises(grpc.RpcError, match="multiple of 16"):
        stub.Lookup(pb.LookupRequest(scope_digest=scope.digest, keys=bytes(20)), timeout=5)
    assert shm.lookup(scope, [bytes(16)]).hit_count == 0
