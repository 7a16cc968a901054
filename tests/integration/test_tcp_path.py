"""The TCP bulk data path (client/transports/tcp_protocol.py, driven in the caller's thread by
client/transports/tcp_transport.py <-> kvstore/tcp_server.py) against gRPC.

The same calls give the same results and byte-identical payloads over TCP and gRPC, for small
and > 1 MiB pages; a payload corrupted on the wire is refused (nothing stored); a client that
vanishes mid-transfer leaves no lease behind; kept connections are reused, and one the daemon
closed is replaced; a client falls back to gRPC when the listener goes; how the client chooses
between UCX, TCP and gRPC.
"""

from __future__ import annotations

import importlib.util
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import DaemonFactory, RunningDaemon, buffers, keys_of, make_scope, tokens_of
from test_ucx_path import LARGE, LAYOUTS, MEDIUM, SMALL, layout_bytes, prompt, transcript

from client import KVLayout, Page, StoreClient
from client.contract.errors import Corrupt, Unavailable
from client.transports.tcp_protocol import KIND_PUT_PAGES, encode_put_pages
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    PREAMBLE,
    parse_address,
    parse_preamble,
    preamble,
)
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

TCP_ON = {"server.tcp": "true"}
HAVE_UCXX = importlib.util.find_spec("ucxx") is not None


def _no_leases(daemon: RunningDaemon) -> None:
    assert wait_for(lambda: daemon.store.stats().active_leases == 0, timeout_s=10)


def tcp_and_grpc(daemon: RunningDaemon) -> tuple[StoreClient, StoreClient]:
    tcp = daemon.client(shared_memory=False)  # auto: the daemon offers TCP, not UCX
    rpc = daemon.client(shared_memory=False, tcp=False)
    assert (tcp.transport, rpc.transport) == ("tcp", "grpc")
    return tcp, rpc


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_same_results_over_tcp_and_grpc(daemon_factory: DaemonFactory, layout: KVLayout) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    assert daemon.info.tcp_address.startswith("tcp://127.0.0.1:")
    tcp, rpc = tcp_and_grpc(daemon)
    pages = {name: prompt(make_scope(name, layout=layout), 5, seed=7) for name in ("t", "g")}
    a = transcript(tcp, make_scope("t", layout=layout), pages["t"])
    b = transcript(rpc, make_scope("g", layout=layout), pages["g"])
    assert a == b
    scope = make_scope("t", layout=layout)
    want = [bytes(p.payload) for p in pages["t"]]
    assert a[4] == [want[0], None, *want[1:]]
    into = buffers(scope, 5)
    assert (
        rpc.get(scope, keys_of(pages["t"]), into, tokens=tokens_of(pages["t"])).hit_count == 5
    )  # what TCP wrote, gRPC reads
    assert [bytes(b) for b in into] == want
    moved = daemon.store.counters.bytes_moved
    for direction in ("in", "out"):
        total = sum(v for (path, d, _), v in moved.items() if path == "tcp" and d == direction)
        assert total == 5 * layout_bytes(scope)
    daemon.check()
    _no_leases(daemon)


def test_kept_connections_are_reused_and_shared_by_threads(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    tcp, _ = tcp_and_grpc(daemon)
    scopes = [make_scope(f"c{i}", layout=MEDIUM) for i in range(4)]
    prompts = [prompt(s, 6, seed=i) for i, s in enumerate(scopes)]

    def work(i: int) -> list[bytes]:
        tcp.put(scopes[i], prompts[i])
        into = buffers(scopes[i], 6)
        assert (
            tcp.get(scopes[i], keys_of(prompts[i]), into, tokens=tokens_of(prompts[i])).hit_count
            == 6
        )
        return [bytes(b) for b in into]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(work, range(4)))
    assert got == [[bytes(p.payload) for p in ps] for ps in prompts]
    server = daemon.daemon._tcp
    assert server is not None
    live = server.connection_count()
    assert 1 <= live <= 4  # at most one per concurrent call, kept for the next
    for _ in range(5):  # sequential calls reuse a kept connection: none is added
        tcp.lookup(scopes[0], keys_of(prompts[0]))
        assert (
            tcp.get(
                scopes[0], keys_of(prompts[0]), buffers(scopes[0], 6), tokens=tokens_of(prompts[0])
            ).hit_count
            == 6
        )
    assert server.connection_count() == live
    daemon.check()


def test_a_kept_connection_the_daemon_closed_is_replaced(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    tcp, _ = tcp_and_grpc(daemon)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 3, seed=2)
    assert tcp.put(scope, pages).stored == 3
    server = daemon.daemon._tcp
    assert server is not None
    assert wait_for(lambda: server.connection_count() == 1, timeout_s=5)
    server.drop_connections()  # the daemon drops the idle connection
    assert wait_for(lambda: server.connection_count() == 0, timeout_s=5)
    assert tcp.get(scope, keys_of(pages), buffers(scope, 3), tokens=tokens_of(pages)).hit_count == 3
    assert tcp.transport == "tcp"  # a fresh connection, not a fall back to gRPC


