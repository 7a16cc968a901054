"""Integrity of the same-host path with the payload checksum off the writer's path.

A same-host put may leave its payload checksum to the daemon (the header's
FLAG_CHECKSUM_DEFERRED): the daemon computes it when the page's bytes leave DRAM — in an
acquire that hands the page to a remote reader, or when the page is written to SSD — and not
for a page that stays. These tests put such pages exactly as the same-host client does (Reserve with the
deferred headers, a copy into the reserved slots, Commit) and check each way out of DRAM: the
checksum is there, it is right, and a byte flipped after it was computed is caught where the
bytes leave (SSD read back, network receive) — a miss and a count, never wrong bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import (
    Clients,
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    keys_of,
    read_back,
    singles,
    tokens_of,
)

from client import Page, Scope
from client.contract.errors import InvalidArgument
from client.contract.page import PageHeader, checksum_deferred, payload_checksum
from client.transports.shm import reserve_headers
from kvstore.keys import Tier

pytestmark = pytest.mark.integration

NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}


def put_same_host(d: RunningDaemon, scope: Scope, pages: Sequence[Page]) -> int:
    """Put `pages` as the same-host client does: Reserve with `reserve_headers`, copy each
    payload into its slot, Commit. Returns the pages stored."""
    store = d.store
    res = store.reserve(scope, reserve_headers(pages), same_host=True)
    dram = store.tiers.dram
    for slot, page in zip(res.slots, pages, strict=True):
        if slot.reserved:
            with dram.view(slot.offset, slot.length) as view:
                view[:] = page.payload
    return store.commit(res.lease_id, path="shm")


def index_header(d: RunningDaemon, key: bytes) -> bytes:
    with d.store._lock:
        entry = d.store.index.get(key)
        assert entry is not None
        return entry.header


def flip_in_dram(d: RunningDaemon, key: bytes) -> None:
    """Flip one payload byte of a page in the daemon's segment (what a stray write would do)."""
    with d.store._lock:
        entry = d.store.index.get(key)
        assert entry is not None and entry.dram is not None
        with d.store.tiers.dram.view(entry.dram, 1) as view:
            view[0] ^= 0xFF


