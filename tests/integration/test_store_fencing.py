"""Fencing: a client process stalled past its lease (SIGSTOP) never makes the store serve bytes
that are not the page's own.

Each test runs a real client in a subprocess that stops itself at the worst moment (between
Reserve and its copy; between Acquire and its copy; after the first message of a remote get
stream), lets the lease run out (the store's clock is moved, then its sweep runs), makes another
page take the slot, resumes the client (SIGCONT), and checks every page served, byte for byte,
against what was put. Writers are fenced by the quarantine of expired reservations' slots
(kvstore/fence.py); readers by slot generations (kvstore/tiers/dram.py, client/transports/shm.py).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import PAGE_BYTES, DaemonFactory, RunningDaemon, keys_of, read_back, singles

from client import IoClass, Page, Scope, StoreClient
from client.contract.errors import DeadlineExceeded
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NO_WATERMARKS = {"dram.high_watermark": "1.0", "dram.low_watermark": "1.0"}
DRAM_PAGES = (1 << 20) // PAGE_BYTES  # 64

# A client that stops itself (SIGSTOP) just before the copy of its call, then carries on.
_STALLED_CLIENT = r"""
import os, signal, sys
import client.store_client as sc
from client import Page, PageHeader, Scope, StoreClient
from client.contract.errors import StrataError

mode, address, folder = sys.argv[1:4]
scope = Scope.decode(open(os.path.join(folder, "scope"), "rb").read())

def stop_here(what, offsets):
    print(what, *offsets, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)

def load_pages():
    heads = open(os.path.join(folder, "headers"), "rb").read().split(b"\n--\n")
    payloads = open(os.path.join(folder, "payloads"), "rb").read()
    size = scope.page_payload_bytes
    return [Page(PageHeader.decode(h), payloads[i * size:(i + 1) * size])
            for i, h in enumerate(heads)]

pages = load_pages()
keys = [p.header.key for p in pages]
if mode == "write":
    original = sc.write_reserved
    def stalled(reply, maps, views):
        stop_here("reserved", [s.offset for s in reply.slots])
        return original(reply, maps, views)
    sc.write_reserved = stalled
    client = StoreClient(address, shared_memory=True, retries=0)
    try:
        print("put", [s.name for s in client.put(scope, pages).statuses], flush=True)
    except StrataError as exc:
        print("error", type(exc).__name__, flush=True)
else:
    if mode == "read":
        original = sc.read_acquired
        def stalled(reply, maps, scope_, keys_, into, *, verify):
            stop_here("acquired", [p.offset for p in reply.pages])
            return original(reply, maps, scope_, keys_, into, verify=verify)
        sc.read_acquired = stalled
        client = StoreClient(address, shared_memory=True)
    else:  # a remote get stream over gRPC: stop after its first message
        import client.transports._wire as wire
        original = wire.GetAssembler.feed_message
        state = {"n": 0}
        def stalled(self, raw):
            state["n"] += 1
            if state["n"] == 1:
                stop_here("streaming", [])
            return original(self, raw)
        wire.GetAssembler.feed_message = stalled
        client = StoreClient(address, shared_memory=False)
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    try:
        got = client.get(scope, keys, into, tokens=None, verify=False)  # the fence, unverified
    except StrataError as exc:
        print("error", type(exc).__name__, flush=True)
    else:
        with open(os.path.join(folder, "got"), "wb") as fh:
            for h, b in zip(got.headers, into):
                fh.write(b"\x01" + bytes(b) if h is not None else b"\x00" + bytes(len(b)))
        print("got", sum(h is not None for h in got.headers), flush=True)
