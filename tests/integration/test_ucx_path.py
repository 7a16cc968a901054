"""The UCX bulk data path (client/transports/ucx_transport.py <-> kvstore/ucx_server.py) against gRPC.

A daemon with its UCX listener on serves a UCX client and a gRPC-streaming client: every call
gives the same results and byte-identical payloads, for small and > 1 MiB pages. A payload
corrupted on the wire is refused (nothing stored) or dropped (a miss); a client that vanishes
mid-transfer leaves no lease behind and the daemon keeps serving; a daemon without a listener
is served over gRPC.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from conftest import DaemonFactory, RunningDaemon, buffers, keys_of, make_scope, tokens_of

from client import KVLayout, Page, Scope, StoreClient, build_pages
from client.contract.errors import Corrupt, Unavailable
from client.transports import ucx_transport
from client.transports.ucx_protocol import (
    KIND_GET,
    KIND_MANIFEST,
    KIND_PUT,
    KIND_WANT,
    PREAMBLE,
    decode_manifest,
    encode_put,
    parse_address,
    parse_preamble,
    preamble,
)
from client.transports.ucx_runtime import ucx_runtime
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
needs_ucxx = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (the `ucx` extra)")

UCX_ON = {"server.ucx": "true", "server.allow_open": "true"}  # an open daemon's UCX: every NIC
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)  # 16 KiB
MEDIUM = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, page_tokens=16)  # 256 KiB
LARGE = KVLayout(num_layers=12, num_kv_heads=8, head_dim=128, page_tokens=32)  # 1.5 MiB
LAYOUTS = {"16KiB": SMALL, "256KiB": MEDIUM, "1.5MiB": LARGE}


def prompt(scope: Scope, count: int, seed: int) -> list[Page]:
    """`count` chained pages of `scope` with seeded random payloads."""
    n = scope.layout.page_tokens
    tokens = [(seed * 7919 + t) % 50_000 for t in range(count * n)]
    rng = random.Random(seed)
    return build_pages(
        scope, tokens, [rng.randbytes(scope.page_payload_bytes) for _ in range(count)]
    )


def _wait_for_no_leases(daemon: RunningDaemon, timeout_s: float = 10.0) -> None:
    """Leases end on the daemon's side of a call, maybe just after the client has returned."""
    assert wait_for(lambda: daemon.store.stats().active_leases == 0, timeout_s=timeout_s)


def both(daemon: RunningDaemon) -> tuple[StoreClient, StoreClient]:
    ucx = daemon.client(shared_memory=False, ucx=True)
    rpc = daemon.client(shared_memory=False, ucx=False)
    assert (ucx.transport, rpc.transport) == ("ucx", "grpc")
    return ucx, rpc


def transcript(client: StoreClient, scope: Scope, pages: Sequence[Page]) -> list[object]:
    """A fixed sequence of calls; every result as plain values (payloads as bytes)."""
    keys = keys_of(pages)
    out: list[object] = [client.put(scope, pages[:3]).statuses, client.put(scope, pages).statuses]
    out.append(client.lookup(scope, [*keys, b"\xab" * 16]))
    into = [bytearray(scope.page_payload_bytes) for _ in range(len(pages) + 1)]
    result = client.get(scope, [keys[0], b"\xab" * 16, *keys[1:]], into, tokens=None)
    out.append([keys.index(h.key) if h is not None else None for h in result.headers])
    out.append(
        [bytes(b) if h is not None else None for h, b in zip(result.headers, into, strict=True)]
    )
    out.append(client.corrupt_pages)
    return out