def put_frame(scope_layout: KVLayout, pages: list[Page], payloads: list[bytes]) -> bytes:
    """A PUT_PAGES frame and its payloads, as a hand-rolled client sends them."""
    begin = pb.PutBegin(scope=make_scope(layout=scope_layout).encode(), page_count=len(pages))
    meta = encode_put_pages(
        begin.SerializeToString(), [p.header.encode() for p in pages], [len(p) for p in payloads]
    )
    return preamble(KIND_PUT_PAGES, len(pages), len(meta)) + meta + b"".join(payloads)


def _raw_put(address: str, scope_layout: KVLayout, pages: list[Page], payloads: list[bytes]) -> int:
    """A hand-rolled TCP client: one PUT_PAGES frame with every payload; the reply's kind."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(put_frame(scope_layout, pages, payloads))
        reply = parse_preamble(_read(sock, PREAMBLE.size), 1 << 20)
        _read(sock, reply.meta_bytes)
        return reply.kind


def _read(sock: socket.socket, n: int) -> bytearray:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        assert part, "connection closed"
        out += part
    return out


def test_corrupt_payload_on_put_is_refused(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=LARGE)
    good = prompt(scope, 2, seed=3)
    flipped = bytearray(good[1].payload)
    flipped[7] ^= 0x01
    kind = _raw_put(daemon.info.tcp_address, LARGE, good, [bytes(good[0].payload), bytes(flipped)])
    assert kind == KIND_ERROR
    _no_leases(daemon)  # the reservation is aborted just after the error goes out
    stats = daemon.store.stats()
    assert (stats.pages, stats.active_leases, daemon.store.counters.corrupt_dropped) == (0, 0, 1)
    daemon.check()
    good_kind = _raw_put(daemon.info.tcp_address, LARGE, good, [bytes(p.payload) for p in good])
    assert good_kind == KIND_DONE
    tcp, _ = tcp_and_grpc(daemon)
    into = buffers(scope, 2)
    assert tcp.get(scope, keys_of(good), into, tokens=tokens_of(good)).hit_count == 2
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in good]


def test_a_corrupt_payload_from_the_client_is_refused_and_the_connection_stays(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    tcp, _ = tcp_and_grpc(daemon)
    scope = make_scope(layout=MEDIUM)
    good = prompt(scope, 1, seed=4)
    flipped = bytearray(good[0].payload)
    flipped[0] ^= 0x80
    with pytest.raises(Corrupt):
        tcp.put(scope, [Page(good[0].header, bytes(flipped))])
    assert daemon.store.stats().pages == 0
    assert tcp.put(scope, good).stored == 1  # the connection is still usable
    assert tcp.transport == "tcp"


def test_disconnect_mid_put_stores_nothing_and_daemon_serves_on(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 4, seed=11)
    host, port = parse_address(daemon.info.tcp_address)
    frame = put_frame(LARGE, pages, [bytes(p.payload) for p in pages])
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(frame[: len(frame) - len(pages[0].payload) * 3 - 1000])  # ... and gone
    _no_leases(daemon)
    assert daemon.store.stats().pages == 0
    daemon.check()
    tcp, _ = tcp_and_grpc(daemon)
    assert tcp.put(scope, pages).stored == 4


def test_client_falls_back_to_grpc_when_the_listener_goes(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    tcp, _ = tcp_and_grpc(daemon)
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 3, seed=13)
    assert tcp.put(scope, pages[:1]).stored == 1
    assert daemon.daemon._tcp is not None
    daemon.daemon._tcp.stop()  # the TCP listener and its connections go; gRPC lives on
    assert tcp.put(scope, pages).stored == 2
    assert tcp.transport == "grpc"
    into = buffers(scope, 3)
    assert tcp.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


def test_required_tcp_without_a_listener_is_unavailable(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None)  # TCP off
    strict = StoreClient(daemon.address, shared_memory=False, tcp=True)
    daemon.clients.append(strict)
    strict.connect()
    scope = make_scope(layout=SMALL)
    with pytest.raises(Unavailable, match="no TCP data listener"):
        strict.put(scope, prompt(scope, 1, seed=1))


@pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (the `ucx` extra)")
def test_auto_prefers_tcp_unless_ucx_has_a_fabric(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = daemon_factory(
        dram="64MiB",
        ssd=None,
        settings={**TCP_ON, "server.ucx": "true", "server.allow_open": "true"},
    )
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")
    assert daemon.client(shared_memory=False).transport == "tcp"
    assert daemon.client(shared_memory=False, ucx=True).transport == "ucx"
    assert daemon.client(shared_memory=False, tcp=False).transport == "ucx"
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy,tcp")  # an RDMA fabric: UCX first
    assert daemon.client(shared_memory=False).transport == "ucx"
    assert daemon.client(shared_memory=False, tcp=True).transport == "tcp"


def test_wire_frames_survive_a_many_page_round_trip(daemon_factory: DaemonFactory) -> None:
    """Many small pages in one call: every frame boundary on the byte stream lines up."""
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=TCP_ON)
    tcp, _ = tcp_and_grpc(daemon)
    scope = make_scope(layout=SMALL)
    pages = prompt(scope, 200, seed=17)
    assert tcp.put(scope, pages).stored == 200
    into = buffers(scope, 200)
    assert tcp.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 200
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