client.close()
"""


class Stalled:
    """The subprocess client, stopped at its copy until `resume()`."""

    def __init__(self, proc: subprocess.Popen[str], folder: Path) -> None:
        self.proc = proc
        self.folder = folder

    def line(self, timeout_s: float = 60.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "the client said nothing in time"
        return self.proc.stdout.readline().strip()

    def wait_stopped(self) -> None:
        _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"client did not stop (status {status})"

    def resume(self) -> str:
        os.kill(self.proc.pid, signal.SIGCONT)
        out = self.line()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read() if self.proc.stderr else ""
        return out

    def served(self, count: int) -> list[bytes | None]:
        raw = (self.folder / "got").read_bytes()
        step = 1 + PAGE_BYTES
        assert len(raw) == count * step
        return [raw[i * step + 1 : (i + 1) * step] if raw[i * step] else None for i in range(count)]


@contextmanager
def stalled_client(
    mode: str, d: RunningDaemon, scope: Scope, pages: list[Page], tmp_path: Path
) -> Iterator[Stalled]:
    folder = tmp_path / f"client-{mode}"
    folder.mkdir()
    (folder / "scope").write_bytes(scope.encode())
    (folder / "headers").write_bytes(b"\n--\n".join(p.header.encode() for p in pages))
    (folder / "payloads").write_bytes(b"".join(bytes(p.payload) for p in pages))
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_CLIENT, mode, d.address, str(folder)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        yield Stalled(proc, folder)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)


def expire_leases(d: RunningDaemon) -> None:
    assert d.clock is not None
    d.clock.advance(3600)
    d.store.reap_leases()


def dram_offset(d: RunningDaemon, key: bytes) -> int | None:
    with d.store._lock:
        entry = d.store.index.get(key)
        return None if entry is None else entry.dram


def test_stalled_writer_never_writes_into_another_page(
    daemon_factory: DaemonFactory, scope: Scope, tmp_path: Path
) -> None:
    d = daemon_factory(dram="1MiB", ssd=None, clock=True, settings=NO_WATERMARKS)
    shm = d.client(shared_memory=True)
    resident = singles(scope, DRAM_PAGES - 4, seed=1)
    for i in range(0, len(resident), 15):
        shm.put(scope, resident[i : i + 15])
    stale = singles(scope, 1, seed=2)
    with stalled_client("write", d, scope, stale, tmp_path) as client:
        words = client.line().split()
        assert words[0] == "reserved"
        slot = int(words[1])
        client.wait_stopped()
        expire_leases(d)  # the writer's lease runs out while it is stopped
        d.check()
        # other pages fill DRAM: on a store without the fence one of them takes the slot
        fillers = singles(scope, 4, seed=3)
        assert shm.put(scope, fillers).stored == 4
        assert slot not in {dram_offset(d, p.header.key) for p in fillers}
        out = client.resume()  # it copies into its old slot, then its commit is refused
    assert out.split()[:2] == ["error", "LeaseExpired"], out
    d.check()
    assert d.store.quarantine.blocks == 0  # the late commit freed the slot
    assert d.store.counters.stale_fenced >= 1
    present = [p for p in resident + fillers if d.tier_of(p.header.key)]
    assert len(present) >= DRAM_PAGES - 4
    assert read_back(shm, scope, present) == [bytes(p.payload) for p in present]
    assert read_back(shm, scope, stale) == [None]  # never committed
    # the key is free again: a proper put of it works
    assert shm.put(scope, stale).stored == 1
    assert read_back(shm, scope, stale) == [bytes(stale[0].payload)]
    d.check()


def test_stalled_same_host_reader_never_serves_a_reused_slot(
    daemon_factory: DaemonFactory, scope: Scope, tmp_path: Path
) -> None:
    d = daemon_factory(dram="1MiB", ssd=None, clock=True, settings=NO_WATERMARKS)
    shm = d.client(shared_memory=True)
    resident = singles(scope, DRAM_PAGES, seed=4)
    for i in range(0, len(resident), 16):
        shm.put(scope, resident[i : i + 16])
    target = resident[:1]
    with stalled_client("read", d, scope, target, tmp_path) as client:
        words = client.line().split()
        assert words[0] == "acquired"
        slot = int(words[1])
        client.wait_stopped()
        expire_leases(d)
        assert shm.delete(keys=keys_of(target)) == 1
        other = singles(scope, 1, seed=5)
        assert shm.put(scope, other).stored == 1
        assert dram_offset(d, other[0].header.key) == slot  # another page is in that slot now
        out = client.resume()
    assert out == "got 0", out  # the copy saw the slot's generation change: a miss
    served = client.served(1)
    assert served == [None]
    d.check()


def test_stalled_remote_reader_never_gets_a_reused_slot(
    daemon_factory: DaemonFactory, scope: Scope, tmp_path: Path
) -> None:
    d = daemon_factory(dram="8MiB", ssd=None, clock=True, settings=NO_WATERMARKS)
    shm = d.client(shared_memory=True)
    pages = singles(scope, 400, seed=6)  # 6.4 MiB: far more than a stream's flow-control window
    for i in range(0, len(pages), 50):
        shm.put(scope, pages[i : i + 50])
    before = d.store.counters.stale_fenced
    with stalled_client("grpc", d, scope, pages, tmp_path) as client:
        assert client.line() == "streaming"
        client.wait_stopped()
        expire_leases(d)  # the stream's read lease runs out while the daemon waits to send
        assert shm.delete(keys=keys_of(pages)) == len(pages)
        others = singles(scope, 400, seed=7)  # the freed slots now hold other pages
        for i in range(0, len(others), 50):
            assert shm.put(scope, others[i : i + 50]).stored == 50
        out = client.resume()
    if out.startswith("got"):  # the retry after the fenced stream found the pages gone
        served = client.served(len(pages))
        for got, page in zip(served, pages, strict=True):
            assert got is None or got == bytes(page.payload)
    else:
        assert out.split()[:1] == ["error"], out
    assert d.store.counters.stale_fenced > before  # the stream was stopped, not served wrong
    d.check()


@pytest.mark.parametrize("lane", [True, False])
def test_a_reserve_whose_caller_gave_up_leaves_nothing_quarantined(
    daemon_factory: DaemonFactory, scope: Scope, lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Reserve that waits (here for the background cap) past its caller's deadline: the
    caller never learns the lease, so it can neither copy nor make the late call that frees a
    quarantined slot. The daemon must give the reservation back itself, not leave it to expire
    into a quarantine that lasts as long as the (live) caller process."""
    d = daemon_factory(
        dram="1MiB",
        ssd=None,
        settings={
            **NO_WATERMARKS,
            "io.background_bytes_per_s": str(PAGE_BYTES),  # one page a second
            "limits.max_reserve_lease_ms": "300",
        },
    )
    if not lane:  # unary calls over gRPC, not the same-host lane
        monkeypatch.setattr(StoreClient, "_open_local", lambda *_: None)
    slow = d.client(shared_memory=True, timeout_s=0.3)
    first, second = singles(scope, 2, seed=8)
    assert slow.put(scope, [first], io_class=IoClass.BACKGROUND).stored == 1  # empties the bucket
    with pytest.raises(DeadlineExceeded):  # its Reserve waits about a second for the cap
        slow.put(scope, [second], io_class=IoClass.BACKGROUND)
    deadline = time.monotonic() + 10
    while d.store.scheduler.admitted_bytes(IoClass.BACKGROUND) < 2 * PAGE_BYTES:
        assert time.monotonic() < deadline, "the second Reserve was never admitted"
        time.sleep(0.02)
    while True:  # the daemon finishes that Reserve; its lease (300 ms) ends one way or another
        d.store.reap_leases()
        if len(d.store.leases) == 0:
            break
        assert time.monotonic() < deadline, "the reservation never ended"
        time.sleep(0.02)
    assert d.store.quarantine.blocks == 0
    assert d.store.tiers.dram.allocated_blocks == 1  # the first page only
    d.check()
    assert slow.put(scope, [second]).stored == 1  # the key is free


