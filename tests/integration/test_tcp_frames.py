"""The TCP data path's frames on the wire (client/transports/tcp_protocol.py <-> kvstore/tcp_server.py),
spoken by hand and through both drivers (blocking `TcpTransport`, asyncio `AsyncTcpTransport`).

A get that misses is answered in its one round trip and is a miss; a PUT_PAGES frame carries
several pages; a lookup goes over the same connection as gets and puts; a truncated or garbled
frame is refused and the daemon keeps serving; a connection dropped mid-get leaks no lease.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from conftest import DaemonFactory, RunningDaemon, buffers, keys_of, make_scope, tokens_of
from test_ucx_path import LARGE, SMALL, prompt

import kvstore.tcp_server
from client import Page
from client.contract.errors import InvalidArgument, PermissionDenied
from client.contract.scope import Scope
from client.contract.types import PutStatus, Tier
from client.transports.tcp_protocol import (
    KIND_LOOKUP,
    KIND_LOOKUP_HITS,
    KIND_PUT_PAGES,
    GetOutcome,
    LookupHits,
    encode_put_pages,
)
from client.transports.tcp_transport import AsyncTcpTransport, TcpTransport
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_MANIFEST,
    MAGIC,
    PREAMBLE,
    VERSION,
    decode_error,
    decode_manifest,
    parse_address,
    preamble,
)
from client.transports.ucx_transport import UcxTransport
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

TCP_ON = {"server.tcp": "true"}


def _connect(daemon: RunningDaemon, rcvbuf: int = 0) -> socket.socket:
    host, port = parse_address(daemon.info.tcp_address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((host, port))
    return sock


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        assert part, "connection closed"
        out += part
    return bytes(out)


def _frame(sock: socket.socket) -> tuple[int, int, bytes]:
    _, _, kind, aux, meta_bytes = PREAMBLE.unpack(_read(sock, PREAMBLE.size))
    return kind, aux, _read(sock, meta_bytes) if meta_bytes else b""


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def get_frame(scope: Scope, keys: list[bytes]) -> bytes:
    meta = pb.GetRequest(scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(keys))
    raw = meta.SerializeToString()
    return preamble(KIND_GET, 0, len(raw)) + raw


def lookup_frame(scope: Scope, keys: list[bytes]) -> bytes:
    meta = pb.LookupRequest(scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(keys))
    raw = meta.SerializeToString()
    return preamble(KIND_LOOKUP, 0, len(raw)) + raw


def put_frame(scope: Scope, pages: list[Page], begin: bytes | None = None) -> bytes:
    raw_begin = (
        begin
        if begin is not None
        else pb.PutBegin(scope=scope.encode(), page_count=len(pages)).SerializeToString()
    )
    meta = encode_put_pages(
        raw_begin, [p.header.encode() for p in pages], [len(p.payload) for p in pages]
    )
    payloads = b"".join(bytes(p.payload) for p in pages)
    return preamble(KIND_PUT_PAGES, len(pages), len(meta)) + meta + payloads


def _no_leases(daemon: RunningDaemon) -> None:
    assert wait_for(lambda: daemon.store.stats().active_leases == 0, timeout_s=10)


def test_a_missing_get_is_answered_in_its_one_round_trip(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 2, seed=5)
    missing = keys_of(pages)
    with _connect(daemon) as sock:
        # a get and a lookup sent back to back: the get needs nothing more from the client
        sock.sendall(get_frame(scope, missing) + lookup_frame(scope, missing))
        kind, count, meta = _frame(sock)
        assert (kind, count) == (KIND_MANIFEST, 2)
        assert [e.present for e in decode_manifest(meta, 2)] == [False, False]
        assert _frame(sock) == (KIND_LOOKUP_HITS, 0, b"")
    transport = TcpTransport(daemon.info.tcp_address)
    try:
        request = pb.GetRequest(
            scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(missing)
        ).SerializeToString()
        out = transport.get(
            request,
            scope.digest,
            missing,
            [memoryview(b) for b in buffers(scope, 2)],
            verify=True,
            timeout_s=10,
        )
        assert (out.headers, out.corrupt) == ((None, None), 0)
    finally:
        transport.close()
    assert daemon.store.stats().active_leases == 0
    daemon.check()


def test_one_frame_carries_several_pages_and_stays_in_step(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 3, seed=6)
    with _connect(daemon) as sock:
        sock.sendall(put_frame(scope, pages))
        assert _frame(sock) == (KIND_DONE, 3, bytes([PutStatus.STORED] * 3))
        # again: the daemon holds them, reads the payloads and drops them, and stays in step
        sock.sendall(put_frame(scope, pages) + lookup_frame(scope, keys_of(pages)))
        assert _frame(sock) == (KIND_DONE, 3, bytes([PutStatus.ALREADY_PRESENT] * 3))
        assert _frame(sock) == (KIND_LOOKUP_HITS, 3, bytes([Tier.DRAM] * 3))
    client = daemon.client(shared_memory=False)
    into = buffers(scope, 3)
    assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


def test_garbled_and_truncated_frames_are_refused_and_the_daemon_serves_on(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 2, seed=8)
    with _connect(daemon) as sock:  # a foreign magic: the connection ends
        sock.sendall(PREAMBLE.pack(MAGIC ^ 0x0101, VERSION, KIND_GET, 0, 0))
        assert _closed(sock)
    with _connect(daemon) as sock:  # an unknown frame kind: the connection ends
        sock.sendall(preamble(42, 0, 0))
        assert _closed(sock)
    with _connect(daemon) as sock:  # sizes of the payloads missing: refused, then closed
        sock.sendall(preamble(KIND_PUT_PAGES, 4, 3) + b"abc")
        kind, code, meta = _frame(sock)
        assert kind == KIND_ERROR and isinstance(decode_error(code, meta), InvalidArgument)
        assert _closed(sock)
    with _connect(daemon) as sock:  # a garbled PutBegin: refused, payloads read, still in step
        sock.sendall(put_frame(scope, pages, begin=b"\xff\xff\xff") + lookup_frame(scope, []))
        kind, code, meta = _frame(sock)
        assert kind == KIND_ERROR and isinstance(decode_error(code, meta), InvalidArgument)
        assert _frame(sock) == (KIND_LOOKUP_HITS, 0, b"")
    with _connect(daemon) as sock:  # a garbled GetRequest: refused, still in step
        sock.sendall(preamble(KIND_GET, 0, 3) + b"\xff\xff\xff" + lookup_frame(scope, []))
        kind, code, meta = _frame(sock)
        assert kind == KIND_ERROR and isinstance(decode_error(code, meta), InvalidArgument)
        assert _frame(sock) == (KIND_LOOKUP_HITS, 0, b"")
    with _connect(daemon) as sock:  # a put cut short: nothing stored
        frame = put_frame(scope, pages)
        sock.sendall(frame[: len(frame) - 100])
    _no_leases(daemon)
    assert daemon.store.stats().pages == 0
    client = daemon.client(shared_memory=False)
    assert client.put(scope, pages).stored == 2
    daemon.check()


def test_a_connection_dropped_mid_get_leaks_no_lease(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="128MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 16, seed=9)  # 24 MiB: more than both sockets' buffers hold
    client = daemon.client(shared_memory=False)
    assert client.put(scope, pages).stored == 16
    for _ in range(3):
        with _connect(daemon, rcvbuf=64 << 10) as sock:
            sock.sendall(get_frame(scope, keys_of(pages)))
            kind, count, _ = _frame(sock)
            assert (kind, count) == (KIND_MANIFEST, 16)
            _read(sock, 1 << 20)  # part of the first payload, then gone
    _no_leases(daemon)
    into = buffers(scope, 16)
    assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 16
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    daemon.check()


def test_lookup_over_tcp_is_the_grpc_lookup_with_the_same_checks(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 5, seed=10)
    rpc = daemon.client(shared_memory=False, tcp=False)
    assert rpc.put(scope, pages[:3]).stored == 3
    transport = TcpTransport(daemon.info.tcp_address)
    try:
        for keys in (keys_of(pages), keys_of(pages)[1:], keys_of(pages)[:2]):
            request = pb.LookupRequest(
                scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(keys)
            ).SerializeToString()
            got = transport.lookup(request, len(keys), timeout_s=10)
            want = rpc.lookup(scope, keys)
            assert (got.hit_count, got.tiers) == (want.hit_count, want.tiers)
        wrong = pb.LookupRequest(
            scope_digest=make_scope("other", layout=SMALL).digest,
            scope=scope.encode(),
            keys=b"".join(keys_of(pages)),
        ).SerializeToString()
        with pytest.raises(InvalidArgument, match="scope_digest"):
            transport.lookup(wrong, 5, timeout_s=10)
        assert transport.lookup(request, 2, timeout_s=10).hit_count == 2  # still in step
    finally:
        transport.close()


@pytest.mark.parametrize("entry", ["AsyncTcpTransport", "UcxTransport.*_async"])
def test_the_asyncio_driver_puts_gets_and_looks_up(
    daemon_factory: DaemonFactory, entry: str
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 3, seed=12)
    keys = keys_of(pages)
    begin = pb.PutBegin(scope=scope.encode(), page_count=3).SerializeToString()
    get = pb.GetRequest(
        scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(keys)
    ).SerializeToString()
    lookup = pb.LookupRequest(
        scope_digest=scope.digest, scope=scope.encode(), keys=b"".join(keys)
    ).SerializeToString()
    headers = [p.header.encode() for p in pages]
    payloads = [memoryview(p.payload) for p in pages]

    async def direct(into: list[memoryview]) -> tuple[object, ...]:
        transport = AsyncTcpTransport(daemon.info.tcp_address)
        try:
            await transport.open(10)
            statuses = await transport.put(begin, headers, payloads, timeout_s=10)
            got = await transport.get(get, scope.digest, keys, into, verify=True, timeout_s=10)
            hits = await transport.lookup(lookup, 3, timeout_s=10)
        finally:
            transport.close()
        return statuses, got, hits

    async def via_link(into: list[memoryview]) -> tuple[object, ...]:
        transport = UcxTransport(daemon.info.tcp_address)
        try:
            statuses = await transport.put_async(begin, headers, payloads, timeout_s=10)
            got = await transport.get_async(
                get, scope.digest, keys, into, verify=True, timeout_s=10
            )
            hits = await transport.lookup_async(lookup, 3, timeout_s=10)
        finally:
            transport.close()
        return statuses, got, hits

    into = [memoryview(b) for b in buffers(scope, 3)]
    run = direct if entry == "AsyncTcpTransport" else via_link
    statuses, got, hits = asyncio.run(run(into))
    assert statuses == (PutStatus.STORED,) * 3
    assert isinstance(got, GetOutcome) and isinstance(hits, LookupHits)
    assert ([h is not None for h in got.headers], hits.hit_count) == ([True] * 3, 3)
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    _no_leases(daemon)


def test_connections_beyond_the_cap_are_closed_until_some_end(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvstore.tcp_server, "MAX_CONNECTIONS", 2)
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=SMALL)
    server = daemon.daemon._tcp
    assert server is not None
    held = [_connect(daemon), _connect(daemon)]
    assert wait_for(lambda: server.connection_count() == 2, timeout_s=5)
    with _connect(daemon) as extra:
        assert _closed(extra)  # over the cap: closed at once
    for sock in held:
        sock.sendall(lookup_frame(scope, []))
        assert _frame(sock) == (KIND_LOOKUP_HITS, 0, b"")  # the others are served on
    held.pop().close()
    assert wait_for(lambda: server.connection_count() == 1, timeout_s=5)
    with _connect(daemon) as again:
        again.sendall(lookup_frame(scope, []))
        assert _frame(again) == (KIND_LOOKUP_HITS, 0, b"")
    held[0].close()


def test_an_idle_connection_is_closed_and_the_transport_goes_on_over_a_new_one(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(
        dram="64MiB", ssd=None, settings={**TCP_ON, "server.tcp_idle_timeout_s": "0.3"}
    )
    scope = make_scope(layout=SMALL)
    server = daemon.daemon._tcp
    assert server is not None
    with _connect(daemon) as busy, _connect(daemon) as idle:
        busy.sendall(lookup_frame(scope, []))
        assert _frame(busy) == (KIND_LOOKUP_HITS, 0, b"")
        assert _closed(idle)  # no frame within the idle timeout: closed by the daemon
    assert wait_for(lambda: server.connection_count() == 0, timeout_s=5)
    transport = TcpTransport(daemon.info.tcp_address)
    try:
        transport.open(5)
        assert wait_for(lambda: server.connection_count() == 0, timeout_s=5)  # kept one closed
        request = pb.LookupRequest(
            scope_digest=scope.digest, keys=b"", scope=scope.encode()
        ).SerializeToString()
        assert transport.lookup(request, 0, timeout_s=5).hit_count == 0  # over a new one
    finally:
        transport.close()


def test_a_same_host_put_whose_checksum_the_daemon_computes_is_served_verified_over_tcp(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 3, seed=14)
    local = daemon.client(shared_memory=True)
    assert local.transport == "shm"
    assert local.put(scope, pages).stored == 3
    remote = daemon.client(shared_memory=False)
    assert remote.transport == "tcp"
    into = buffers(scope, 3)
    got = remote.get(scope, keys_of(pages), into, tokens=tokens_of(pages), verify=True)
    assert got.hit_count == 3 and got.rejected == 0
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    assert [h.payload_checksum for h in got.headers] == [p.header.payload_checksum for p in pages]


def test_a_lookup_over_tcp_is_checked_against_the_connections_principal(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    from test_store_data_path_auth import TOKENS, A, B, _client, _daemon

    daemon = _daemon(daemon_factory, tmp_path, **TCP_ON)
    a = _client(daemon, "engine-a", tcp=True)
    b = _client(daemon, "engine-b", tcp=True)
    pages = prompt(A, 3, seed=21)
    assert a.put(A, pages).stored == 3
    assert a.lookup(A, keys_of(pages)).hit_count == 3
    with pytest.raises(PermissionDenied):
        b.lookup(A, keys_of(pages))
    assert (a.transport, b.transport) == ("tcp", "tcp")  # a refusal is no transport failure
    transport = TcpTransport(daemon.info.tcp_address, token=TOKENS["engine-b"])
    try:
        request = pb.LookupRequest(
            scope_digest=A.digest, scope=A.encode(), keys=b"".join(keys_of(pages))
        ).SerializeToString()
        with pytest.raises(PermissionDenied):
            transport.lookup(request, 3, timeout_s=10)
        own = pb.LookupRequest(
            scope_digest=B.digest, scope=B.encode(), keys=b"".join(keys_of(pages))
        ).SerializeToString()
        assert transport.lookup(own, 3, timeout_s=10).hit_count == 0  # served on
    finally:
        transport.close()
