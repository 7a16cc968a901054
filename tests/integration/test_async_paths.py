"""`AsyncStoreClient` on every data path the blocking client has: same-host shared memory, gRPC
streams, the TCP data path and UCX — all through the one client core (client/core/).

The same call sequence as the blocking client's path test (test_store_paths.transcript) gives the
same results on each path, and the daemon's byte counters prove which path moved the payloads; a
page served for the wrong tokens is a miss counted in `rejected`; a damaged page is a miss
counted in `corrupt_pages`; a large same-host put goes as two overlapped halves; a token the
daemon does not know, or a namespace it does not grant, is refused with the typed error; the TCP
path runs over TLS; a client falls back to gRPC when the TCP listener goes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import (
    DaemonFactory,
    RunningDaemon,
    buffers,
    chain,
    keys_of,
    make_scope,
    singles,
    tokens_of,
)
from test_same_host_integrity import flip_in_dram
from test_store_auth import TOKENS, _tokens_file
from test_store_paths import expected_transcript, transcript
from test_store_tls import Pki, _tls_settings, pki  # noqa: F401 - the module-scoped fixture

from client import (
    AsyncStoreClient,
    GetResult,
    LookupResult,
    NodeInfo,
    Page,
    PutResult,
    Scope,
    StoreStats,
    Tier,
)
from client.contract.errors import PermissionDenied, Unauthenticated, Unavailable
from client.transports.tls import TlsOptions
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

T = TypeVar("T")
HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
PATHS = [
    "shm",
    "grpc",
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed")),
]
# each path's client options (auto picks TCP over UCX without a fabric: UCX is asked for)
OPTIONS: dict[str, dict[str, object]] = {
    "shm": {"shared_memory": True},
    "grpc": {"shared_memory": False, "tcp": False, "ucx": False},
    "tcp": {"shared_memory": False},
    "ucx": {"shared_memory": False, "ucx": True},
}
BULK_ON = {"server.tcp": "true", "server.ucx": "true", "server.allow_open": "true"}


class Blocking:
    """An AsyncStoreClient on a private event loop, called from blocking test code: each call
    is awaited on that loop (so the path tests written for StoreClient run unchanged)."""

    def __init__(self, address: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.client = self._run(self._make(address, options))

    @staticmethod
    async def _make(address: str, options: dict[str, Any]) -> AsyncStoreClient:
        return AsyncStoreClient(address, **{"timeout_s": 10.0, **options})

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    @property
    def transport(self) -> str:
        return self.client.transport

    @property
    def corrupt_pages(self) -> int:
        return self.client.corrupt_pages

    def connect(self) -> NodeInfo:
        return self._run(self.client.connect())

    def put(self, scope: Scope, pages: Sequence[Page], **kwargs: Any) -> PutResult:
        return self._run(self.client.put(scope, pages, **kwargs))

    def get(self, scope: Scope, keys: Sequence[bytes], into: Any, **kwargs: Any) -> GetResult:
        return self._run(self.client.get(scope, keys, into, **kwargs))

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        return self._run(self.client.lookup(scope, keys))

    def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        return self._run(self.client.delete(scope=scope, keys=keys))

    def stats(self) -> StoreStats:
        return self._run(self.client.stats())

    def close(self) -> None:
        try:
            self._run(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


@pytest.fixture
def async_clients() -> Iterator[list[Blocking]]:
    made: list[Blocking] = []
    yield made
    for c in made:
        c.close()


def open_client(made: list[Blocking], daemon: RunningDaemon, **options: Any) -> Blocking:
    client = Blocking(daemon.address, **options)
    made.append(client)
    client.connect()
    return client


def on_path(made: list[Blocking], daemon: RunningDaemon, path: str) -> Blocking:
    return open_client(made, daemon, **OPTIONS[path])


def moved(daemon: RunningDaemon, path: str, direction: str) -> int:
    counts = daemon.store.counters.bytes_moved
    return sum(v for (p, d, _), v in counts.items() if p == path and d == direction)


def flip_header_byte(daemon: RunningDaemon, key: bytes) -> None:
    """Damage the stored header of a page (what the same-host path checks byte for byte)."""
    store = daemon.store
    with store._lock:
        entry = store.index.get(key)
        assert entry is not None
        damaged = bytearray(entry.header)
        damaged[-1] ^= 0xFF
        entry.header = bytes(damaged)


@pytest.mark.parametrize("path", PATHS)
def test_same_results_as_the_blocking_client_on_every_path(
    path: str, daemon_factory: DaemonFactory, async_clients: list[Blocking], scope: Scope
) -> None:
    daemon = daemon_factory(settings=BULK_ON)
    client = on_path(async_clients, daemon, path)
    pages = chain(scope, 8, seed=41)
    got = transcript(client, daemon, scope, pages)  # type: ignore[arg-type]
    assert client.transport == path
    assert got == expected_transcript(pages)
    # the payloads went in and came out over this path
    assert moved(daemon, path, "in") == 8 * scope.page_payload_bytes
    assert moved(daemon, path, "out") >= 8 * scope.page_payload_bytes
    daemon.check()


@pytest.mark.parametrize("path", PATHS)
def test_wrong_tokens_are_a_rejected_miss_and_damage_a_corrupt_one(
    path: str, daemon_factory: DaemonFactory, async_clients: list[Blocking], scope: Scope
) -> None:
    daemon = daemon_factory(ssd=None, settings=BULK_ON)
    client = on_path(async_clients, daemon, path)
    pages = singles(scope, 3, seed=43)
    assert client.put(scope, pages).stored == 3
    keys, tokens = keys_of(pages), tokens_of(pages)
    # another prompt's tokens for page 0: served by key, refused by the token check
    wrong = [tokens[1], tokens[1], tokens[2]]
    got = client.get(scope, keys, buffers(scope, 3), tokens=wrong)
    assert (got.hit_count, got.rejected) == (2, 1) and got.headers[0] is None
    # damage: the same-host path checks headers byte for byte (its copies are fenced by slot
    # generations); every other path checks the payload's checksum on receipt
    if path == "shm":
        flip_header_byte(daemon, keys[1])
    else:
        flip_in_dram(daemon, keys[1])
    into = buffers(scope, 3)
    got = client.get(scope, keys, into, tokens=tokens)
    assert [h is not None for h in got.headers] == [True, False, True]
    assert client.corrupt_pages == 1 and got.rejected == 0
    assert bytes(into[2]) == bytes(pages[2].payload)
    assert client.transport == path


@pytest.mark.usefixtures("pipelined_small_batches")
def test_large_same_host_puts_and_gets_go_in_overlapped_parts(
    daemon_factory: DaemonFactory, async_clients: list[Blocking], scope: Scope
) -> None:
    daemon = daemon_factory(ssd=None)
    client = on_path(async_clients, daemon, "shm")
    shell = client.client
    taken: list[tuple[str, str]] = []
    take = shell._take

    async def recording(stub: Any, conn: Any, step: Any) -> object:
        taken.append((type(step).__name__, getattr(step, "method", "")))
        return await take(stub, conn, step)

    shell._take = recording  # type: ignore[method-assign]
    pages = chain(scope, 40, seed=45)  # parts of 1, 19, 19 and 1 pages
    assert client.put(scope, pages).stored == 40
    # each reservation asked for as the one before is granted, before that one's copy; each
    # commit sent as soon as its part is copied, all read at the end
    assert taken == [
        ("Start", "Reserve"), ("Join", ""), ("Start", "Reserve"), ("CheckSegments", ""),
        ("CopyIn", ""), ("Start", "Commit"),
        ("Join", ""), ("Start", "Reserve"), ("CheckSegments", ""), ("CopyIn", ""),
        ("Start", "Commit"),
        ("Join", ""), ("Start", "Reserve"), ("CheckSegments", ""), ("CopyIn", ""),
        ("Start", "Commit"),
        ("Join", ""), ("CheckSegments", ""), ("CopyIn", ""), ("Start", "Commit"),
        ("Join", ""), ("Join", ""), ("Join", ""), ("Join", ""),
    ]  # fmt: skip
    taken.clear()
    into = buffers(scope, 40)
    assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 40
    # every Acquire (parts of 1, 3 and 36) in flight before the first reply is read
    assert taken == [
        ("Start", "Acquire"), ("Start", "Acquire"), ("Start", "Acquire"),
        ("Join", ""), ("CheckSegments", ""), ("CopyOut", ""), ("Release", ""),
        ("Join", ""), ("CopyOut", ""), ("Release", ""),
        ("Join", ""), ("CopyOut", ""), ("Release", ""),
    ]  # fmt: skip
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    assert moved(daemon, "shm", "in") == 40 * scope.page_payload_bytes
    assert wait_for(lambda: daemon.store.stats().active_leases == 0, timeout_s=10)
    daemon.check()


@pytest.mark.parametrize("path", ["grpc", "tcp"])
def test_auth_refusals_are_typed_errors(
    path: str,
    daemon_factory: DaemonFactory,
    async_clients: list[Blocking],
    tmp_path: Path,
) -> None:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    daemon = daemon_factory(
        ssd=None, settings={"auth.tokens_file": str(tokens), "server.tcp": "true"}
    )
    options = {**OPTIONS[path], "retries": 0, "timeout_s": 5.0}
    a = open_client(async_clients, daemon, token=TOKENS["engine-a"], **options)
    tenant_a, tenant_b = make_scope("tenant-a"), make_scope("tenant-b")
    pages = chain(tenant_a, 2, seed=47)
    assert a.put(tenant_a, pages).stored == 2
    assert a.transport == path
    with pytest.raises(PermissionDenied):
        a.put(tenant_b, chain(tenant_b, 1, seed=48))
    b = open_client(async_clients, daemon, token=TOKENS["engine-b"], **options)
    with pytest.raises(PermissionDenied):
        b.get(tenant_a, keys_of(pages), buffers(tenant_a, 2), tokens=tokens_of(pages))
    with pytest.raises(PermissionDenied):
        b.lookup(tenant_a, keys_of(pages))
    stranger = Blocking(daemon.address, token="not-a-known-token-0123", **options)
    async_clients.append(stranger)
    with pytest.raises(Unauthenticated):
        stranger.connect()


def test_the_tcp_data_path_over_tls(
    daemon_factory: DaemonFactory,
    async_clients: list[Blocking],
    pki: Pki,  # noqa: F811 - the fixture imported above
) -> None:
    daemon = daemon_factory(ssd=None, settings=_tls_settings(pki, require=True))
    tls = TlsOptions(ca_file=str(pki.ca))
    client = open_client(async_clients, daemon, shared_memory=False, tls=tls)
    scope = make_scope("async-tls")
    pages = chain(scope, 3, seed=49)
    assert client.put(scope, pages).stored == 3
    into = buffers(scope, 3)
    assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    assert client.lookup(scope, keys_of(pages)) == LookupResult(3, (Tier.DRAM,) * 3)
    assert client.transport == "tcp"
    assert moved(daemon, "tcp", "in") == 3 * scope.page_payload_bytes
    # UCX cannot be encrypted: required by a TLS client, it is refused, never used in the clear
    ucx = open_client(async_clients, daemon, shared_memory=False, tls=tls, ucx=True)
    with pytest.raises(Unavailable, match="cannot be encrypted"):
        ucx.put(scope, pages)
    # a plaintext client of a daemon that requires TLS gets nowhere
    plain = Blocking(daemon.address, shared_memory=False, tls=False, timeout_s=2.0, retries=0)
    async_clients.append(plain)
    with pytest.raises(Unavailable):
        plain.connect()


def test_falls_back_to_grpc_when_the_tcp_listener_goes(
    daemon_factory: DaemonFactory, async_clients: list[Blocking], scope: Scope
) -> None:
    daemon = daemon_factory(ssd=None, settings={"server.tcp": "true"})
    client = on_path(async_clients, daemon, "tcp")
    pages = chain(scope, 3, seed=51)
    assert client.put(scope, pages[:1]).stored == 1
    assert client.transport == "tcp"
    assert daemon.daemon._tcp is not None
    daemon.daemon._tcp.stop()  # the TCP listener and its connections go; gRPC lives on
    assert client.put(scope, pages).stored == 2
    assert client.transport == "grpc"
    into = buffers(scope, 3)
    assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    assert client.lookup(scope, keys_of(pages)).hit_count == 3