def test_a_pid_a_grpc_client_only_claims_does_not_end_its_quarantine(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """Over gRPC a client only says which process it is (a client in another PID namespace
    names a pid that, here, is some other process). A pid whose process does not even map the
    daemon's segment cannot be the writer: its exit must not free the slots of the writer's
    expired reservation while the writer may still copy into them."""
    d = daemon_factory(dram="1MiB", ssd=None, clock=True, settings=NO_WATERMARKS)
    stub = d.stub()
    first, second = singles(scope, 2, seed=9)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        res = stub.Reserve(
            pb.ReserveRequest(
                scope=scope.encode(), headers=[first.header.encode()], client_pid=bystander.pid
            ),
            timeout=10,
        )
        assert res.slots[0].reserved
        expire_leases(d)
        assert d.store.quarantine.blocks == 1
    finally:
        bystander.kill()
        bystander.wait()
    d.store.reap_leases()  # the claimed process is gone; the writer (this one) is not
    assert d.store.quarantine.blocks == 1
    stub.Release(pb.ReleaseRequest(lease_id=res.lease_id), timeout=10)  # its late call
    assert d.store.quarantine.blocks == 0
    d.check()
    # a process that maps the segment is believed: its death does end the quarantine
    d.client(shared_memory=True).stats()  # this process maps the segment now
    res = stub.Reserve(
        pb.ReserveRequest(
            scope=scope.encode(), headers=[second.header.encode()], client_pid=os.getpid()
        ),
        timeout=10,
    )
    with d.store._lock:
        assert d.store._pending_holder[res.lease_id].pid == os.getpid()
    stub.Release(pb.ReleaseRequest(lease_id=res.lease_id), timeout=10)
    d.check()
