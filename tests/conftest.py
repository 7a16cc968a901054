"""Fixtures shared by the integration and e2e suites: in-process daemons, scopes, pages, clients.

`daemon_factory` starts a real `Daemon` (gRPC on 127.0.0.1 port 0, metrics on port 0, state under
`tmp_path`) and stops every daemon it started at teardown, whatever the test did. Pages use a small
layout (2 layers, 2 KV heads, head dim 64, 16 tokens, float16: 16 KiB payloads) with seeded random
payloads, so a byte-identical read is a meaningful check and a payload can be found on disk.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

import kvstore.server
from client import KVLayout, Page, Scope, StoreClient, Tier, build_pages
from kvstore.config import StoreConfig, load_config
from kvstore.server import Daemon, DaemonInfo
from kvstore.store import Store
from kvstore_pb.store_pb2_grpc import StoreStub

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)
PAGE_TOKENS = LAYOUT.page_tokens
KiB = 1 << 10
MiB = 1 << 20


def make_scope(
    namespace: str = "",
    *,
    model_id: str = "test/tiny",
    layout: KVLayout = LAYOUT,
    kv_dtype: str = "float16",
) -> Scope:
    return Scope(
        model_id=model_id,
        weights_revision="w1",
        tokenizer_fingerprint="tok1",
        kv_dtype=kv_dtype,
        layout=layout,
        namespace=namespace,
    )


PAGE_BYTES = make_scope().page_payload_bytes  # 16 KiB


def payload_for(seed: int, size: int = PAGE_BYTES) -> bytes:
    """A deterministic random payload (distinct seeds give distinct, findable bytes)."""
    return random.Random(seed).randbytes(size)


def chain(scope: Scope, count: int, *, seed: int = 0) -> list[Page]:
    """`count` pages of one prompt: page i's parent is page i-1 (the first: the scope digest)."""
    tokens = [(seed * 7919 + t) % 50_000 for t in range(count * PAGE_TOKENS)]
    payloads = [payload_for(seed * 100_003 + i, scope.page_payload_bytes) for i in range(count)]
    return build_pages(scope, tokens, payloads)


def singles(scope: Scope, count: int, *, seed: int = 0) -> list[Page]:
    """`count` independent one-page prompts (each a leaf whose parent is the scope digest)."""
    out: list[Page] = []
    for i in range(count):
        s = seed * 100_003 + i
        tokens = [(s * 31 + t) % 50_000 for t in range(PAGE_TOKENS)]
        tokens[0] = s % 4_000_000_000  # distinct first token: distinct key
        out.extend(build_pages(scope, tokens, [payload_for(s, scope.page_payload_bytes)]))
    return out


def keys_of(pages: Sequence[Page]) -> list[bytes]:
    return [p.header.key for p in pages]


def tokens_of(pages: Sequence[Page]) -> list[tuple[int, ...]]:
    """Each page's token ids: what a get of `keys_of(pages)` passes as `tokens`."""
    return [p.header.tokens for p in pages]


def buffers(scope: Scope, count: int) -> list[bytearray]:
    return [bytearray(scope.page_payload_bytes) for _ in range(count)]


def read_back(client: StoreClient, scope: Scope, pages: Sequence[Page]) -> list[bytes | None]:
    """Get `pages` through `client`: each payload as bytes, or None for a miss."""
    into = buffers(scope, len(pages))
    result = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    return [bytes(b) if h is not None else None for h, b in zip(result.headers, into, strict=True)]


def assert_intact(client: StoreClient, scope: Scope, pages: Sequence[Page]) -> None:
    """Every page of `pages` is served, byte-identical to what was put."""
    got = read_back(client, scope, pages)
    assert got == [bytes(p.payload) for p in pages]


@dataclass
class RunningDaemon:
    """An in-process daemon started by `daemon_factory`."""

    daemon: Daemon
    info: DaemonInfo
    data_dir: Path
    settings: dict[str, str]
    clock: FakeClock | None = None
    clients: list[StoreClient] = field(default_factory=list)
    channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def store(self) -> Store:
        assert self.daemon.store is not None, "daemon is stopped"
        return self.daemon.store

    @property
    def config(self) -> StoreConfig:
        return self.daemon.config

    @property
    def address(self) -> str:
        return self.info.address

    def client(self, *, shared_memory: bool | None, **kwargs: object) -> StoreClient:
        """A connected client (closed before the daemon stops)."""
        c = StoreClient(self.address, shared_memory=shared_memory, **kwargs)  # type: ignore[arg-type]
        self.clients.append(c)
        c.connect()
        return c

    def stub(self, **options: int) -> StoreStub:
        """A raw stub of the generated gRPC API (for malformed requests); closed at stop."""
        channel = grpc.insecure_channel(self.address, options=list(options.items()))
        self.channels.append(channel)
        return StoreStub(channel)

    def check(self) -> None:
        """The store's index and tier accounting are consistent (after every mutating sequence)."""
        self.store.check_integrity()
        self.store.tiers.dram.check_integrity()

    def tier_of(self, key: bytes) -> tuple[Tier, ...]:
        """Tiers holding a page, fastest first ((): absent), read from the index."""
        with self.store._lock:
            entry = self.store.index.get(key)
            return () if entry is None else tuple(Tier(t) for t in entry.tiers)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        for ch in self.channels:
            ch.close()
        self.channels.clear()
        segment = self.info.segment_name
        self.daemon.stop()
        assert not os.path.exists(f"/dev/shm/{segment}"), "stop() left the DRAM segment behind"