@needs_ucxx
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_same_results_over_ucx_and_grpc(daemon_factory: DaemonFactory, layout: KVLayout) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    assert daemon.info.ucx_address.startswith("ucx://127.0.0.1:")
    ucx, rpc = both(daemon)
    pages = {name: prompt(make_scope(name, layout=layout), 5, seed=7) for name in ("u", "g")}
    a = transcript(ucx, make_scope("u", layout=layout), pages["u"])
    b = transcript(rpc, make_scope("g", layout=layout), pages["g"])
    assert a == b
    payloads = a[4]
    assert isinstance(payloads, list)
    want = [bytes(p.payload) for p in pages["u"]]
    assert payloads == [want[0], None, *want[1:]]
    # what one path wrote, the other reads
    scope = make_scope("u", layout=layout)
    into = [bytearray(scope.page_payload_bytes) for _ in range(5)]
    assert rpc.get(scope, keys_of(pages["u"]), into, tokens=tokens_of(pages["u"])).hit_count == 5
    assert [bytes(b) for b in into] == want
    moved = daemon.store.counters.bytes_moved
    assert sum(
        v for (path, d, _), v in moved.items() if path == "ucx" and d == "in"
    ) == 5 * layout_bytes(scope)
    assert sum(
        v for (path, d, _), v in moved.items() if path == "ucx" and d == "out"
    ) == 5 * layout_bytes(scope)
    daemon.check()
    _wait_for_no_leases(daemon)


def layout_bytes(scope: Scope) -> int:
    return scope.page_payload_bytes


@needs_ucxx
def test_concurrent_calls_share_one_client(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    ucx, _ = both(daemon)
    scopes = [make_scope(f"t{i}", layout=MEDIUM) for i in range(4)]
    prompts = [prompt(s, 6, seed=i) for i, s in enumerate(scopes)]

    def work(i: int) -> list[bytes]:
        ucx.put(scopes[i], prompts[i])
        into = [bytearray(scopes[i].page_payload_bytes) for _ in range(6)]
        assert (
            ucx.get(scopes[i], keys_of(prompts[i]), into, tokens=tokens_of(prompts[i])).hit_count
            == 6
        )
        return [bytes(b) for b in into]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(work, range(4)))
    assert got == [[bytes(p.payload) for p in ps] for ps in prompts]
    daemon.check()


@needs_ucxx
@pytest.mark.parametrize("path", ["ucx", "grpc"])
def test_corrupt_payload_on_put_is_refused(daemon_factory: DaemonFactory, path: str) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    client = dict(zip(("ucx", "grpc"), both(daemon), strict=True))[path]
    scope = make_scope(layout=LARGE)
    good = prompt(scope, 2, seed=3)
    flipped = bytearray(good[0].payload)
    flipped[len(flipped) // 2] ^= 0x40  # the header's checksum no longer matches
    with pytest.raises(Corrupt):
        client.put(scope, [Page(good[0].header, bytes(flipped))])
    assert client.lookup(scope, keys_of(good)).hit_count == 0
    stats = daemon.store.stats()
    assert (stats.pages, stats.active_leases, daemon.store.counters.corrupt_dropped) == (0, 0, 1)
    daemon.check()
    assert client.put(scope, good).stored == 2  # the connection is still usable


@needs_ucxx
@pytest.mark.parametrize("path", ["ucx", "grpc"])
def test_corrupt_payload_on_get_is_a_miss(daemon_factory: DaemonFactory, path: str) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    client = dict(zip(("ucx", "grpc"), both(daemon), strict=True))[path]
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 3, seed=5)
    assert client.put(scope, pages).stored == 3
    with daemon.store._lock:
        entry = daemon.store.index.get(pages[1].header.key)
        assert entry is not None and entry.dram is not None
        daemon.store.tiers.dram.view(entry.dram, 8)[3] ^= 0x01  # bit rot in the DRAM slot
    into = [bytearray(scope.page_payload_bytes) for _ in range(3)]
    result = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    assert [h is not None for h in result.headers] == [True, False, True]
    assert client.corrupt_pages == 1
    assert bytes(into[2]) == bytes(pages[2].payload)
    _wait_for_no_leases(daemon)  # released by the daemon once the last byte went out


# ---- a client that goes away mid-transfer ------------------------------------------------


