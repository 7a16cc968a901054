"""Principals against a live daemon: tokens, namespaces, shared namespaces, Watch filtering.

One daemon with a tokens file of four principals: tenant A and tenant B (each reads, writes and
deletes its own namespace), an operator, and a reader of every namespace that writes none. Each
refusal must come back with its code, be counted in `strata_auth_denied_total`, and leave tenant
A's pages intact and the daemon serving.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import queue
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import (
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    chain,
    keys_of,
    make_scope,
    singles,
    tokens_of,
)

import kvstore.auth
from client import AsyncStoreClient, ClusterClient, Scope, StoreClient
from client.contract.errors import InvalidArgument, PermissionDenied, Unauthenticated
from client.contract.types import Event, EventKind, IoClass, Tier
from client.transports._wire import scope_bytes
from client.transports.lane import Lane, LaneError, LaneStub
from engine.router.lookup import StoreLookup
from engine.store_spec import parse_store
from engine.worker_config import load_worker_config
from kvstore.auth import hash_token
from kvstore.config import load_config
from kvstore.server import Daemon
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

TOKENS = {
    "engine-a": "token-of-a-0123456789",
    "engine-b": "token-of-b-0123456789",
    "ops": "token-of-ops-0123456789",
    "auditor": "token-of-auditor-0123456789",
}
A = make_scope("tenant-a")
B = make_scope("tenant-b")
SHARED = make_scope("shared")


def _tokens_file(path: Path) -> Path:
    entries = [
        ("engine-a", '["tenant-a"]', '["tenant-a"]', "true", "false"),
        ("engine-b", '["tenant-b"]', '["tenant-b"]', "true", "false"),
        ("ops", '["*"]', '["*"]', "true", "true"),
        ("auditor", '["*"]', "[]", "false", "false"),
    ]
    text = "".join(
        f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(TOKENS[name])}"\n'
        f"read = {read}\nwrite = {write}\ndelete = {delete}\noperator = {operator}\n"
        "trusted_local = true\n\n"
        for name, read, write, delete, operator in entries
    )
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def daemon(daemon_factory: DaemonFactory, tmp_path: Path) -> RunningDaemon:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    return daemon_factory(
        ssd=None,
        settings={"auth.tokens_file": str(tokens), "auth.shared_namespaces": "shared"},
    )


def _client(daemon: RunningDaemon, who: str | None, **kwargs: object) -> StoreClient:
    token = TOKENS[who] if who is not None else None
    c = StoreClient(daemon.address, shared_memory=False, token=token, timeout_s=5.0, **kwargs)  # type: ignore[arg-type]
    daemon.clients.append(c)
    return c


def _bearer(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


def _denied(daemon: RunningDaemon) -> dict[str, float]:
    with urllib.request.urlopen(daemon.info.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("strata_auth_denied_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture
def tenant_a(daemon: RunningDaemon) -> Iterator[StoreClient]:
    """Tenant A's client with five pages of A's stored."""
    client = _client(daemon, "engine-a")
    assert client.put(A, chain(A, 5)).stored == 5
    yield client


def test_a_call_without_a_valid_token_is_unauthenticated(daemon: RunningDaemon) -> None:
    for who, token in ((None, None), ("wrong", "not-a-known-token")):
        client = StoreClient(daemon.address, shared_memory=False, token=token, retries=0)
        daemon.clients.append(client)
        with pytest.raises(Unauthenticated):
            client.connect()
        stub = daemon.stub()
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        with pytest.raises(grpc.RpcError) as info:
            stub.Stats(pb.StatsRequest(), metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, who
    assert _denied(daemon)["unauthenticated"] >= 4


def test_each_tenant_reads_and_writes_its_own_namespace(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    pages = chain(A, 5)
    assert tenant_a.lookup(A, keys_of(pages)).hit_count == 5
    assert_intact(tenant_a, A, pages)
    b = _client(daemon, "engine-b")
    assert b.put(B, chain(B, 3, seed=1)).stored == 3
    assert_intact(b, B, chain(B, 3, seed=1))
    # node info and stats are open to every principal (and hold no page or namespace)
    assert b.stats().pages == 8 and b.node_info().node_id
    assert _denied(daemon) == {}


def test_another_tenants_reads_writes_and_deletes_are_refused(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    pages = chain(A, 5)
    keys = keys_of(pages)
    b = _client(daemon, "engine-b")
    auditor = _client(daemon, "auditor")
    into = [bytearray(A.page_payload_bytes) for _ in keys]
    refused: list[Callable[[], object]] = [
        lambda: b.lookup(A, keys),
        lambda: b.get(A, keys, into, tokens=tokens_of(pages)),
        lambda: b.put(A, chain(A, 6, seed=9)),
        lambda: b.delete(scope=A),
        lambda: b.delete(keys=keys[2:]),
        lambda: auditor.put(A, chain(A, 2, seed=3)),  # reads all, writes none
        lambda: auditor.delete(keys=keys),
        lambda: tenant_a.put(B, chain(B, 1)),
    ]
    for call in refused:
        with pytest.raises(PermissionDenied):
            call()
    assert auditor.lookup(A, keys).hit_count == 5  # reading all namespaces is its right
    assert_intact(tenant_a, A, pages)
    assert daemon.store.stats().pages == 5
    daemon.check()
    denied = _denied(daemon)
    assert denied["read"] == 2 and denied["write"] == 3 and denied["delete"] == 3


def test_a_forged_or_missing_scope_is_refused(daemon: RunningDaemon, tenant_a: StoreClient) -> None:
    """Tenant B sends A's digest with its own scope, or A's digest alone: refused, A intact."""
    keys = b"".join(keys_of(chain(A, 5)))
    stub = daemon.stub()
    meta = _bearer("engine-b")
    forged = [
        ("Lookup", pb.LookupRequest(scope_digest=A.digest, keys=keys, scope=scope_bytes(B))),
        ("Acquire", pb.AcquireRequest(scope_digest=A.digest, keys=keys, scope=scope_bytes(B))),
        ("Delete", pb.DeleteRequest(scope_digest=A.digest, scope=scope_bytes(B))),
        ("Lookup", pb.LookupRequest(scope_digest=A.digest, keys=keys)),  # no scope at all
        ("Acquire", pb.AcquireRequest(scope_digest=A.digest, keys=keys)),
        ("Delete", pb.DeleteRequest(scope_digest=A.digest)),
        ("Lookup", pb.LookupRequest(scope_digest=A.digest, keys=keys, scope=b"garbage")),
    ]
    for method, request in forged:
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, metadata=meta, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, request)
    streams = [
        ("Get", pb.GetRequest(scope_digest=A.digest, keys=keys, scope=scope_bytes(B))),
        ("Get", pb.GetRequest(scope_digest=A.digest, keys=keys)),
        ("Watch", pb.WatchRequest(scope_digest=A.digest, scope=scope_bytes(B))),
        ("Watch", pb.WatchRequest(scope_digest=A.digest)),
    ]
    for method, request in streams:
        with pytest.raises(grpc.RpcError) as info:
            next(iter(getattr(stub, method)(request, metadata=meta, timeout=5)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, request)
    assert _denied(daemon)["scope_mismatch"] == 5
    assert_intact(tenant_a, A, chain(A, 5))
    daemon.check()


def test_a_lease_is_only_its_holders(daemon: RunningDaemon, tenant_a: StoreClient) -> None:
    keys = b"".join(keys_of(chain(A, 5)))
    stub = daemon.stub()
    held = stub.Acquire(
        pb.AcquireRequest(scope_digest=A.digest, keys=keys, scope=scope_bytes(A)),
        metadata=_bearer("engine-a"),
        timeout=5,
    )
    assert held.lease_id and all(p.present for p in held.pages)
    for method, request in (
        ("Release", pb.ReleaseRequest(lease_id=held.lease_id)),
        ("Renew", pb.RenewRequest(lease_id=held.lease_id)),
        ("Commit", pb.CommitRequest(lease_id=held.lease_id)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, metadata=_bearer("engine-b"), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
    assert len(daemon.store.leases) == 1  # B's calls changed nothing
    released = stub.Release(
        pb.ReleaseRequest(lease_id=held.lease_id), metadata=_bearer("engine-a"), timeout=5
    )
    assert released.released
    # a lease the daemon took for itself (as a streamed put does) is no caller's
    own = daemon.store.acquire(A.digest, keys_of(chain(A, 5)), IoClass.NORMAL)
    with pytest.raises(grpc.RpcError) as info:
        stub.Release(
            pb.ReleaseRequest(lease_id=own.lease_id), metadata=_bearer("engine-a"), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert own.lease_id in daemon.store.leases
    daemon.store.release(own.lease_id)
    # an ended lease is just unknown, as without auth
    with pytest.raises(grpc.RpcError) as info:
        stub.Renew(pb.RenewRequest(lease_id=held.lease_id), metadata=_bearer("engine-a"), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _denied(daemon)["lease"] == 4


def test_a_shared_namespace_is_read_by_all_and_written_by_operators(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    ops = _client(daemon, "ops")
    prompt = chain(SHARED, 2, seed=5)
    with pytest.raises(PermissionDenied):
        tenant_a.put(SHARED, prompt)
    assert ops.put(SHARED, prompt).stored == 2
    for who in ("engine-a", "engine-b", "auditor"):
        assert_intact(_client(daemon, who), SHARED, prompt)
    with pytest.raises(PermissionDenied):
        tenant_a.delete(scope=SHARED)
    assert ops.delete(scope=SHARED) == 2


class _Collector:
    """A watch stream read on a thread into a queue (the stream ends when its client closes)."""

    def __init__(self, client: StoreClient) -> None:
        self.events: queue.Queue[Event | BaseException] = queue.Queue()
        self._stream = client.watch(timeout_s=30)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.events.put(event)
        except BaseException as exc:
            self.events.put(exc)

    def until(self, key: bytes, timeout_s: float = 10.0) -> list[Event]:
        """Events up to and including the first of page `key`."""
        seen: list[Event] = []
        while True:
            item = self.events.get(timeout=timeout_s)
            if isinstance(item, BaseException):
                raise item
            seen.append(item)
            if item.key == key:
                return seen


def _prime(writer: StoreClient, scope: Scope, collectors: list[_Collector]) -> None:
    """The daemon takes a watch's cursor when its handler starts, which a client cannot see:
    publish pages of `scope` one by one until every collector has seen one (bounded)."""
    waiting = list(collectors)
    for i, page in enumerate(singles(scope, 50, seed=77)):
        writer.put(scope, [page])
        for c in list(waiting):
            try:
                c.until(page.header.key, timeout_s=0.2 + 0.05 * i)
                waiting.remove(c)
            except queue.Empty:
                pass
        if not waiting:
            return
    raise AssertionError("a watch stream never delivered an event")


def test_watch_shows_only_readable_namespaces(daemon: RunningDaemon, tenant_a: StoreClient) -> None:
    b = _client(daemon, "engine-b")
    ops = _client(daemon, "ops")
    with pytest.raises(PermissionDenied):
        next(iter(b.watch(A, timeout_s=5)))
    b_events, ops_events = _Collector(_client(daemon, "engine-b")), _Collector(ops)
    _prime(b, B, [b_events, ops_events])
    assert tenant_a.put(A, chain(A, 2, seed=41)).stored == 2  # B must not see these
    assert tenant_a.delete(keys=keys_of(chain(A, 5))[3:]) == 2
    last = chain(B, 1, seed=42)
    assert b.put(B, last).stored == 1
    seen_b = b_events.until(last[0].header.key)
    seen_ops = ops_events.until(last[0].header.key)
    assert {e.scope_digest for e in seen_b} == {B.digest}
    assert {e.scope_digest for e in seen_ops} == {A.digest, B.digest}
    assert {e.kind for e in seen_ops if e.scope_digest == A.digest} == {
        EventKind.STORED,
        EventKind.REMOVED,
    }


def test_the_async_and_cluster_clients_send_their_token(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    keys = keys_of(chain(A, 5))

    async def lookups() -> tuple[int, type[BaseException] | None]:
        async with AsyncStoreClient(
            daemon.address, shared_memory=False, token=TOKENS["engine-a"]
        ) as good:
            hits = (await good.lookup(A, keys)).hit_count
        async with AsyncStoreClient(
            daemon.address, shared_memory=False, token=TOKENS["engine-b"], retries=0
        ) as other:
            try:
                await other.lookup(A, keys)
            except PermissionDenied as exc:
                return hits, type(exc)
        return hits, None

    assert asyncio.run(lookups()) == (5, PermissionDenied)
    with ClusterClient(addresses=[daemon.address], replicas=1, token=TOKENS["engine-a"]) as cc:
        assert cc.lookup(A, keys).hit_count == 5
        more = chain(A, 7)
        assert cc.put(A, more).stored == 2  # every call of it carries the token: put,
        into = [bytearray(A.page_payload_bytes) for _ in more]
        assert cc.get(A, keys_of(more), into, tokens=tokens_of(more)).hit_count == 7  # get,
        assert cc.stats().pages == 7  # stats,
        assert cc.delete(keys=keys_of(more)[5:]) == 2  # and delete
    other = ClusterClient(addresses=[daemon.address], replicas=1, token=TOKENS["engine-b"])
    with other, pytest.raises(PermissionDenied):
        other.put(A, chain(A, 7, seed=60))
    assert_intact(tenant_a, A, chain(A, 5))


def test_the_token_comes_from_the_environment(
    daemon: RunningDaemon, tenant_a: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_STORE_TOKEN", TOKENS["engine-a"])
    assert _client(daemon, None).lookup(A, keys_of(chain(A, 5))).hit_count == 5
    monkeypatch.setenv("STRATA_STORE_TOKEN", TOKENS["engine-b"])
    with pytest.raises(PermissionDenied):
        _client(daemon, None).lookup(A, keys_of(chain(A, 5)))


def test_the_same_host_path_checks_namespaces_too(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    a = daemon.client(shared_memory=True, token=TOKENS["engine-a"])
    b = daemon.client(shared_memory=True, token=TOKENS["engine-b"])
    assert a.transport == "shm"
    assert_intact(a, A, chain(A, 5))
    into = [bytearray(A.page_payload_bytes) for _ in range(5)]
    with pytest.raises(PermissionDenied):
        b.get(A, keys_of(chain(A, 5)), into, tokens=tokens_of(chain(A, 5)))
    with pytest.raises(PermissionDenied):
        b.put(A, chain(A, 7, seed=8))
    assert_intact(a, A, chain(A, 5))
    assert daemon.store.stats().pages == 5
    # its streams and unary calls off the lane (gRPC) carry the token too: stats, watch
    assert a.stats().pages == 5
    _prime(a, A, [_Collector(daemon.client(shared_memory=True, token=TOKENS["engine-a"]))])


def test_an_open_daemon_stays_on_loopback(tmp_path: Path) -> None:
    def config(host: str, **more: str) -> Daemon:
        values = {
            "server.host": host,
            "server.port": "0",
            "server.metrics_port": "-1",
            "server.unix_socket": "off",
            "server.ucx": "false",
            "server.tcp": "false",
            "data_dir": str(tmp_path / "data"),
            "ssd.enabled": "false",
            "dram.capacity_bytes": "4MiB",
            **more,
        }
        return Daemon(load_config(env={}, overrides=values))

    with pytest.raises(InvalidArgument, match="allow_open"):
        config("0.0.0.0").start()
    tokens = tmp_path / "tokens.toml"
    _tokens_file(tokens)
    tokens.chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        config("127.0.0.1", **{"auth.tokens_file": str(tokens)}).start()
    tokens.chmod(0o600)
    running = config("127.0.0.1", **{"auth.tokens_file": str(tokens)})
    try:
        assert running.start().port
    finally:
        running.stop()


def test_an_open_daemon_accepts_reads_without_a_scope(daemon_factory: DaemonFactory) -> None:
    """Backward compatible: an open daemon serves a digest-only read (older clients); a scope
    that is not the digest's is refused all the same."""
    running = daemon_factory(ssd=None)
    client = running.client(shared_memory=False)
    pages = chain(A, 3)
    client.put(A, pages)
    stub = running.stub()
    packed = b"".join(keys_of(pages))
    assert (
        stub.Lookup(pb.LookupRequest(scope_digest=A.digest, keys=packed), timeout=5).hit_count == 3
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Lookup(
            pb.LookupRequest(scope_digest=A.digest, keys=packed, scope=scope_bytes(B)), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.lookup(A, keys_of(pages)).hit_count == 3


def test_engines_and_the_router_pass_their_token(
    daemon: RunningDaemon, tenant_a: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STRATA_STORE_TOKEN", raising=False)
    spec = parse_store(daemon.address)
    assert spec is not None
    tokens = [t for p in chain(A, 5) for t in p.header.tokens]
    lookups = {
        who: StoreLookup(spec, timeout_s=5.0, token=TOKENS[who] if who else None)
        for who in ("engine-a", "engine-b", None)
    }
    try:
        hits = {who: lookup.lookup(A, tokens).hit_pages for who, lookup in lookups.items()}
    finally:
        for lookup in lookups.values():
            lookup.close()
    assert hits == {"engine-a": 5, "engine-b": 0, None: 0}  # a refused lookup is a miss
    assert lookups["engine-b"].errors == 1 and lookups[None].errors == 1
    config = load_worker_config(
        "prefill", env={"STRATA_ENGINE_STORE_TOKEN": TOKENS["engine-a"]}, overrides={"model": "m"}
    )
    assert config.store_token == TOKENS["engine-a"] and TOKENS["engine-a"] not in repr(config)
    client = spec.open(timeout_s=5.0, token=config.store_token)
    try:
        assert client.lookup(A, keys_of(chain(A, 5))).hit_count == 5
    finally:
        client.close()


def test_deletes_by_key_know_the_namespace_of_stored_pages(
    daemon: RunningDaemon, tenant_a: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's memory of digest -> namespace from calls is bounded; the index names the
    scopes of stored pages anyway, so a delete by key is checked against the right namespace
    after that memory has moved on."""
    monkeypatch.setattr(kvstore.auth, "_NAMESPACE_MEMORY", 1)
    b = _client(daemon, "engine-b")
    assert b.put(B, chain(B, 2, seed=3)).stored == 2  # the memory now holds B's digest only
    keys = keys_of(chain(A, 5))
    with pytest.raises(PermissionDenied):
        b.delete(keys=keys[:1])
    assert tenant_a.delete(keys=keys[3:]) == 2
    assert tenant_a.lookup(A, keys).hit_count == 3


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
def test_an_open_daemon_serves_ucx_only_when_allowed_open(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """ucxx listens on every interface: an open daemon starts no UCX listener unless
    server.allow_open says an open daemon off loopback is intended."""
    caplog.set_level(logging.INFO, logger="kvstore.server")
    closed = daemon_factory(ssd=None, settings={"server.ucx": "true"})
    assert closed.info.ucx_address == ""
    assert "this daemon is open" in caplog.text
    allowed = daemon_factory(ssd=None, settings={"server.ucx": "true", "server.allow_open": "true"})
    assert allowed.info.ucx_address.startswith("ucx://")


def test_pages_rebuilt_from_ssd_keep_their_namespace(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The SSD tier records each scope's namespace with its pages, so after a restart, before
    any call names the scope again: the rebuilt pages count toward their namespace, their owner
    may delete them by key (another tenant may not), and its Watch shows their events."""
    tokens = _tokens_file(tmp_path / "tokens.toml")
    settings = {
        "auth.tokens_file": str(tokens),
        "ssd.sync_writes": "true",
    }
    data = tmp_path / "persist"
    first = daemon_factory(settings=settings, data_dir=data)
    pages = chain(A, 4, seed=90)
    assert _client(first, "engine-a").put(A, pages, tier=Tier.SSD).stored == 4
    assert all(Tier.SSD in first.tier_of(p.header.key) for p in pages)
    first.stop()

    again = daemon_factory(settings=settings, data_dir=data)
    assert again.store.rebuilt_pages == 4
    with again.store._lock:
        assert again.store.index.namespace_of(A.digest) == "tenant-a"
        assert again.store.index.namespace_bytes("tenant-a", Tier.SSD) == 4 * A.page_payload_bytes
    a, b = _client(again, "engine-a"), _client(again, "engine-b")
    watcher = _Collector(_client(again, "engine-a"))
    _prime(a, make_scope("tenant-a", model_id="test/other"), [watcher])  # names another scope
    keys = keys_of(pages)
    with pytest.raises(PermissionDenied):
        b.delete(keys=keys[3:])
    assert a.delete(keys=keys[3:]) == 1
    seen = watcher.until(keys[3])
    assert (seen[-1].kind, seen[-1].scope_digest) == (EventKind.REMOVED, A.digest)
    assert_intact(a, A, pages[:3])
    again.check()


def test_every_lane_call_is_checked_against_the_lanes_principal(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    """The same-host lane binds its connection to the HELLO's principal: B's lane can neither
    end, renew nor commit A's lease, nor read, reserve in or delete from A's namespace, nor
    forge A's digest under its own scope; A's lane serves on and A's pages stay intact."""
    address = daemon.info.local_address
    lanes = {who: Lane(address, TOKENS[who]) for who in ("engine-a", "engine-b")}
    try:
        a, b = (LaneStub(lanes[w], daemon.stub()) for w in ("engine-a", "engine-b"))
        keys = b"".join(keys_of(chain(A, 5)))
        held = a.Acquire(pb.AcquireRequest(scope=A.encode(), keys=keys), timeout=5)
        assert held.lease_id and all(p.present for p in held.pages)
        refused = [
            (b.Release, pb.ReleaseRequest(lease_id=held.lease_id), "PERMISSION_DENIED"),
            (b.Renew, pb.RenewRequest(lease_id=held.lease_id), "PERMISSION_DENIED"),
            (b.Commit, pb.CommitRequest(lease_id=held.lease_id), "PERMISSION_DENIED"),
            (b.Lookup, pb.LookupRequest(scope=A.encode(), keys=keys), "PERMISSION_DENIED"),
            (b.Acquire, pb.AcquireRequest(scope=A.encode(), keys=keys), "PERMISSION_DENIED"),
            (b.Delete, pb.DeleteRequest(keys=keys), "PERMISSION_DENIED"),
            (
                b.Delete,
                pb.DeleteRequest(scope_digest=A.digest, scope=A.encode()),
                "PERMISSION_DENIED",
            ),
            (
                b.Reserve,
                pb.ReserveRequest(scope=A.encode(), headers=[chain(A, 6)[5].header.encode()]),
                "PERMISSION_DENIED",
            ),
            (
                b.Lookup,
                pb.LookupRequest(scope_digest=A.digest, scope=B.encode(), keys=keys),
                "INVALID_ARGUMENT",
            ),
            (b.Lookup, pb.LookupRequest(scope_digest=A.digest, keys=keys), "INVALID_ARGUMENT"),
        ]
        for call, request, code in refused:
            with pytest.raises(LaneError) as info:
                call(request, timeout=5)
            assert info.value.code().name == code, (request, info.value.details())
        assert len(daemon.store.leases) == 1  # A's only: B's calls changed nothing
        assert a.Renew(pb.RenewRequest(lease_id=held.lease_id), timeout=5).lease_expires_unix_ms
        assert a.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=5).released
    finally:
        for lane in lanes.values():
            lane.close()
    assert_intact(tenant_a, A, chain(A, 5))
    daemon.check()


WRITE_PATHS = {  # put path -> (client keyword arguments, the transport it must settle on)
    "grpc": ({"shared_memory": False, "tcp": False}, "grpc"),
    "shm": ({"shared_memory": True}, "shm"),
    "tcp": ({"shared_memory": False}, "tcp"),
    "ucx": ({"shared_memory": False, "ucx": True}, "ucx"),
}


@pytest.mark.parametrize("path", sorted(WRITE_PATHS))
def test_only_an_operator_writes_or_deletes_the_shared_namespace_on_every_path(
    daemon_factory: DaemonFactory, tmp_path: Path, path: str
) -> None:
    """A principal that writes and deletes every namespace ("*") but is no operator can neither
    put into the shared namespace (gRPC stream, same-host reserve, TCP or UCX put) nor delete
    its pages by key or by scope; the operator can, over the same path."""
    if path == "ucx" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed")
    names = {"wide": ("false", "wide-token-0123456789"), "ops": ("true", TOKENS["ops"])}
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        "".join(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(token)}"\n'
            f'read = ["*"]\nwrite = ["*"]\ndelete = true\noperator = {operator}\n'
            "trusted_local = true\n\n"
            for name, (operator, token) in names.items()
        )
    )
    tokens.chmod(0o600)
    settings = {"auth.tokens_file": str(tokens), "auth.shared_namespaces": "shared"}
    settings |= {"server.tcp": "true", "server.ucx": "true" if path == "ucx" else "false"}
    d = daemon_factory(ssd=None, settings=settings)
    kwargs, transport = WRITE_PATHS[path]
    wide = d.client(token=names["wide"][1], **kwargs)
    ops = d.client(token=names["ops"][1], **kwargs)
    assert (wide.transport, ops.transport) == (transport, transport)
    prompt = chain(SHARED, 3, seed=70)
    with pytest.raises(PermissionDenied):
        wide.put(SHARED, prompt)
    assert d.store.stats().pages == 0 and d.store.stats().active_leases == 0
    assert ops.put(SHARED, prompt).stored == 3
    with pytest.raises(PermissionDenied):
        wide.put(SHARED, chain(SHARED, 4, seed=70))  # a continuation of the operator's pages
    with pytest.raises(PermissionDenied):
        wide.delete(keys=keys_of(prompt))
    with pytest.raises(PermissionDenied):
        wide.delete(scope=SHARED)
    assert_intact(wide, SHARED, prompt)  # readable by all, and intact
    assert wide.put(A, chain(A, 2, seed=71)).stored == 2  # its other rights hold
    assert ops.delete(keys=keys_of(prompt)[2:]) == 1
    assert ops.delete(scope=SHARED) == 2
    d.check()


def test_a_tenants_token_covers_its_salted_sub_namespaces(
    daemon: RunningDaemon, tenant_a: StoreClient
) -> None:
    """The router keys a request with a cache_salt under "tenant-a#<salt digest>": engine-a's
    token (rights on tenant-a) puts, reads and deletes there, engine-b's does not."""
    salted = make_scope("tenant-a#0123abcd")
    pages = chain(salted, 3, seed=95)
    assert tenant_a.put(salted, pages).stored == 3
    assert_intact(tenant_a, salted, pages)
    b = _client(daemon, "engine-b")
    with pytest.raises(PermissionDenied):
        b.lookup(salted, keys_of(pages))
    with pytest.raises(PermissionDenied):
        b.put(salted, chain(salted, 4, seed=95))
    with pytest.raises(PermissionDenied):
        b.delete(keys=keys_of(pages))
    with pytest.raises(PermissionDenied, match="operators only"):
        shared_salted = make_scope("shared#0123abcd")
        _client(daemon, "engine-a").put(shared_salted, chain(shared_salted, 1))
    assert tenant_a.delete(keys=keys_of(pages)[2:]) == 1
    assert tenant_a.delete(scope=salted) == 2
    assert_intact(tenant_a, A, chain(A, 5))