DaemonFactory = Callable[..., RunningDaemon]


class FakeClock:
    """A monotonic clock that tests move forward by hand (lease expiry without waiting)."""

    def __init__(self) -> None:
        self.skew_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew_s

    def advance(self, seconds: float) -> None:
        self.skew_s += seconds


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Start in-process daemons: `daemon_factory(dram="32MiB", ssd="64MiB", settings={...},
    data_dir=None, clock=False, config_file=None)`. `ssd=None` disables the SSD tier; a
    `config_file` (TOML: [[quota]] tables, say) is read under the settings; `settings` are dotted config
    keys (e.g. {"ssd.write_mode": "write-through"}); `clock=True` gives the store a FakeClock
    (`running.clock.advance(s)` then `store.reap_leases()`). Every daemon is stopped at teardown."""
    started: list[RunningDaemon] = []
    sock_dir = tempfile.mkdtemp(prefix="strata-t-")  # unix socket paths must stay short

    def start(
        *,
        dram: str = "32MiB",
        ssd: str | None = "64MiB",
        settings: Mapping[str, str] | None = None,
        data_dir: Path | None = None,
        clock: bool = False,
        config_file: Path | None = None,
    ) -> RunningDaemon:
        data = data_dir or tmp_path / f"data{len(started)}"
        values: dict[str, str] = {
            "server.host": "127.0.0.1",
            "server.port": "0",
            "server.metrics_port": "0",
            "server.unix_socket": os.path.join(sock_dir, f"s{len(started)}.sock"),
            "server.workers": "8",
            "data_dir": str(data),
            "dram.capacity_bytes": dram,
            # remote clients stream over gRPC; the UCX and TCP suites turn their paths on
            "server.ucx": "false",
            "server.tcp": "false",
        }
        if ssd is None:
            values["ssd.enabled"] = "false"
        else:
            values["ssd.capacity_bytes"] = ssd
        values.update(settings or {})
        daemon = Daemon(load_config(config_file, env={}, overrides=values))
        fake = FakeClock() if clock else None
        if fake is not None:  # the Daemon builds its Store itself: hand it the clock
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kvstore.server, "Store", functools.partial(Store, clock=fake))
                info = daemon.start()
        else:
            info = daemon.start()
        running = RunningDaemon(daemon, info, data, values, fake)
        started.append(running)
        return running

    try:
        yield start
    finally:
        errors: list[BaseException] = []
        for running in reversed(started):
            if running.daemon.store is None:
                continue
            try:
                running.stop()
            except BaseException as exc:  # stop the others anyway, then report
                errors.append(exc)
        shutil.rmtree(sock_dir, ignore_errors=True)
        if errors:
            raise errors[0]


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> RunningDaemon:
    """One daemon with the default small budgets (32 MiB DRAM, 64 MiB SSD)."""
    return daemon_factory()


@dataclass
class Clients:
    shm: StoreClient
    grpc: StoreClient

    def by_path(self, path: str) -> StoreClient:
        return self.shm if path == "shm" else self.grpc


@pytest.fixture
def clients(daemon: RunningDaemon) -> Clients:
    """A same-host (shared-memory) client and a gRPC-only client of `daemon`."""
    shm = daemon.client(shared_memory=True)
    grpc_client = daemon.client(shared_memory=False)
    assert (shm.transport, grpc_client.transport) == ("shm", "grpc")
    return Clients(shm, grpc_client)


@pytest.fixture
def pipelined_small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-host batches of the tests' small pages go as parts in flight, as batches of at
    least `PIPELINE_MIN_BYTES` do (client/core/requests.py)."""
    import client.core.requests

    monkeypatch.setattr(client.core.requests, "PIPELINE_MIN_BYTES", 0)


@pytest.fixture
def scope() -> Scope:
    return make_scope()


@pytest.fixture
def pages(scope: Scope) -> Callable[..., list[Page]]:
    """`pages(n, seed=0, chained=True)`: pages of `scope` (a chain, or independent leaves)."""

    def make(count: int, *, seed: int = 0, chained: bool = True) -> list[Page]:
        return chain(scope, count, seed=seed) if chained else singles(scope, count, seed=seed)

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight checkpoint folder (engine.presets, seed 0), written once a session.

    Its lm_head is untied from the embeddings: the tied tiny model's greedy output collapses to
    repeating one token, which would make "same tokens as the reference" a weak check."""
    from engine.presets import init_checkpoint  # torch: only for the suites that use it

    path = tmp_path_factory.mktemp("tiny-checkpoint")
    init_checkpoint(path, "tiny", seed=0, tie_word_embeddings=False)
    return path