def _raw(daemon: RunningDaemon, script: Callable[[object], object]) -> None:
    """Run `script(endpoint)` on a bare ucxx endpoint to the daemon, then abort the endpoint.
    It runs on the process's UCX loop, as everything UCX in a process must."""
    ucxx, loop = ucx_runtime()
    host, port = parse_address(daemon.info.ucx_address)

    async def run() -> None:
        ep = await ucxx.create_endpoint(host, port)
        try:
            await script(ep)  # type: ignore[misc]
        finally:
            ep.abort()

    asyncio.run_coroutine_threadsafe(run(), loop).result(60)


@needs_ucxx
def test_disconnect_mid_put_stores_nothing_and_daemon_serves_on(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 4, seed=11)
    begin = pb.PutBegin(scope=scope.encode(), page_count=4).SerializeToString()
    meta = encode_put(begin, [p.header.encode() for p in pages])

    async def half_a_put(ep: object) -> None:
        await ep.send(preamble(KIND_PUT, 4, len(meta)))  # type: ignore[attr-defined]
        await ep.send(meta)  # type: ignore[attr-defined]
        head = bytearray(PREAMBLE.size)
        await ep.recv(head)  # type: ignore[attr-defined]
        frame = parse_preamble(head, 1 << 20)
        assert frame.kind == KIND_WANT
        want = bytearray(frame.meta_bytes)
        await ep.recv(want)  # type: ignore[attr-defined]
        assert list(want) == [1, 1, 1, 1]
        await ep.send(memoryview(pages[0].payload))  # type: ignore[attr-defined]
        # ... and gone, with three payloads owed

    _raw(daemon, half_a_put)
    _wait_for_no_leases(daemon)
    assert daemon.store.stats().pages == 0
    daemon.check()
    ucx, _ = both(daemon)
    assert ucx.put(scope, pages).stored == 4
    into = [bytearray(scope.page_payload_bytes) for _ in range(4)]
    assert ucx.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 4
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


@needs_ucxx
def test_disconnect_mid_get_releases_the_lease(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    ucx, _ = both(daemon)
    scope = make_scope(layout=LARGE)
    pages = prompt(scope, 4, seed=12)
    assert ucx.put(scope, pages).stored == 4
    request = pb.GetRequest(scope_digest=scope.digest, keys=b"".join(keys_of(pages)))
    raw = request.SerializeToString()

    async def half_a_get(ep: object) -> None:
        await ep.send(preamble(KIND_GET, 0, len(raw)))  # type: ignore[attr-defined]
        await ep.send(raw)  # type: ignore[attr-defined]
        head = bytearray(PREAMBLE.size)
        await ep.recv(head)  # type: ignore[attr-defined]
        frame = parse_preamble(head, 1 << 20)
        assert frame.kind == KIND_MANIFEST
        manifest = bytearray(frame.meta_bytes)
        await ep.recv(manifest)  # type: ignore[attr-defined]
        assert all(e.present for e in decode_manifest(manifest, 4))
        await ep.recv(bytearray(pages[0].header.payload_bytes))  # type: ignore[attr-defined]
        # ... and gone, three payloads unread

    _raw(daemon, half_a_get)
    _wait_for_no_leases(daemon)
    into = [bytearray(scope.page_payload_bytes) for _ in range(4)]
    assert ucx.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 4
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    daemon.check()


# ---- fallback ----------------------------------------------------------------------------


def test_daemon_without_listener_is_served_over_grpc(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings={"server.ucx": "false"})
    assert daemon.info.ucx_address == ""
    auto = daemon.client(shared_memory=False)  # ucx=None: use it where possible
    assert auto.transport == "grpc"
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 3, seed=9)
    assert auto.put(scope, pages).stored == 3
    into = [bytearray(scope.page_payload_bytes) for _ in range(3)]
    assert auto.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    with StoreClient(daemon.address, shared_memory=False, ucx=True) as strict:
        strict.connect()
        with pytest.raises(Unavailable, match="UCX was required"):
            strict.get(scope, keys_of(pages), into, tokens=tokens_of(pages))


