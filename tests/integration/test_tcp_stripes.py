"""Striping on the TCP data path (client/core/stripes.py): a large put or get batch goes as
contiguous parts at once, each an ordinary request on a connection of its own.

Against a real daemon on loopback, for both clients: a striped put then get is byte-exact and in
order, the stripes split unevenly where the pages do not divide; the daemon serves the stripes on
as many connections, at the same time (the first stripe is held on the daemon until the others
were reserved, so a later stripe's chain check runs before its parents are known: its chain
prefix vouches for them); a stripe whose connection the daemon drops goes over gRPC and the
others stay; a stripe the daemon refuses raises its typed error while the others' pages land; a
deadline that runs out in one stripe raises DeadlineExceeded and the client goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import DaemonFactory, RunningDaemon, buffers, keys_of, make_scope, tokens_of
from test_async_paths import Blocking, open_client
from test_ucx_path import LARGE, MEDIUM, prompt

from client import KVLayout, Page, PutStatus, StoreClient
from client.contract.errors import Corrupt, DeadlineExceeded
from client.contract.page import PageHeader
from client.contract.scope import Scope
from client.core.stripes import Striping, stripe_ranges
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

TCP_ON = {"server.tcp": "true"}
HOLD_S = 10.0  # the most a held daemon call waits for the test's signal
Client = StoreClient | Blocking


def _tcp_thread() -> bool:
    return threading.current_thread().name == "strata-tcp-conn"


class Spy:
    """Wraps the daemon store's `reserve` and `acquire`: records, for the calls its TCP
    connections make, the serving thread (one per connection) and the keys of each call; can
    hold the call that carries `first` until every other stripe's call has returned, make the
    call that carries `victim` drop its connection (`drop`) or wait for `release` (`stall`)."""

    def __init__(self, daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, tuple[bytes, ...]]] = []
        self.first: bytes | None = None
        self.others = 0
        self.victim: bytes | None = None
        self.mode = ""  # "drop" | "stall"
        self.release = threading.Event()
        self.victim_done = threading.Event()  # the held call has returned (or raised)
        self._lock = threading.Lock()
        self._served = threading.Semaphore(0)
        self._together: threading.Barrier | None = None
        store = daemon.store
        reserve, acquire = store.reserve, store.acquire

        def spied_reserve(scope: Scope, raw_headers: Sequence[bytes], *a: Any, **k: Any) -> Any:
            keys = tuple(PageHeader.decode(bytes(h)).key for h in raw_headers)
            return self._around("reserve", keys, lambda: reserve(scope, raw_headers, *a, **k))

        def spied_acquire(digest: bytes, keys: Sequence[bytes], *a: Any, **k: Any) -> Any:
            return self._around("acquire", tuple(keys), lambda: acquire(digest, keys, *a, **k))

        monkeypatch.setattr(store, "reserve", spied_reserve)
        monkeypatch.setattr(store, "acquire", spied_acquire)

    def _around(self, what: str, keys: tuple[bytes, ...], call: Callable[[], Any]) -> Any:
        if not _tcp_thread():
            return call()
        with self._lock:
            self.calls.append((what, threading.get_ident(), keys))
        if self.victim is not None and self.victim in keys:
            if self.mode == "drop":
                raise RuntimeError("test: this connection ends")  # the daemon closes it
            if self.mode == "stall":
                self.release.wait(HOLD_S)
                try:
                    return call()
                finally:
                    self.victim_done.set()
        if self.first is not None and self.first in keys:
            for _ in range(self.others):  # the other stripes are served meanwhile
                assert self._served.acquire(timeout=HOLD_S), "the stripes did not run at once"
            return call()
        if self.first is not None and self.others > 1:  # and at the same time as each other
            with self._lock:
                if self._together is None or self._together.broken:
                    self._together = threading.Barrier(self.others, timeout=HOLD_S)
                together = self._together
            together.wait()
        try:
            return call()
        finally:
            if self.first is not None:
                self._served.release()

    def of(self, what: str) -> list[tuple[int, tuple[bytes, ...]]]:
        return [(t, k) for w, t, k in self.calls if w == what]

    def reset(self) -> None:
        self.calls.clear()


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> RunningDaemon:
    return daemon_factory(dram="128MiB", ssd=None, settings=TCP_ON)


@pytest.fixture
def async_made() -> Iterator[list[Blocking]]:
    made: list[Blocking] = []
    yield made
    for c in made:
        c.close()


def _client(
    kind: str, daemon: RunningDaemon, made: list[Blocking], stripes: int, **options: Any
) -> Client:
    settings = {"shared_memory": False, "tcp_stripes": stripes, "tcp_stripe_min_bytes": 1}
    if kind == "async":
        return open_client(made, daemon, **settings, **options)
    return daemon.client(**settings, **options)  # type: ignore[arg-type]


def _stripes(pages: Sequence[Page], count: int) -> list[range]:
    ranges = stripe_ranges([p.header.payload_bytes for p in pages], Striping(count, 1))
    assert ranges is not None
    return ranges


def _read(client: Client, scope: Scope, pages: Sequence[Page]) -> list[bytes | None]:
    into = buffers(scope, len(pages))
    got = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    return [bytes(b) if h is not None else None for h, b in zip(got.headers, into, strict=True)]


def _tcp_bytes(daemon: RunningDaemon, path: str, direction: str) -> int:
    moved = daemon.store.counters.bytes_moved
    return sum(v for (p, d, _), v in moved.items() if p == path and d == direction)


CASES = [
    pytest.param("sync", MEDIUM, 7, 3, id="sync-256KiB-7-pages-3-stripes"),
    pytest.param("sync", LARGE, 5, 2, id="sync-1.5MiB-5-pages-2-stripes"),
    pytest.param("async", MEDIUM, 5, 2, id="async-256KiB-5-pages-2-stripes"),
]


@pytest.mark.parametrize(("kind", "layout", "count", "stripes"), CASES)
def test_a_striped_put_and_get_round_trip_on_parallel_connections(
    daemon: RunningDaemon,
    monkeypatch: pytest.MonkeyPatch,
    async_made: list[Blocking],
    kind: str,
    layout: KVLayout,
    count: int,
    stripes: int,
) -> None:
    spy = Spy(daemon, monkeypatch)
    client = _client(kind, daemon, async_made, stripes)
    scope = make_scope(layout=layout)
    pages = prompt(scope, count, seed=count)  # one chain from the scope digest
    parts = _stripes(pages, stripes)
    assert len({len(r) for r in parts}) == 2  # the pages do not divide: stripes of two sizes
    spy.first, spy.others = pages[0].header.key, stripes - 1

    # stripe 1 is held on the daemon until the others were reserved: each later stripe's chain
    # check runs before its parents are known, and passes on the chain prefix it carries
    assert client.put(scope, pages).statuses == (PutStatus.STORED,) * count
    assert client.transport == "tcp"
    reserves = spy.of("reserve")
    assert sorted(keys for _, keys in reserves) == sorted(
        tuple(keys_of(pages[r.start : r.stop])) for r in parts
    )
    assert len({thread for thread, _ in reserves}) == stripes  # a connection each
    assert _tcp_bytes(daemon, "tcp", "in") == count * scope.page_payload_bytes
    server = daemon.daemon._tcp
    assert server is not None
    # all kept for the next call (and the async client's probe connection, made when it settled
    # the bulk path)
    kept = stripes + (1 if kind == "async" else 0)
    assert server.connection_count() == kept

    spy.reset()
    assert _read(client, scope, pages) == [bytes(p.payload) for p in pages]  # exact, in order
    acquires = spy.of("acquire")
    assert sorted(keys for _, keys in acquires) == sorted(
        tuple(keys_of(pages[r.start : r.stop])) for r in parts
    )
    assert len({thread for thread, _ in acquires}) == stripes
    assert server.connection_count() == kept  # the put's connections, reused
    assert client.transport == "tcp"
    daemon.check()


def test_a_batch_under_the_threshold_or_with_striping_off_goes_whole(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(daemon, monkeypatch)
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 4, seed=5)
    under = daemon.client(
        shared_memory=False, tcp_stripes=2, tcp_stripe_min_bytes=5 * scope.page_payload_bytes
    )
    assert under.put(scope, pages[:2]).stored == 2
    off = daemon.client(shared_memory=False, tcp_stripes=1, tcp_stripe_min_bytes=1)
    assert off.put(scope, pages[2:]).stored == 2
    assert _read(off, scope, pages) == [bytes(p.payload) for p in pages]
    assert [len(keys) for _, keys in spy.of("reserve")] == [2, 2]
    assert [len(keys) for _, keys in spy.of("acquire")] == [4]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stripe_whose_connection_drops_goes_over_grpc_and_the_others_stay(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch, async_made: list[Blocking], kind: str
) -> None:
    spy = Spy(daemon, monkeypatch)
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 6, seed=9)
    last = _stripes(pages, 2)[1]
    spy.victim, spy.mode = pages[last.start].header.key, "drop"
    page_bytes = scope.page_payload_bytes

    client = _client(kind, daemon, async_made, 2)
    assert client.put(scope, pages).statuses == (PutStatus.STORED,) * 6
    assert _tcp_bytes(daemon, "tcp", "in") == last.start * page_bytes  # the first stripe
    assert _tcp_bytes(daemon, "grpc", "in") == len(last) * page_bytes  # the dropped one
    assert client.transport == "grpc"  # as after any failure of the TCP path itself

    reader = _client(kind, daemon, async_made, 2)
    assert _read(reader, scope, pages) == [bytes(p.payload) for p in pages]
    assert reader.transport == "grpc"  # its dropped stripe came over gRPC
    dropped = [k for _, k in spy.of("acquire") if spy.victim in k]
    assert dropped and all(k == tuple(keys_of(pages[last.start :])) for k in dropped)
    daemon.check()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refused_stripe_raises_its_error_and_the_other_stripes_land(
    daemon: RunningDaemon, async_made: list[Blocking], kind: str
) -> None:
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 6, seed=21)
    first, last = _stripes(pages, 2)
    flipped = bytearray(pages[last.start + 1].payload)
    flipped[3] ^= 0x10  # damaged after its header was built: the daemon's check refuses it
    sent = [*pages]
    sent[last.start + 1] = Page(pages[last.start + 1].header, bytes(flipped))

    client = _client(kind, daemon, async_made, 2)
    with pytest.raises(Corrupt) as refused:
        client.put(scope, sent)
    assert any(f"pages {last.start}..{last.stop - 1}" in n for n in refused.value.__notes__)
    want = [bytes(p.payload) for p in pages]
    assert _read(client, scope, pages) == [*want[: first.stop], *[None] * len(last)]
    assert client.transport == "tcp"  # the refusal was the daemon's answer, not a broken path
    again = client.put(scope, pages).statuses
    assert again == (PutStatus.ALREADY_PRESENT,) * len(first) + (PutStatus.STORED,) * len(last)
    assert _read(client, scope, pages) == want
    daemon.check()


@pytest.mark.parametrize(("kind", "call"), [("sync", "put"), ("sync", "get"), ("async", "get")])
def test_a_deadline_that_runs_out_in_one_stripe_raises_and_the_client_goes_on(
    daemon: RunningDaemon,
    monkeypatch: pytest.MonkeyPatch,
    async_made: list[Blocking],
    kind: str,
    call: str,
) -> None:
    spy = Spy(daemon, monkeypatch)
    scope = make_scope(layout=MEDIUM)
    pages = prompt(scope, 6, seed=33)
    first, last = _stripes(pages, 2)
    client = _client(kind, daemon, async_made, 2, timeout_s=1.0)
    if call == "get":
        assert client.put(scope, pages).stored == 6
    spy.victim, spy.mode = pages[last.start].header.key, "stall"
    try:
        with pytest.raises(DeadlineExceeded):
            if call == "put":
                client.put(scope, pages)
            else:
                client.get(scope, keys_of(pages), buffers(scope, 6), tokens=tokens_of(pages))
    finally:
        spy.release.set()
    spy.victim = None
    assert spy.victim_done.wait(HOLD_S)  # then its lease ends with its transfer
    assert wait_for(lambda: daemon.store.stats().active_leases == 0, timeout_s=HOLD_S)
    assert client.transport == "tcp"  # a deadline is the call's failure, not the path's
    if call == "put":  # the stripe that ran to its end stored its pages
        again = client.put(scope, pages).statuses
        assert again[: len(first)] == (PutStatus.ALREADY_PRESENT,) * len(first)
        # the held stripe's bytes were all sent before the client gave up: the daemon may
        # still have stored them once it went on
        assert set(again[len(first) :]) <= {PutStatus.STORED, PutStatus.ALREADY_PRESENT}
    assert _read(client, scope, pages) == [bytes(p.payload) for p in pages]
    assert client.transport == "tcp"
