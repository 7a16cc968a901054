"""Put statuses around leases: a page deleted while a reader holds it, and a key being written by
another client's reservation (DESIGN §5). Each status says what happened, and nothing put is
lost."""

from __future__ import annotations

import pytest
from conftest import PAGE_TOKENS, Clients, DaemonFactory, keys_of, payload_for, read_back

from client import Page, PutStatus, Scope, build_pages
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration


def same_key_pages(scope: Scope, seed: int) -> tuple[Page, Page]:
    """Two versions of one page: same tokens (so the same key), different payloads."""
    tokens = [(seed * 13 + t) % 50_000 for t in range(PAGE_TOKENS)]
    size = scope.page_payload_bytes
    (a,) = build_pages(scope, tokens, [payload_for(seed, size)])
    (b,) = build_pages(scope, tokens, [payload_for(seed + 1, size)])
    assert a.header.key == b.header.key and bytes(a.payload) != bytes(b.payload)
    return a, b


@pytest.mark.parametrize("path", ["shm", "grpc"])
def test_a_page_put_again_after_a_delete_while_leased_survives_the_lease(
    daemon_factory: DaemonFactory, scope: Scope, path: str
) -> None:
    d = daemon_factory()
    clients = Clients(d.client(shared_memory=True), d.client(shared_memory=False))
    client = clients.by_path(path)
    old, new = same_key_pages(scope, 40)
    assert client.put(scope, [old]).statuses == (PutStatus.STORED,)
    held = d.store.acquire(scope.digest, keys_of([old]))  # a reader holds the page
    assert held.lease_id
    assert client.delete(keys=keys_of([old])) == 1
    assert client.lookup(scope, keys_of([old])).hit_count == 0  # gone for new readers
    # the put is stored (not "already present": the old page is on its way out) ...
    assert client.put(scope, [new]).statuses == (PutStatus.STORED,)
    d.check()
    assert client.put(scope, [new]).statuses == (PutStatus.ALREADY_PRESENT,)
    # ... and it is what a reader gets once the old page's last lease ends
    assert d.store.release(held.lease_id)
    d.check()
    assert read_back(client, scope, [new]) == [bytes(new.payload)]
    assert client.lookup(scope, keys_of([new])).hit_count == 1
    d.check()


def test_deleting_a_page_waiting_to_replace_one_deletes_it(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    shm = d.client(shared_memory=True)
    old, new = same_key_pages(scope, 50)
    shm.put(scope, [old])
    held = d.store.acquire(scope.digest, keys_of([old]))
    shm.delete(keys=keys_of([old]))
    assert shm.put(scope, [new]).statuses == (PutStatus.STORED,)
    assert shm.delete(keys=keys_of([new])) == 1
    d.check()
    d.store.release(held.lease_id)
    assert read_back(shm, scope, [new]) == [None]
    d.check()


def test_a_key_pending_in_another_reservation_is_pending_until_that_lease_ends(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(clock=True)
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    page, _ = same_key_pages(scope, 60)
    stub = d.stub()
    # another writer holds a reservation for the key (and then stalls, or dies)
    res = stub.Reserve(
        pb.ReserveRequest(scope=scope.encode(), headers=[page.header.encode()]), timeout=10
    )
    assert res.slots[0].reserved
    for client in (shm, rpc):
        assert client.put(scope, [page]).statuses == (PutStatus.PENDING,)
    assert rpc.lookup(scope, keys_of([page])).hit_count == 0
    # the other writer's lease runs out: the key is free again
    assert d.clock is not None
    d.clock.advance(3600)
    d.store.reap_leases()
    assert shm.put(scope, [page]).statuses == (PutStatus.STORED,)
    assert read_back(rpc, scope, [page]) == [bytes(page.payload)]
    # its late commit is refused and stores nothing over the page
    with pytest.raises(Exception, match="expired"):
        stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10)
    assert read_back(shm, scope, [page]) == [bytes(page.payload)]
    d.check()


def test_a_key_committed_by_the_other_writer_is_then_already_present(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    shm = d.client(shared_memory=True)
    page, _ = same_key_pages(scope, 70)
    stub = d.stub()
    res = stub.Reserve(
        pb.ReserveRequest(scope=scope.encode(), headers=[page.header.encode()]), timeout=10
    )
    assert shm.put(scope, [page]).statuses == (PutStatus.PENDING,)
    stub.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10)
    assert shm.put(scope, [page]).statuses == (PutStatus.ALREADY_PRESENT,)
    d.check()