def test_the_writer_sends_no_checksum_and_nothing_hashes_it_while_it_stays_in_dram(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    shm = d.client(shared_memory=True)
    pages = singles(scope, 3, seed=300)
    sent = reserve_headers(pages)
    assert all(checksum_deferred(raw) for raw in sent)
    assert all(p.header.checksum_pending for p in pages)  # nothing hashed a payload here
    assert put_same_host(d, scope, pages) == 3
    d.store.drain()  # the mover's pass leaves them: their bytes have not left DRAM
    assert all(checksum_deferred(index_header(d, p.header.key)) for p in pages)
    with d.store._lock:
        assert not d.store._unverified
    assert_intact(shm, scope, pages)  # a same-host reader takes them as they are
    assert all(checksum_deferred(index_header(d, p.header.key)) for p in pages)
    got = shm.get(
        scope, keys_of(pages), [bytearray(scope.page_payload_bytes) for _ in pages],
        tokens=tokens_of(pages),
    )  # fmt: skip
    for header, page in zip(got.headers, pages, strict=True):
        assert header is not None and header.checksum_deferred
        assert header == page.header  # a header that knows no checksum equals the page's own
    d.check()


@pytest.mark.parametrize("reader", ["shm", "grpc"])
def test_a_page_not_sealed_yet_reads_back_on_every_path(
    daemon_factory: DaemonFactory, scope: Scope, reader: str
) -> None:
    """The mover is stopped: a same-host reader gets the page as it is; a remote reader's
    acquire computes the checksum first, and the remote client verifies it."""
    d = daemon_factory()
    d.store.mover.stop()
    clients = Clients(d.client(shared_memory=True), d.client(shared_memory=False))
    pages = singles(scope, 4, seed=310)
    assert put_same_host(d, scope, pages) == 4
    client = clients.by_path(reader)
    assert read_back(client, scope, pages) == [bytes(p.payload) for p in pages]
    sealed = [not checksum_deferred(index_header(d, p.header.key)) for p in pages]
    assert sealed == [reader == "grpc"] * 4
    for page in pages if reader == "grpc" else ():
        header = PageHeader.decode(index_header(d, page.header.key))
        assert header.payload_checksum == payload_checksum(page.payload)
        assert header.encode() == page.header.encode()  # what the writer would have sent
    assert client.corrupt_pages == 0
    d.check()


def test_a_page_demoted_before_any_pass_goes_to_ssd_with_its_checksum(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(settings=NO_WATERMARKS)
    d.store.mover.stop()
    shm = d.client(shared_memory=True)
    (page,) = singles(scope, 1, seed=320)
    assert put_same_host(d, scope, [page]) == 1
    key = page.header.key
    with d.store._lock:
        entry = d.store.index.get(key)
    assert entry is not None
    assert d.store.mover.copy_to_ssd(entry, clear_dram=True)
    assert d.tier_of(key) == (Tier.SSD,)
    assert not checksum_deferred(index_header(d, key))
    assert_intact(shm, scope, [page])  # read back from SSD, verified on the way into DRAM
    assert d.store.counters.corrupt_dropped == 0
    d.check()


def test_a_byte_flipped_after_sealing_is_caught_when_the_page_comes_back_from_ssd(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(settings=NO_WATERMARKS)
    shm, remote = d.client(shared_memory=True), d.client(shared_memory=False)
    pages = singles(scope, 2, seed=330)
    assert put_same_host(d, scope, pages) == 2
    assert_intact(remote, scope, pages)  # a remote read sealed them
    bad, good = pages
    flip_in_dram(d, bad.header.key)
    for page in pages:
        with d.store._lock:
            entry = d.store.index.get(page.header.key)
        assert entry is not None and d.store.mover.copy_to_ssd(entry, clear_dram=True)
    before = d.store.counters.corrupt_dropped
    assert read_back(shm, scope, pages) == [None, bytes(good.payload)]
    assert d.store.counters.corrupt_dropped == before + 1
    assert d.tier_of(bad.header.key) == ()  # dropped, not kept to fail again
    d.check()


def test_a_byte_flipped_after_sealing_is_caught_by_a_remote_reader(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    remote = d.client(shared_memory=False)
    pages = singles(scope, 2, seed=340)
    assert put_same_host(d, scope, pages) == 2
    assert_intact(remote, scope, pages)  # the first remote read sealed them
    flip_in_dram(d, pages[0].header.key)
    got = remote.get(
        scope, keys_of(pages), [bytearray(scope.page_payload_bytes) for _ in pages],
        tokens=tokens_of(pages),
    )  # fmt: skip
    assert got.headers[0] is None and got.headers[1] is not None
    assert remote.corrupt_pages == 1


def test_only_a_same_host_reserve_may_leave_the_checksum_to_the_daemon(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    pages = singles(scope, 2, seed=350)
    with pytest.raises(InvalidArgument, match="same-host"):
        d.store.reserve(scope, reserve_headers(pages))  # as a remote put path reserves
    with pytest.raises(InvalidArgument, match="same-host"):
        d.store.plan_put(scope, reserve_headers(pages))
    assert d.store.stats().active_leases == 0
    # with the checksum sent, the same headers are fine anywhere
    assert d.store.plan_put(scope, [p.header.encode() for p in pages]).new == (0, 1)
    d.check()


def test_a_client_put_through_the_sdk_reads_back_intact_on_both_paths(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """Whatever header form the SDK's same-host put sends, the pages come back whole on both
    paths, before and after the daemon's pass."""
    d = daemon_factory()
    clients = Clients(d.client(shared_memory=True), d.client(shared_memory=False))
    pages = singles(scope, 6, seed=360)
    assert clients.shm.put(scope, pages).stored == 6
    assert_intact(clients.grpc, scope, pages[:3])
    d.store.drain()
    assert_intact(clients.shm, scope, pages)
    assert_intact(clients.grpc, scope, pages)
    d.check()
