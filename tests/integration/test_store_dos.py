"""No handful of clients can deny service: each attack of a review of the daemon, as a test.

16 long-lived streams (stalled puts, Watch streams without a deadline) against a server of 8
threads; 8 TCP data connections each announcing a 72 MiB frame and sending nothing more; one
Reserve of all of DRAM with a 600 s lease; a lookup of 4M keys. After each, other clients are
served (and the attack's own cost to the daemon is bounded).
"""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import grpc
import pytest
from conftest import PAGE_BYTES, DaemonFactory, assert_intact, keys_of, singles

from client import PutStatus, Scope, StoreClient
from client.transports.ucx_protocol import KIND_PUT, parse_address, preamble
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_long_lived_streams_do_not_starve_other_calls(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()  # 8 server threads in the tests
    assert d.config.server.workers == 8
    stall = threading.Event()
    stubs = [d.stub() for _ in range(4)]  # four connections
    calls: list[grpc.Future[object]] = []

    def stalled_put() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(begin=pb.PutBegin(scope=scope.encode(), page_count=1))
        stall.wait(60)  # then nothing more, for as long as the test lasts

    def held_after_refusals(group: list[grpc.Future[object]], held_at_most: int) -> int:
        """Wait (bounded) until all but `held_at_most` of `group` were refused; how many are
        still held then. Every refusal is RESOURCE_EXHAUSTED."""
        deadline = time.monotonic() + 20
        while sum(c.done() for c in group) < len(group) - held_at_most:
            assert time.monotonic() < deadline, "streams beyond the limit were not refused"
            threading.Event().wait(0.01)
        for c in group:
            if c.done():
                err = c.exception()
                assert err is not None
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        return sum(not c.done() for c in group)

    try:
        # one connection alone gets no more than its share
        alone = d.stub()
        mine = [alone.Watch(pb.WatchRequest()) for _ in range(8)]
        share = d.config.streams_per_client
        assert held_after_refusals(mine, share) == share
        for call in mine:
            call.cancel()
        for n in range(16):  # 8 stalled puts and 8 watches without a deadline
            stub = stubs[n % 4]
            calls.append(stub.Put.future(stalled_put()) if n % 2 else stub.Watch(pb.WatchRequest()))
        # at most the stream slots are held; the rest are refused at once, with a retry hint
        assert held_after_refusals(calls, d.config.stream_slots) <= d.config.stream_slots
        # and the threads left serve everyone else's calls, within a short deadline
        client = StoreClient(d.address, shared_memory=True, timeout_s=3.0, retries=0)
        try:
            assert client.lookup(scope, keys_of(singles(scope, 2, seed=1))).hit_count == 0
            pages = singles(scope, 4, seed=2)
            assert client.put(scope, pages).statuses == (PutStatus.STORED,) * 4
            assert_intact(client, scope, pages)
            assert client.stats().pages >= 4
        finally:
            client.close()
    finally:
        stall.set()
        for call in calls:
            call.cancel()
    # once they are gone, streams are served again
    remote = d.client(shared_memory=False)
    assert_intact(remote, scope, pages)
    d.check()


def test_frame_headers_announcing_72_mib_commit_no_memory(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(settings={"server.tcp": "true"})
    host, port = parse_address(d.info.tcp_address)
    before = rss_bytes()
    socks = []
    try:
        for _ in range(8):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(preamble(KIND_PUT, 1, 72 << 20))  # ... and then nothing
            socks.append(s)
        # a real client is served meanwhile (the headers above were read by now: one loop)
        client = StoreClient(d.address, shared_memory=False, tcp=True, timeout_s=5.0)
        try:
            scope_pages = singles(_scope(), 2, seed=3)
            assert client.put(_scope(), scope_pages).stored == 2
            assert_intact(client, _scope(), scope_pages)
        finally:
            client.close()
        grown = rss_bytes() - before
        assert grown < 64 << 20, f"the daemon grew by {grown >> 20} MiB for 8 idle headers"
    finally:
        for s in socks:
            s.close()


def _scope() -> Scope:
    from conftest import make_scope

    return make_scope()


def test_one_client_cannot_reserve_all_of_dram_for_long(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory(dram="1MiB", settings={"dram.high_watermark": "1.0"})
    stub = d.stub()
    everything = singles(scope, (1 << 20) // PAGE_BYTES, seed=4)
    with pytest.raises(grpc.RpcError) as err:
        stub.Reserve(
            pb.ReserveRequest(
                scope=scope.encode(),
                headers=[p.header.encode() for p in everything],
                lease_ms=600_000,
                client_pid=12345,
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # half of DRAM is its share; its lease is cut to the reservation limit, not 600 s
    half = everything[: len(everything) // 2]
    asked = time.time()
    res = stub.Reserve(
        pb.ReserveRequest(
            scope=scope.encode(),
            headers=[p.header.encode() for p in half],
            lease_ms=600_000,
            client_pid=12345,
        ),
        timeout=10,
    )
    assert all(s.reserved for s in res.slots)
    assert (
        res.lease_expires_unix_ms / 1000 - asked <= d.config.limits.max_reserve_lease_ms / 1000 + 1
    )
    # nor can it stretch the reservation with a Renew of 600 s
    renewed = stub.Renew(pb.RenewRequest(lease_id=res.lease_id, lease_ms=600_000), timeout=10)
    assert (
        renewed.lease_expires_unix_ms / 1000 - time.time()
        <= d.config.limits.max_reserve_lease_ms / 1000 + 1
    )
    # nor take another half by claiming to be another process on the same connection
    with pytest.raises(grpc.RpcError) as err:
        stub.Reserve(
            pb.ReserveRequest(
                scope=scope.encode(),
                headers=[p.header.encode() for p in everything[len(half) :]],
                client_pid=12346,
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # everyone else still puts (into the other half)
    other = d.client(shared_memory=True)
    pages = singles(scope, len(everything) // 2 - 1, seed=5)
    for i in range(0, len(pages), 8):
        assert other.put(scope, pages[i : i + 8]).stored == len(pages[i : i + 8])
    d.check()


def test_a_4m_key_lookup_is_refused_before_it_is_decoded(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    d = daemon_factory()
    stub = d.stub()
    keys = bytes(16) * (4 << 20)  # 64 MiB of keys: fits the message limit, not the key limit
    tracemalloc.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(scope_digest=scope.digest, keys=keys), timeout=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keys" in (err.value.details() or "")
    # the request itself is 64 MiB (the client's message, its encoding, the server's copy);
    # splitting it into 4M keys, as before the check, took 240 MiB more
    assert peak < 4 * len(keys), f"peak {peak >> 20} MiB"
    client = d.client(shared_memory=False)
    assert client.lookup(scope, keys_of(singles(scope, 1, seed=6))).hit_count == 0