@needs_ucxx
def test_client_falls_back_when_the_listener_goes_away(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    auto = daemon.client(shared_memory=False)
    assert auto.transport == "ucx"
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 3, seed=13)
    assert auto.put(scope, pages[:1]).stored == 1
    assert daemon.daemon._ucx is not None
    daemon.daemon._ucx.stop()  # the UCX listener dies; gRPC lives on
    assert auto.put(scope, pages).stored == 2
    assert auto.transport == "grpc"
    into = [bytearray(scope.page_payload_bytes) for _ in range(3)]
    assert auto.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


@needs_ucxx
def test_client_without_ucxx_uses_grpc(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    monkeypatch.setattr(ucx_transport, "ucxx_installed", lambda: False)
    auto = daemon.client(shared_memory=False)
    with caplog.at_level("INFO", logger="client.transports.ucx_transport"):
        assert auto.transport == "grpc"
        scope = make_scope(layout=SMALL)
        pages = prompt(scope, 2, seed=14)
        assert auto.put(scope, pages).stored == 2
        assert auto.transport == "grpc"
    said = [r.getMessage() for r in caplog.records if "ucxx is not installed" in r.getMessage()]
    assert len(said) == 1  # once per client
    strict = StoreClient(daemon.address, shared_memory=False, ucx=True)
    daemon.clients.append(strict)
    strict.connect()
    with pytest.raises(Unavailable, match="ucxx is not installed"):
        strict.put(scope, pages)


@needs_ucxx
def test_an_idle_client_costs_the_daemon_no_cpu(daemon_factory: DaemonFactory) -> None:
    """A UCX client between calls holds no endpoint: an open, idle one keeps a ucxx 0.52 daemon
    progressing a posted receive on a whole core. The daemon runs in this process, so the
    process's CPU time over an idle wait is the daemon's (plus this test's, which waits)."""
    daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
    client = daemon.client(shared_memory=False, ucx=True)
    assert client.transport == "ucx"
    scope = make_scope("idle", layout=SMALL)
    pages = prompt(scope, 4, seed=9)
    assert client.put(scope, pages).stored == 4
    assert (
        client.get(scope, keys_of(pages), buffers(scope, 4), tokens=tokens_of(pages)).hit_count == 4
    )
    before_cpu, before_wall = time.process_time(), time.monotonic()
    threading.Event().wait(1.5)  # idle: nothing is asked of the daemon
    share = (time.process_time() - before_cpu) / (time.monotonic() - before_wall)
    assert share < 0.5, f"an idle UCX client cost the daemon {share:.0%} of a core"


@needs_ucxx
def test_daemons_and_clients_of_a_process_share_one_ucx_loop(daemon_factory: DaemonFactory) -> None:
    """ucxx keeps one worker per process and restarts its progress thread for every new event
    loop it is used from; a loop per listener (this process starts daemon after daemon) could
    crash the process under live transfers. Every listener and client here runs on one loop."""
    from ucxx._lib_async import application_context

    scope = make_scope("one-loop", layout=SMALL)
    pages = prompt(scope, 2, seed=21)
    for round_ in range(3):  # daemons come and go; the loop stays
        daemon = daemon_factory(dram="64MiB", ssd=None, settings=UCX_ON)
        client = daemon.client(shared_memory=False, ucx=True)
        assert client.put(scope, pages).stored == 2, round_
        assert (
            client.get(scope, keys_of(pages), buffers(scope, 2), tokens=tokens_of(pages)).hit_count
            == 2
        )
        daemon.stop()
    bulk_threads = [t.name for t in threading.enumerate() if t.name.startswith("strata-bulk")]
    assert bulk_threads == ["strata-bulk"]
    assert len(application_context.ProgressTasks) == 1
