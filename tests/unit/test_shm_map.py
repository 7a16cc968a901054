"""The same-host data path (client/transports/shm.py): mapping a segment, refusing what cannot be mapped,
copying into reserved slots and out of leased ones, and both clients on that path against a
canned same-host store that serves a segment this test creates under /dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from client import (
    AsyncStoreClient,
    InvalidArgument,
    KVLayout,
    LeaseExpired,
    Page,
    PutStatus,
    Scope,
    StoreClient,
    StrataError,
    Tier,
    Unavailable,
    build_pages,
)
from client.contract.page import PageHeader
from client.contract.types import GetResult, Limits, NodeInfo, Segment
from client.transports.hostid import host_id
from client.transports.shm import (
    SHM_DIR,
    map_node_segments,
    open_segment,
    read_acquired,
    segment_path,
    try_map,
    write_reserved,
)
from kvstore.lane import LaneServer
from kvstore_pb import API_VERSION
from kvstore_pb import store_pb2 as pb
from kvstore_pb import store_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm"),
]

SIZE = 1 << 16
SCOPE = Scope(
    model_id="tiny",
    weights_revision="w1",
    tokenizer_fingerprint="tok1",
    kv_dtype="float16",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
)
PAGE_BYTES = SCOPE.page_payload_bytes


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(PAGE_BYTES))


def pages_of(count: int) -> list[Page]:
    tokens = list(range(7, 7 + 4 * count))
    return build_pages(SCOPE, tokens, [payload(i) for i in range(count)])


def create_segment_file(name: str, size: int) -> str:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


@pytest.fixture
def segment() -> Iterator[Segment]:
    name = f"strata-test-{uuid.uuid4().hex}"
    path = create_segment_file(name, SIZE)
    try:
        yield Segment(tier=Tier.DRAM, name=name, size_bytes=SIZE)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def read_file(seg: Segment, offset: int, length: int) -> bytes:
    with open(segment_path(seg.name), "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def node_with(segments: tuple[Segment, ...], host: str | None = None) -> NodeInfo:
    return NodeInfo(
        node_id="n",
        host_id=host if host is not None else host_id(),
        api_version=API_VERSION,
        server_version="t",
        tiers=(),
        limits=Limits(0, 0, 0, 0, 0),
        segments=segments,
        local_address="",
    )


# ---- SegmentMap ---------------------------------------------------------------------------


def test_map_writes_are_visible_in_the_file(segment: Segment) -> None:
    seg = try_map(segment)
    assert seg is not None and seg.size_bytes == SIZE
    view = seg.view(1000, 5)
    view[:] = b"hello"
    assert read_file(segment, 1000, 5) == b"hello"
    with open(segment_path(segment.name), "r+b") as fh:
        fh.seek(SIZE - 3)
        fh.write(b"xyz")
    assert bytes(seg.view(SIZE - 3, 3)) == b"xyz"
    assert seg.is_current()
    del view
    seg.close()
    seg.close()  # idempotent
    assert seg.closed
    with pytest.raises(InvalidArgument, match="closed"):
        seg.view(0, 1)


def test_view_bounds_are_checked(segment: Segment) -> None:
    with open_segment(segment) as seg:
        assert len(seg.view(SIZE - 1, 1)) == 1
        assert len(seg.view(SIZE, 0)) == 0
        for offset, length in ((SIZE, 1), (-1, 2), (0, SIZE + 1), (5, -1)):
            with pytest.raises(InvalidArgument, match="outside"):
                seg.view(offset, length)


def test_close_with_a_view_still_held_does_not_raise(segment: Segment) -> None:
    seg = open_segment(segment)
    held = seg.view(0, 16)
    seg.close()
    held[:4] = b"abcd"  # the memory lives until the last view goes
    assert read_file(segment, 0, 4) == b"abcd"
    held.release()


def test_refuses_missing_wrong_size_and_odd_files(segment: Segment) -> None:
    assert try_map(Segment(Tier.DRAM, f"strata-missing-{uuid.uuid4().hex}", SIZE)) is None
    assert try_map(Segment(Tier.DRAM, segment.name, SIZE * 2)) is None
    assert try_map(Segment(Tier.DRAM, segment.name, 0)) is None
    assert try_map(Segment(Tier.DRAM, "../etc/passwd", SIZE)) is None
    assert try_map(Segment(Tier.DRAM, "", SIZE)) is None
    with pytest.raises(Unavailable, match="announced"):
        open_segment(Segment(Tier.DRAM, segment.name, SIZE - 1))
    dirname = f"strata-dir-{uuid.uuid4().hex}"
    os.mkdir(os.path.join(SHM_DIR, dirname))
    try:
        assert try_map(Segment(Tier.DRAM, dirname, SIZE)) is None
    finally:
        os.rmdir(os.path.join(SHM_DIR, dirname))
    link = f"strata-link-{uuid.uuid4().hex}"
    os.symlink(segment_path(segment.name), os.path.join(SHM_DIR, link))
    try:
        assert try_map(Segment(Tier.DRAM, link, SIZE)) is None  # never follow a link
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
    # A POSIX name may carry its leading slash.
    seg = try_map(Segment(Tier.DRAM, "/" + segment.name, SIZE))
    assert seg is not None
    seg.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_refuses_a_segment_it_may_not_open(segment: Segment) -> None:
    os.chmod(segment_path(segment.name), 0o400)
    assert try_map(segment) is None


def test_is_current_notices_a_recreated_segment(segment: Segment) -> None:
    with open_segment(segment) as seg:
        path = segment_path(segment.name)
        os.unlink(path)
        assert not seg.is_current()
        create_segment_file(segment.name, SIZE)
        assert not seg.is_current()


def test_map_node_segments_chooses_the_path(segment: Segment) -> None:
    assert map_node_segments(node_with((segment,)), wanted=False) == ()
    maps = map_node_segments(node_with((segment,)), wanted=None)
    assert [m.segment for m in maps] == [segment]
    for m in maps:
        m.close()
    assert map_node_segments(node_with((segment,), host="elsewhere"), wanted=None) == ()
    with pytest.raises(Unavailable, match="another host"):
        map_node_segments(node_with((segment,), host="elsewhere"), wanted=True)
    with pytest.raises(Unavailable, match="no shared-memory segment"):
        map_node_segments(node_with(()), wanted=True)
    missing = Segment(Tier.DRAM, f"strata-missing-{uuid.uuid4().hex}", SIZE)
    assert map_node_segments(node_with((segment, missing)), wanted=None) == ()
    with pytest.raises(Unavailable, match="cannot open"):
        map_node_segments(node_with((segment, missing)), wanted=True)


# ---- slot copies --------------------------------------------------------------------------


def test_write_reserved_fills_slots_and_skips_present_pages(segment: Segment) -> None:
    views = [memoryview(payload(0)), memoryview(payload(1))]
    reply = pb.ReserveResponse(
        lease_id=7,
        slots=[
            pb.Slot(reserved=True, segment=0, offset=4096, length=PAGE_BYTES),
            pb.Slot(reserved=False),
        ],
    )
    with open_segment(segment) as seg:
        statuses = write_reserved(reply, [seg], views)
        assert statuses == (PutStatus.STORED, PutStatus.ALREADY_PRESENT)
        assert read_file(segment, 4096, PAGE_BYTES) == payload(0)
        bad_replies = [
            pb.ReserveResponse(lease_id=7, slots=[pb.Slot(reserved=False)]),
            pb.ReserveResponse(
                lease_id=7, slots=[pb.Slot(reserved=True, length=PAGE_BYTES - 1)] * 2
            ),
            pb.ReserveResponse(
                lease_id=7, slots=[pb.Slot(reserved=True, segment=1, length=PAGE_BYTES)] * 2
            ),
            pb.ReserveResponse(
                lease_id=7, slots=[pb.Slot(reserved=True, offset=SIZE, length=PAGE_BYTES)] * 2
            ),
            pb.ReserveResponse(lease_id=0, slots=[pb.Slot(reserved=True, length=PAGE_BYTES)] * 2),
        ]
        for bad in bad_replies:
            with pytest.raises(StrataError, match="malformed"):
                write_reserved(bad, [seg], views)


def test_read_acquired_copies_and_checks(segment: Segment) -> None:
    pages = pages_of(4)
    keys = [p.header.key for p in pages]
    with open_segment(segment) as seg:
        for i in range(4):
            seg.view(i * PAGE_BYTES, PAGE_BYTES)[:] = payload(i)
        seg.view(2 * PAGE_BYTES, 1)[:] = bytes([payload(2)[0] ^ 0xFF])  # corrupt page 2

        def acquired(i: int, header: PageHeader | None = None) -> pb.AcquiredPage:
            return pb.AcquiredPage(
                present=True,
                tier=pb.TIER_DRAM,
                segment=0,
                offset=i * PAGE_BYTES,
                length=PAGE_BYTES,
                header=(header or pages[i].header).encode(),
            )

        reply = pb.AcquireResponse(
            lease_id=3,
            pages=[acquired(0), acquired(1, pages[0].header), acquired(2), pb.AcquiredPage()],
        )
        into = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
        headers, corrupt = read_acquired(reply, [seg], SCOPE, keys, into, verify=False)
        assert headers == (pages[0].header.encode(), None, pages[2].header.encode(), None)
        assert GetResult(headers).headers == (pages[0].header, None, pages[2].header, None)
        assert corrupt == 1  # page 1 came with another page's header
        assert bytes(into[0]) == payload(0)
        # the same-host path hashes no payload, verify or not: what the daemon holds in DRAM is
        # delivered (the daemon checks a page where its bytes can be damaged: SSD, network, a
        # writer's checksum), so the flipped byte of page 2 comes through as it is
        headers, corrupt = read_acquired(reply, [seg], SCOPE, keys, into, verify=True)
        assert GetResult(headers).headers == (pages[0].header, None, pages[2].header, None)
        assert corrupt == 1 and bytes(into[2]) != payload(2)
        out_of_bounds = pb.AcquireResponse(
            lease_id=3, pages=[pb.AcquiredPage(present=True, offset=SIZE, length=PAGE_BYTES,
                                               header=pages[0].header.encode())]
        )  # fmt: skip
        headers, corrupt = read_acquired(
            out_of_bounds, [seg], SCOPE, keys[:1], into[:1], verify=False
        )
        assert headers == (None,) and corrupt == 1
        with pytest.raises(StrataError, match="malformed"):
            read_acquired(reply, [seg], SCOPE, keys[:2], into[:2], verify=False)
        no_lease = pb.AcquireResponse(lease_id=0, pages=[acquired(0)])
        with pytest.raises(StrataError, match="without a lease"):
            read_acquired(no_lease, [seg], SCOPE, keys[:1], into[:1], verify=False)


# ---- a canned same-host store -------------------------------------------------------------


@dataclass
class Lease:
    headers: list[bytes]
    slots: list[pb.Slot]


@dataclass
class SameHostStore(pb_grpc.StoreServicer):
    """Reserve/Commit and Acquire/Release over a segment the test owns; a bump allocator."""

    segment: Segment
    local_address: str = ""
    lane: LaneServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: Counter[str] = field(default_factory=Counter)
    peers: list[str] = field(default_factory=list)
    pages: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)  # key -> header, offset
    leases: dict[int, Lease] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    next_offset: int = 0
    next_lease: int = 1
    fail_commit: bool = False

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls[method] += 1
            self.peers.append(context.peer())

    def NodeInfo(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("NodeInfo", context)
        return pb.NodeInfoResponse(
            node_id="same-host",
            host_id=host_id(),
            api_version=API_VERSION,
            limits=pb.Limits(chunk_bytes=1 << 16, lease_ttl_ms=5000),
            segments=[
                pb.SharedSegment(
                    tier=pb.TIER_DRAM, name=self.segment.name, size_bytes=self.segment.size_bytes
                )
            ],
            local_address=self.local_address,
        )

    def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Lookup", context)
        keys = [request.keys[i : i + 16] for i in range(0, len(request.keys), 16)]
        hits = 0
        while hits < len(keys) and keys[hits] in self.pages:
            hits += 1
        return pb.LookupResponse(hit_count=hits, tiers=[pb.TIER_DRAM] * hits)

    def Reserve(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Reserve", context)
        Scope.decode(request.scope)
        slots = []
        with self.lock:
            for raw in request.headers:
                header = PageHeader.decode(raw)
                if header.key in self.pages:
                    slots.append(pb.Slot(reserved=False))
                    continue
                slots.append(
                    pb.Slot(
                        reserved=True,
                        segment=0,
                        offset=self.next_offset,
                        length=header.payload_bytes,
                    )
                )
                self.next_offset += header.payload_bytes
            lease_id = self.next_lease
            self.next_lease += 1
            self.leases[lease_id] = Lease(list(request.headers), slots)
        return pb.ReserveResponse(lease_id=lease_id, slots=slots)

    def Commit(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Commit", context)
        if self.fail_commit:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "lease ran out")
        lease = self.leases.pop(request.lease_id)
        stored = 0
        for raw, slot in zip(lease.headers, lease.slots, strict=True):
            if slot.reserved:
                self.pages[PageHeader.decode(raw).key] = (raw, slot.offset)
                stored += 1
        return pb.CommitResponse(stored=stored)

    def Acquire(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Acquire", context)
        keys = [request.keys[i : i + 16] for i in range(0, len(request.keys), 16)]
        out = []
        for key in keys:
            if key not in self.pages:
                out.append(pb.AcquiredPage(present=False))
                continue
            raw, offset = self.pages[key]
            out.append(
                pb.AcquiredPage(
                    present=True,
                    tier=pb.TIER_DRAM,
                    segment=0,
                    offset=offset,
                    length=PageHeader.decode(raw).payload_bytes,
                    header=raw,
                )
            )
        with self.lock:
            lease_id = self.next_lease if any(p.present for p in out) else 0
            if lease_id:
                self.next_lease += 1
                self.leases[lease_id] = Lease([], [])
        return pb.AcquireResponse(lease_id=lease_id, pages=out)

    def Release(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Release", context)
        with self.lock:
            known = self.leases.pop(request.lease_id, None) is not None
            self.released.append(request.lease_id)
        return pb.ReleaseResponse(released=known)

    def Put(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self._enter("Put", context)
        begin = next(iter(request_iterator)).begin
        for _ in request_iterator:
            pass
        return pb.PutResponse(statuses=[pb.PUT_STATUS_STORED] * begin.page_count)


@dataclass
class Served:
    store: SameHostStore
    address: str


def serve(segment: Segment, *, unix: bool) -> tuple[grpc.Server, Served, str]:
    """A gRPC server for a fake store; with `unix`, also its same-host lane."""
    store = SameHostStore(segment)
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_StoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    sock_dir = tempfile.mkdtemp(prefix="strata-sock-")
    if unix:
        lane = LaneServer(f"{sock_dir}/store.sock", store, 1 << 24)  # type: ignore[arg-type]
        lane.start()
        store.lane = lane
        store.local_address = f"lane:{sock_dir}/store.sock"
    server.start()
    return server, Served(store, f"127.0.0.1:{port}"), sock_dir


@pytest.fixture
def same_host(segment: Segment) -> Iterator[Served]:
    server, served, sock_dir = serve(segment, unix=False)
    try:
        yield served
    finally:
        server.stop(0)
        os.rmdir(sock_dir)


@pytest.fixture
def same_host_unix(segment: Segment) -> Iterator[Served]:
    server, served, sock_dir = serve(segment, unix=True)
    try:
        yield served
    finally:
        server.stop(0)
        if served.store.lane is not None:
            served.store.lane.stop()
        for leftover in Path(sock_dir).iterdir():
            leftover.unlink()
        os.rmdir(sock_dir)


def test_put_and_get_through_shared_memory(same_host: Served, segment: Segment) -> None:
    store = same_host.store
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    with StoreClient(same_host.address) as client:
        client.connect()
        assert client.transport == "shm"
        first = client.put(SCOPE, pages[:2])
        assert first.statuses == (PutStatus.STORED, PutStatus.STORED)
        assert read_file(segment, PAGE_BYTES, PAGE_BYTES) == payload(1)
        again = client.put(SCOPE, pages)
        assert again.statuses == (
            PutStatus.ALREADY_PRESENT,
            PutStatus.ALREADY_PRESENT,
            PutStatus.STORED,
        )
        into = [bytearray(PAGE_BYTES) for _ in range(4)]
        result = client.get(SCOPE, [*keys, bytes(16)], into, tokens=None)
        assert [h.key if h else None for h in result.headers] == [*keys, None]
        assert [bytes(b) for b in into[:3]] == [payload(0), payload(1), payload(2)]
        assert client.corrupt_pages == 0
        # A same-host get hashes no payload, verify or not (client/transports/shm.py): the
        # daemon checks bytes where they can be damaged, not in its own DRAM.
        with open(segment_path(segment.name), "r+b") as fh:
            fh.write(bytes([payload(0)[0] ^ 1]))
        assert client.get(SCOPE, keys[:1], into[:1], tokens=None).hit_count == 1
        assert client.get(SCOPE, keys[:1], into[:1], tokens=None, verify=True).hit_count == 1
        assert client.corrupt_pages == 0
        # Another tier than DRAM goes over the gRPC data path.
        assert client.put(SCOPE, pages[:1], tier=Tier.SSD).stored == 1
    assert store.calls["Reserve"] == 2 and store.calls["Commit"] == 2
    assert store.calls["Acquire"] == 3 and store.calls["Put"] == 1
    assert store.calls["Get"] == 0
    assert sorted(store.released) == [3, 4, 5]  # every acquire lease, released by close at last
    assert not store.leases


def test_failed_commit_releases_the_reservation(same_host: Served) -> None:
    store = same_host.store
    store.fail_commit = True
    with StoreClient(same_host.address) as client, pytest.raises(LeaseExpired, match="ran out"):
        client.put(SCOPE, pages_of(2))
    assert store.calls["Commit"] == 1  # Commit is never retried
    assert store.released == [1] and not store.leases


def test_control_traffic_moves_to_the_lane(same_host_unix: Served) -> None:
    store = same_host_unix.store
    with StoreClient(same_host_unix.address) as client:
        client.connect()
        assert client.transport == "shm"
        client.lookup(SCOPE, [bytes(16)])
    assert store.peers[0].startswith("ipv4:")  # the first NodeInfo
    assert store.peers[1:] and all(p == "lane" for p in store.peers[1:]), store.peers


def test_unusable_local_address_falls_back_to_tcp(same_host: Served) -> None:
    same_host.store.local_address = "lane:/nonexistent/strata.sock"
    with StoreClient(same_host.address, timeout_s=3) as client:
        client.connect()
        assert client.lookup(SCOPE, [bytes(16)]).hit_count == 0
        assert client.transport == "shm"
    assert all(p.startswith("ipv4:") for p in same_host.store.peers)


def test_shared_memory_false_keeps_grpc(same_host: Served) -> None:
    with StoreClient(same_host.address, shared_memory=False) as client:
        client.connect()
        assert client.transport == "grpc"


def test_forced_shared_memory_without_a_segment_is_unavailable(same_host: Served) -> None:
    os.unlink(segment_path(same_host.store.segment.name))
    with (
        StoreClient(same_host.address, shared_memory=True) as client,
        pytest.raises(Unavailable, match="cannot open"),
    ):
        client.connect()
    with StoreClient(same_host.address) as client:
        client.connect()
        assert client.transport == "grpc"


def test_a_restarted_daemon_is_noticed_and_reconnected(same_host: Served, segment: Segment) -> None:
    pages = pages_of(1)
    with StoreClient(same_host.address) as client:
        client.put(SCOPE, pages)
        path = segment_path(segment.name)
        os.unlink(path)
        create_segment_file(segment.name, SIZE)  # what a restarted daemon does
        with pytest.raises(Unavailable, match="restarted"):
            client.get(SCOPE, [pages[0].header.key], [bytearray(PAGE_BYTES)], tokens=None)
        assert client.lookup(SCOPE, [pages[0].header.key]).hit_count == 1
        assert client.transport == "shm"
    assert same_host.store.calls["NodeInfo"] == 2
    assert not same_host.store.leases


def test_async_client_through_shared_memory(same_host: Served, segment: Segment) -> None:
    store = same_host.store
    pages = pages_of(2)
    keys = [p.header.key for p in pages]

    async def scenario() -> None:
        async with AsyncStoreClient(same_host.address) as client:
            await client.connect()
            assert client.transport == "shm"
            assert (await client.put(SCOPE, pages)).stored == 2
            into = [bytearray(PAGE_BYTES) for _ in keys]
            result = await client.get(SCOPE, keys, into, tokens=None)
            assert result.prefix_hits == 2
            assert [bytes(b) for b in into] == [payload(0), payload(1)]
            store.fail_commit = True
            with pytest.raises(LeaseExpired):
                await client.put(SCOPE, pages_of(3))

    asyncio.run(scenario())
    assert store.calls["Get"] == 0 and store.calls["Acquire"] == 1
    assert sorted(store.released) == [2, 3] and not store.leases
