"""The client SDK's wire (client/transports/_wire.py) and its clients on the gRPC data path.

Conversions, the status -> error mapping (with the retry-after hint), put chunking, key and buffer
checks that run before any RPC, get verification, retries of idempotent calls only, batching by
the node's key limit, and both clients end to end against a canned in-test server (the generated
StoreServicer on 127.0.0.1 port 0). The daemon itself is not used here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from client import (
    AsyncStoreClient,
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    EventKind,
    GetResult,
    InvalidArgument,
    IoClass,
    KVLayout,
    LeaseExpired,
    Page,
    PutResult,
    PutStatus,
    Scope,
    StoreClient,
    StrataError,
    Tier,
    Unavailable,
    build_pages,
    page_keys,
)
from client.contract.page import PageHeader
from client.contract.types import Limits
from client.core.steps import Join, Start
from client.transports._wire import (
    DEFAULT_RETRY_AFTER_S,
    IDEMPOTENT_METHODS,
    Deadline,
    GetAssembler,
    RetryPolicy,
    batch_ranges,
    chunk_bytes_for,
    error_from_status,
    event_from_proto,
    lookup_from_proto,
    map_rpc_error,
    node_info_from_proto,
    payload_views,
    put_requests,
    stats_from_proto,
)
from kvstore_pb import API_VERSION
from kvstore_pb import store_pb2 as pb
from kvstore_pb import store_pb2_grpc as pb_grpc

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK = 100  # the canned node's chunk size: a 256-byte page travels as 3 chunks


def make_scope(namespace: str = "") -> Scope:
    return Scope(
        model_id="tiny",
        weights_revision="w1",
        tokenizer_fingerprint="tok1",
        kv_dtype="float16",
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
        namespace=namespace,
    )


SCOPE = make_scope()
PAGE_BYTES = SCOPE.page_payload_bytes  # 256


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(PAGE_BYTES))


def pages_of(count: int, scope: Scope = SCOPE) -> list[Page]:
    tokens = list(range(100, 100 + 4 * count + 3))  # a partial tail page is never keyed
    return build_pages(scope, tokens, [payload(i) for i in range(count)])


# ---- a canned store -----------------------------------------------------------------------


@dataclass
class Failure:
    code: grpc.StatusCode
    details: str = "injected"
    trailing: tuple[tuple[str, str], ...] = ()


class CannedStore(pb_grpc.StoreServicer):
    """Just enough of the daemon's contract to exercise the client, with fault injection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.failures: dict[str, list[Failure]] = defaultdict(list)
        self.delay_s: dict[str, float] = {}
        self.host_id = "another-host"
        self.api_version = API_VERSION
        self.max_keys = 0
        self.pages: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (header, payload)
        self.flip_payload: set[bytes] = set()
        self.swap_header: set[bytes] = set()
        self.put_messages: list[pb.PutRequest] = []
        self.get_requests: list[pb.GetRequest] = []
        self.events: list[pb.Event] = []

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls[method] += 1
            failure = self.failures[method].pop(0) if self.failures[method] else None
        if method in self.delay_s:
            time.sleep(self.delay_s[method])
        if failure is not None:
            if failure.trailing:
                context.set_trailing_metadata(failure.trailing)
            context.abort(failure.code, failure.details)

    def NodeInfo(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("NodeInfo", context)
        return pb.NodeInfoResponse(
            node_id="canned-1",
            host_id=self.host_id,
            api_version=self.api_version,
            server_version="canned",
            tiers=[pb.TierInfo(tier=pb.TIER_DRAM, capacity_bytes=1 << 20, used_bytes=512)],
            limits=pb.Limits(
                max_keys_per_call=self.max_keys,
                max_page_bytes=1 << 20,
                max_message_bytes=8 << 20,
                chunk_bytes=CHUNK,
                lease_ttl_ms=5000,
            ),
        )

    def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Lookup", context)
        keys = [request.keys[i : i + 16] for i in range(0, len(request.keys), 16)]
        hits = 0
        for key in keys:
            if key not in self.pages:
                break
            hits += 1
        return pb.LookupResponse(hit_count=hits, tiers=[pb.TIER_DRAM] * hits)

    def Put(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self._enter("Put", context)
        messages = list(request_iterator)
        self.put_messages.extend(messages)
        begin = messages[0].begin
        headers: dict[int, bytes] = {}
        data: dict[int, bytearray] = defaultdict(bytearray)
        for msg in messages[1:]:
            chunk = msg.chunk
            if chunk.header:
                headers[chunk.index] = chunk.header
            assert chunk.offset == len(data[chunk.index])
            data[chunk.index] += chunk.data
        statuses = []
        for i in range(begin.page_count):
            header = PageHeader.decode(headers[i])
            header.verify_payload(bytes(data[i]))
            if header.key in self.pages:
                statuses.append(pb.PUT_STATUS_ALREADY_PRESENT)
            else:
                self.pages[header.key] = (headers[i], bytes(data[i]))
                statuses.append(pb.PUT_STATUS_STORED)
        return pb.PutResponse(statuses=statuses)

    def Get(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Get", context)
        self.get_requests.append(request)
        keys = [request.keys[i : i + 16] for i in range(0, len(request.keys), 16)]
        for i, key in enumerate(keys):
            if key not in self.pages:
                yield pb.GetResponse(missing=i)
                continue
            header, data = self.pages[key]
            if key in self.swap_header:
                header = next(h for k, (h, _) in self.pages.items() if k != key)
            if key in self.flip_payload:
                data = bytes([data[0] ^ 1]) + data[1:]
            for off in range(0, max(len(data), 1), CHUNK):
                yield pb.GetResponse(
                    chunk=pb.PageChunk(
                        index=i,
                        header=header if off == 0 else b"",
                        offset=off,
                        data=data[off : off + CHUNK],
                    )
                )

    def Delete(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Delete", context)
        if request.WhichOneof("target") == "keys":
            keys = [request.keys[i : i + 16] for i in range(0, len(request.keys), 16)]
            gone = [k for k in keys if self.pages.pop(k, None) is not None]
            return pb.DeleteResponse(deleted=len(gone))
        doomed = [k for k, (h, _) in self.pages.items() if h[12:28] == request.scope_digest]
        for k in doomed:
            del self.pages[k]
        return pb.DeleteResponse(deleted=len(doomed))

    def Stats(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Stats", context)
        return pb.StatsResponse(
            tiers=[pb.TierStats(tier=pb.TIER_SSD, capacity_bytes=10, hits=3, misses=4)],
            pages=len(self.pages),
            lookups=7,
        )

    def Watch(self, request, context):  # type: ignore[no-untyped-def]
        self._enter("Watch", context)
        yield from self.events


@dataclass
class Served:
    store: CannedStore
    address: str


@pytest.fixture
def served() -> Iterator[Served]:
    store = CannedStore()
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_StoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Served(store, f"127.0.0.1:{port}")
    finally:
        server.stop(0)


# ---- conversions --------------------------------------------------------------------------


def test_node_info_converts_every_field() -> None:
    msg = pb.NodeInfoResponse(
        node_id="n",
        host_id="h",
        api_version=1,
        server_version="v",
        tiers=[
            pb.TierInfo(tier=pb.TIER_GPU, capacity_bytes=5, used_bytes=2, pages=1, device="cpu")
        ],
        limits=pb.Limits(
            max_keys_per_call=9,
            max_page_bytes=8,
            max_message_bytes=7,
            chunk_bytes=6,
            lease_ttl_ms=5,
        ),
        segments=[pb.SharedSegment(tier=pb.TIER_DRAM, name="seg", size_bytes=4096)],
        local_address="unix:/tmp/x.sock",
    )
    node = node_info_from_proto(msg)
    assert (node.node_id, node.host_id, node.api_version, node.server_version) == ("n", "h", 1, "v")
    assert node.tiers[0].tier is Tier.GPU and node.tiers[0].device == "cpu"
    assert node.tiers[0].capacity_bytes == 5 and node.tiers[0].pages == 1
    assert node.limits == Limits(9, 8, 7, 6, 5)
    assert node.segments[0].tier is Tier.DRAM and node.segments[0].size_bytes == 4096
    assert node.local_address == "unix:/tmp/x.sock"


def test_enums_match_the_proto_values() -> None:
    assert [int(t) for t in Tier] == [pb.TIER_GPU, pb.TIER_DRAM, pb.TIER_SSD]
    assert [int(c) for c in IoClass] == [
        pb.IO_CLASS_CRITICAL,
        pb.IO_CLASS_NORMAL,
        pb.IO_CLASS_BACKGROUND,
    ]
    assert [int(s) for s in PutStatus] == [
        pb.PUT_STATUS_STORED,
        pb.PUT_STATUS_ALREADY_PRESENT,
        pb.PUT_STATUS_PENDING,
    ]
    assert [int(k) for k in EventKind] == [
        pb.EVENT_KIND_STORED,
        pb.EVENT_KIND_REMOVED,
        pb.EVENT_KIND_MOVED,
    ]


def test_stats_and_event_conversions() -> None:
    stats = stats_from_proto(
        pb.StatsResponse(
            tiers=[pb.TierStats(tier=pb.TIER_SSD, hits=3, misses=4, evictions=5)],
            pages=2,
            corrupt_dropped=1,
            lookup_hit_pages=9,
        )
    )
    assert stats.tiers[0].tier is Tier.SSD and stats.tiers[0].evictions == 5
    assert (stats.pages, stats.corrupt_dropped, stats.lookup_hit_pages) == (2, 1, 9)
    event = event_from_proto(
        pb.Event(
            seq=4, kind=pb.EVENT_KIND_STORED, key=b"k" * 16, to_tier=pb.TIER_DRAM, size_bytes=3
        )
    )
    assert event.kind is EventKind.STORED and event.from_tier is None
    assert event.to_tier is Tier.DRAM and event.seq == 4 and event.size_bytes == 3


def test_malformed_replies_raise_strata_error() -> None:
    with pytest.raises(StrataError, match="unknown tier"):
        node_info_from_proto(pb.NodeInfoResponse(tiers=[pb.TierInfo(tier=0)]))
    with pytest.raises(StrataError, match="hits"):
        lookup_from_proto(pb.LookupResponse(hit_count=3, tiers=[pb.TIER_DRAM] * 3), asked=2)
    with pytest.raises(StrataError, match="hits"):
        lookup_from_proto(pb.LookupResponse(hit_count=2, tiers=[pb.TIER_DRAM]), asked=2)


def test_result_properties() -> None:
    put = PutResult((PutStatus.STORED, PutStatus.ALREADY_PRESENT, PutStatus.STORED))
    assert (put.stored, put.already_present) == (2, 1)
    h = pages_of(1)[0].header
    get = GetResult((h, h, None, h))
    assert (get.hit_count, get.prefix_hits) == (3, 2)
    assert GetResult((None, h)).prefix_hits == 0


def test_build_pages_chains_keys_from_the_scope_digest() -> None:
    tokens = list(range(1, 14))  # 3 full pages and a tail
    keys = page_keys(SCOPE, tokens)
    pages = build_pages(SCOPE, tokens, [payload(0), payload(1), payload(2)])
    assert [p.header.key for p in pages] == keys
    assert pages[0].header.parent == SCOPE.digest
    assert pages[2].header.parent == keys[1]
    later = build_pages(SCOPE, tokens, [payload(2)], first_page=2)
    assert later[0].header == pages[2].header
    with pytest.raises(InvalidArgument):
        build_pages(SCOPE, tokens, [payload(0)] * 4)
    with pytest.raises(InvalidArgument):
        build_pages(SCOPE, tokens, [b"short"])


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityExhausted),
        (grpc.StatusCode.FAILED_PRECONDITION, LeaseExpired),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.CANCELLED, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.DATA_LOSS, Corrupt),
        (grpc.StatusCode.INTERNAL, StrataError),
        (grpc.StatusCode.NOT_FOUND, StrataError),
    ],
)
def test_status_codes_map_to_typed_errors(code: grpc.StatusCode, kind: type[StrataError]) -> None:
    error = error_from_status(code, "why")
    assert type(error) is kind
    assert "why" in str(error) and code.name in str(error)


def test_retry_after_comes_from_trailing_metadata() -> None:
    def hint(trailing: tuple[tuple[str, str | bytes], ...]) -> float:
        error = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", trailing)
        assert isinstance(error, CapacityExhausted)
        return error.retry_after_s

    assert hint((("retry-after-ms", "250"),)) == pytest.approx(0.25)
    assert hint((("other", "1"), ("Retry-After-Ms", b"1500"))) == pytest.approx(1.5)
    assert hint(()) == DEFAULT_RETRY_AFTER_S == 0.5
    assert hint((("retry-after-ms", "soon"),)) == DEFAULT_RETRY_AFTER_S


def test_map_rpc_error_reads_code_details_and_trailers() -> None:
    class FakeRpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "dram full"

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return (("retry-after-ms", "40"),)

    error = map_rpc_error(FakeRpcError())
    assert isinstance(error, CapacityExhausted) and error.retry_after_s == pytest.approx(0.04)
    assert "dram full" in str(error)
    assert isinstance(map_rpc_error(grpc.RpcError()), Unavailable)


def test_capacity_error_with_hint_over_the_wire(served: Served) -> None:
    served.store.failures["Put"].append(
        Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "dram full", (("retry-after-ms", "750"),))
    )
    with StoreClient(served.address) as client, pytest.raises(CapacityExhausted) as info:
        client.put(SCOPE, pages_of(1))
    assert info.value.retry_after_s == pytest.approx(0.75)
    assert served.store.calls["Put"] == 1  # never retried


def test_retry_policy_only_for_idempotent_calls() -> None:
    policy = RetryPolicy(retries=3)
    assert {
        "NodeInfo", "Lookup", "Get", "Acquire", "Release", "Renew", "Delete", "Stats"
    } == IDEMPOTENT_METHODS  # fmt: skip
    assert [policy.attempts_for(m) for m in ("Lookup", "Put", "Reserve", "Commit")] == [4, 1, 1, 1]
    deadline = Deadline(10.0)
    delays = [policy.delay_s(n, Unavailable("x"), deadline) for n in range(6)]
    assert all(d is not None and 0 < d <= policy.max_delay_s for d in delays)
    assert policy.delay_s(0, InvalidArgument("x"), deadline) is None
    assert policy.delay_s(0, DeadlineExceeded("x"), deadline) is None
    assert policy.delay_s(0, CapacityExhausted("x", retry_after_s=2.0), deadline) == 2.0
    assert policy.delay_s(0, CapacityExhausted("x", retry_after_s=20.0), deadline) is None


# ---- chunking and request checks ----------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
def test_put_chunks_cover_each_payload_exactly(size: int) -> None:
    data = (bytes(range(256)) * 2)[:size]
    # Chunking does not look into the header; pair any header with a payload of `size` bytes.
    fake = [Page(header=pages_of(1)[0].header, payload=data)]
    msgs = list(
        put_requests(
            SCOPE,
            fake,
            [memoryview(data)],
            io_class=IoClass.BACKGROUND,
            tier=Tier.SSD,
            chunk_bytes=CHUNK,
        )
    )
    begin = msgs[0].begin
    assert (begin.page_count, begin.io_class, begin.tier) == (
        1,
        pb.IO_CLASS_BACKGROUND,
        pb.TIER_SSD,
    )
    assert begin.scope == SCOPE.encode()
    chunks = [m.chunk for m in msgs[1:]]
    assert chunks[0].header == fake[0].header.encode()
    assert all(not c.header for c in chunks[1:])
    assert all(c.index == 0 and len(c.data) <= CHUNK for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, max(size, 1), CHUNK))
    assert b"".join(c.data for c in chunks) == data
    assert len(chunks) == max(1, -(-size // CHUNK))


def test_put_chunks_index_pages_in_order_and_unspecified_tier() -> None:
    pages = pages_of(3)
    msgs = list(
        put_requests(
            SCOPE,
            pages,
            payload_views(SCOPE, pages),
            io_class=IoClass.NORMAL,
            tier=None,
            chunk_bytes=CHUNK,
        )
    )
    assert msgs[0].begin.tier == pb.TIER_UNSPECIFIED
    indexes = [m.chunk.index for m in msgs[1:]]
    assert indexes == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_chunk_size_stays_inside_a_message() -> None:
    assert chunk_bytes_for(Limits(0, 0, 0, 4096, 0), 72 << 20) == 4096
    assert chunk_bytes_for(Limits(0, 0, 0, 0, 0), 72 << 20) == 1 << 20
    assert chunk_bytes_for(Limits(0, 0, 1 << 20, 8 << 20, 0), 72 << 20) < 1 << 20


def test_batches() -> None:
    assert batch_ranges(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert batch_ranges(5, 0) == [range(0, 5)]
    assert batch_ranges(0, 3) == []


def test_bad_keys_and_buffers_fail_before_any_rpc(served: Served) -> None:
    keys = [p.header.key for p in pages_of(2)]
    good = [bytearray(PAGE_BYTES), bytearray(PAGE_BYTES)]
    with StoreClient(served.address) as client:
        with pytest.raises(InvalidArgument, match="16-byte"):
            client.lookup(SCOPE, [keys[0], keys[1][:15]])
        with pytest.raises(InvalidArgument):
            client.lookup(SCOPE, ["x" * 16])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="2 keys but 1"):
            client.get(SCOPE, keys, good[:1], tokens=None)
        with pytest.raises(InvalidArgument, match="read-only"):
            client.get(SCOPE, keys, [good[0], bytes(PAGE_BYTES)], tokens=None)  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="holds 255 bytes"):
            client.get(SCOPE, keys, [good[0], bytearray(PAGE_BYTES - 1)], tokens=None)
        with pytest.raises(InvalidArgument, match="contiguous"):
            client.get(
                SCOPE, keys, [good[0], memoryview(bytearray(2 * PAGE_BYTES))[::2]], tokens=None
            )
        with pytest.raises(InvalidArgument, match="not a buffer"):
            client.get(SCOPE, keys, [good[0], 42], tokens=None)  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="exactly one"):
            client.delete()
        with pytest.raises(InvalidArgument, match="exactly one"):
            client.delete(SCOPE, keys)
        with pytest.raises(InvalidArgument):
            client.put(SCOPE, pages_of(1, make_scope("other-tenant")))
        bad = pages_of(1)[0]
        with pytest.raises(InvalidArgument, match="payload is 10 bytes"):
            client.put(SCOPE, [Page(bad.header, b"0123456789")])
        with pytest.raises(StrataError, match="not connected"):
            _ = client.transport
    assert sum(served.store.calls.values()) == 0  # not even NodeInfo


# ---- the sync client on the gRPC path -----------------------------------------------------


def test_round_trip_over_grpc(served: Served) -> None:
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    with StoreClient(served.address, io_class=IoClass.CRITICAL) as client:
        node = client.connect()
        assert node.node_id == "canned-1" and client.transport == "grpc"
        assert client.lookup(SCOPE, keys).hit_count == 0
        put = client.put(SCOPE, pages[:2])
        assert put.statuses == (PutStatus.STORED, PutStatus.STORED)
        again = client.put(SCOPE, pages, io_class=IoClass.BACKGROUND)
        assert again.statuses == (
            PutStatus.ALREADY_PRESENT,
            PutStatus.ALREADY_PRESENT,
            PutStatus.STORED,
        )
        looked = client.lookup(SCOPE, keys)
        assert looked.hit_count == 3 and looked.tiers == (Tier.DRAM,) * 3

        into = [bytearray(PAGE_BYTES + 10) for _ in range(4)]
        missing_key = bytes(16)
        result = client.get(SCOPE, [keys[0], keys[1], missing_key, keys[2]], into, tokens=None)
        assert result.headers[2] is None
        assert [h.key if h else None for h in result.headers] == [keys[0], keys[1], None, keys[2]]
        assert (result.hit_count, result.prefix_hits) == (3, 2)
        for i, page_i in ((0, 0), (1, 1), (3, 2)):
            assert bytes(into[i][:PAGE_BYTES]) == payload(page_i)
        assert client.corrupt_pages == 0
        assert served.store.get_requests[-1].io_class == pb.IO_CLASS_CRITICAL
        assert served.store.put_messages[-1].WhichOneof("part") == "chunk"

        assert client.delete(keys=[keys[2], missing_key]) == 1
        assert client.delete(scope=SCOPE) == 2
        assert client.lookup(SCOPE, keys).hit_count == 0
        stats = client.stats()
        assert stats.lookups == 7 and stats.tiers[0].tier is Tier.SSD
        assert client.node_info().server_version == "canned"
    assert served.store.calls["NodeInfo"] == 2  # connect + node_info()


def test_put_messages_on_the_wire(served: Served) -> None:
    pages = pages_of(2)
    with StoreClient(served.address) as client:
        client.put(SCOPE, pages, tier=Tier.SSD, io_class=IoClass.BACKGROUND)
    msgs = served.store.put_messages
    assert msgs[0].begin.tier == pb.TIER_SSD and msgs[0].begin.page_count == 2
    assert msgs[0].begin.io_class == pb.IO_CLASS_BACKGROUND
    first = [m.chunk for m in msgs[1:] if m.chunk.header]
    assert [c.index for c in first] == [0, 1]
    assert all(len(m.chunk.data) <= CHUNK for m in msgs[1:])


def test_get_drops_and_counts_corrupt_pages(served: Served) -> None:
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    with StoreClient(served.address) as client:
        client.put(SCOPE, pages)
        served.store.flip_payload.add(keys[1])
        served.store.swap_header.add(keys[2])
        into = [bytearray(PAGE_BYTES) for _ in range(3)]
        result = client.get(SCOPE, keys, into, tokens=None)
        assert result.headers[0] is not None and result.headers[1:] == (None, None)
        assert client.corrupt_pages == 2
        # Without verification the flipped payload is delivered; the wrong header never is.
        unverified = client.get(SCOPE, keys, into, tokens=None, verify=False)
        assert unverified.headers[1] is not None and unverified.headers[2] is None
        assert into[1][0] == payload(1)[0] ^ 1
        assert client.corrupt_pages == 3


def test_idempotent_calls_retry_and_others_do_not(served: Served) -> None:
    store = served.store
    keys = [p.header.key for p in pages_of(2)]
    store.failures["NodeInfo"].append(Failure(grpc.StatusCode.UNAVAILABLE))
    store.failures["Lookup"].append(Failure(grpc.StatusCode.UNAVAILABLE))
    store.failures["Get"].append(Failure(grpc.StatusCode.UNAVAILABLE))
    with StoreClient(served.address, retries=2) as client:
        assert client.lookup(SCOPE, keys).hit_count == 0
        assert store.calls["NodeInfo"] == 2 and store.calls["Lookup"] == 2
        into = [bytearray(PAGE_BYTES), bytearray(PAGE_BYTES)]
        assert client.get(SCOPE, keys, into, tokens=None).hit_count == 0
        assert store.calls["Get"] == 2
        store.failures["Put"].append(Failure(grpc.StatusCode.UNAVAILABLE, "restarting"))
        with pytest.raises(Unavailable, match="restarting"):
            client.put(SCOPE, pages_of(1))
        assert store.calls["Put"] == 1
        store.failures["Stats"].append(Failure(grpc.StatusCode.INVALID_ARGUMENT, "nope"))
        with pytest.raises(InvalidArgument, match="nope"):
            client.stats()
        assert store.calls["Stats"] == 1
        store.failures["Stats"].extend([Failure(grpc.StatusCode.UNAVAILABLE)] * 3)
        with pytest.raises(Unavailable):
            client.stats()
        assert store.calls["Stats"] == 1 + 3  # one try and two retries


def test_every_call_has_a_deadline(served: Served) -> None:
    served.store.delay_s["Stats"] = 1.0
    with StoreClient(served.address, timeout_s=0.2) as client:
        client.connect()
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.stats()
        assert time.monotonic() - started < 0.9


def test_unreachable_daemon_is_unavailable() -> None:
    with (
        StoreClient("127.0.0.1:1", timeout_s=0.5, retries=1) as client,
        pytest.raises(Unavailable),
    ):
        client.connect()


def test_other_api_version_is_refused(served: Served) -> None:
    served.store.api_version = API_VERSION + 1
    with StoreClient(served.address) as client, pytest.raises(Unavailable, match="API version"):
        client.connect()


def test_forced_shared_memory_on_another_host_is_unavailable(served: Served) -> None:
    with (
        StoreClient(served.address, shared_memory=True) as client,
        pytest.raises(Unavailable, match="another host"),
    ):
        client.connect()
    with StoreClient(served.address, shared_memory=None) as client:
        client.connect()
        assert client.transport == "grpc"


def test_calls_are_batched_by_the_node_key_limit(served: Served) -> None:
    served.store.max_keys = 2
    pages = pages_of(5)
    keys = [p.header.key for p in pages]
    with StoreClient(served.address) as client:
        put = client.put(SCOPE, pages)
        assert put.stored == 5 and served.store.calls["Put"] == 3
        assert client.lookup(SCOPE, keys).hit_count == 5
        assert served.store.calls["Lookup"] == 3
        client.delete(keys=[keys[3]])
        assert client.lookup(SCOPE, keys).hit_count == 3
        assert served.store.calls["Lookup"] == 3 + 2  # stops at the first short batch
        result = client.get(SCOPE, keys, [bytearray(PAGE_BYTES) for _ in keys], tokens=None)
        assert [h is not None for h in result.headers] == [True, True, True, False, True]
        assert served.store.calls["Get"] == 3


def test_watch_yields_typed_events(served: Served) -> None:
    served.store.events = [
        pb.Event(seq=1, kind=pb.EVENT_KIND_STORED, key=b"a" * 16, to_tier=pb.TIER_DRAM),
        pb.Event(seq=2, kind=pb.EVENT_KIND_MOVED, key=b"a" * 16, from_tier=pb.TIER_DRAM,
                 to_tier=pb.TIER_SSD),
    ]  # fmt: skip
    with StoreClient(served.address) as client:
        events = list(client.watch(SCOPE, timeout_s=5))
    assert [(e.seq, e.kind, e.from_tier, e.to_tier) for e in events] == [
        (1, EventKind.STORED, None, Tier.DRAM),
        (2, EventKind.MOVED, Tier.DRAM, Tier.SSD),
    ]


def test_closed_client_refuses_calls(served: Served) -> None:
    client = StoreClient(served.address)
    client.connect()
    client.close()
    client.close()
    with pytest.raises(Unavailable, match="closed"):
        client.stats()


# ---- get stream reassembly ----------------------------------------------------------------


def _chunks(index: int, header: bytes, data: bytes, step: int) -> list[pb.GetResponse]:
    return [
        pb.GetResponse(
            chunk=pb.PageChunk(
                index=index,
                header=header if off == 0 else b"",
                offset=off,
                data=data[off : off + step],
            )
        )
        for off in range(0, len(data), step)
    ]


def test_assembler_rejects_out_of_order_and_incomplete_pages() -> None:
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    into = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    asm = GetAssembler(SCOPE, keys, into, verify=True)
    good = _chunks(0, pages[0].header.encode(), payload(0), 64)
    swapped = _chunks(1, pages[1].header.encode(), payload(1), 64)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    short = _chunks(2, pages[2].header.encode(), payload(2), 64)[:-1]
    for msg in good + swapped + short:
        asm.feed(msg)
    headers = asm.finish()
    assert headers[0] == pages[0].header and headers[1:] == (None, None)
    assert asm.corrupt == 2
    assert bytes(into[0]) == payload(0)


def test_assembler_missing_and_contract_breaks() -> None:
    pages = pages_of(2)
    keys = [p.header.key for p in pages]
    into = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    asm = GetAssembler(SCOPE, keys, into, verify=True)
    asm.feed(pb.GetResponse(missing=0))
    for msg in _chunks(0, pages[0].header.encode(), payload(0), 256):
        asm.feed(msg)  # data after "missing": dropped
    assert asm.finish() == (None, None) and asm.corrupt == 1
    with pytest.raises(StrataError, match="index 2"):
        asm.feed(pb.GetResponse(missing=2))
    with pytest.raises(StrataError, match="empty"):
        asm.feed(pb.GetResponse())


# ---- gevent ---------------------------------------------------------------------------------


def test_store_client_under_gevent(served: Served) -> None:
    """Greenlets share one StoreClient in a monkey-patched process (how locust runs it)."""
    pytest.importorskip("gevent")
    pages = pages_of(3)
    with StoreClient(served.address) as client:
        client.put(SCOPE, pages)
    script = f"""
from gevent import monkey
monkey.patch_all()
import sys
sys.path.insert(0, {str(REPO_ROOT)!r})
from client.transports import gevent_support
gevent_support.init()
gevent_support.init()
assert gevent_support.initialized()
import gevent
from client import KVLayout, Scope, StoreClient
scope = Scope(model_id="tiny", weights_revision="w1", tokenizer_fingerprint="tok1",
              kv_dtype="float16", layout=KVLayout(2, 2, 4, 4))
keys = {[p.header.key for p in pages]!r}
client = StoreClient({served.address!r}, timeout_s=20)
def work(i):
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    got = client.get(scope, keys, into, tokens=None)
    return client.lookup(scope, keys).hit_count + got.hit_count
jobs = [gevent.spawn(work, i) for i in range(8)]
gevent.joinall(jobs, timeout=30, raise_error=True)
print("results", sorted(job.value for job in jobs))
client.close()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "results [6, 6, 6, 6, 6, 6, 6, 6]" in done.stdout


# ---- the async client -----------------------------------------------------------------------


def test_an_async_start_returns_with_its_call_in_flight() -> None:
    """`Start` sends back the handle of a call now in flight (client/core/steps.py): a pipelined
    put copies one part while the daemon reserves the next only if that Reserve went out."""
    sent: list[str] = []

    class Stub:
        def Reserve(self, request: object, timeout: float, metadata: object) -> object:
            async def call() -> object:
                sent.append("Reserve")  # grpc.aio sends from here, the call's own task
                return pb.ReserveResponse(lease_id=7)

            return call()

    async def scenario() -> None:
        client = AsyncStoreClient("127.0.0.1:1")
        step = Start("Reserve", pb.ReserveRequest(), 5.0)
        handle = await client._take(Stub(), object(), step)  # type: ignore[arg-type]
        assert sent == ["Reserve"]  # before anything else awaits
        assert await client._take(Stub(), object(), Join(handle)) == pb.ReserveResponse(  # type: ignore[arg-type]
            lease_id=7
        )

    asyncio.run(scenario())


def test_async_client_round_trip_and_errors(served: Served) -> None:
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    store = served.store

    async def scenario() -> None:
        async with AsyncStoreClient(served.address) as client:
            with pytest.raises(InvalidArgument):
                await client.get(SCOPE, keys, [bytearray(1)] * 3, tokens=None)
            assert sum(store.calls.values()) == 0
            node = await client.connect()
            assert node.node_id == "canned-1" and client.transport == "grpc"
            put = await client.put(SCOPE, pages[:2])
            assert put.stored == 2
            assert (await client.put(SCOPE, pages)).already_present == 2
            assert (await client.lookup(SCOPE, keys)).hit_count == 3
            into = [bytearray(PAGE_BYTES) for _ in keys]
            store.flip_payload.add(keys[2])
            result = await client.get(SCOPE, keys, into, tokens=None)
            assert result.prefix_hits == 2 and result.headers[2] is None
            assert client.corrupt_pages == 1
            assert bytes(into[1]) == payload(1)
            store.failures["Lookup"].append(Failure(grpc.StatusCode.UNAVAILABLE))
            assert (await client.lookup(SCOPE, keys)).hit_count == 3
            store.failures["Put"].append(
                Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", (("retry-after-ms", "100"),))
            )
            with pytest.raises(CapacityExhausted) as info:
                await client.put(SCOPE, pages)
            assert info.value.retry_after_s == pytest.approx(0.1)
            assert await client.delete(keys=keys) == 3
            assert (await client.stats()).lookups == 7
            store.events = [pb.Event(seq=9, kind=pb.EVENT_KIND_REMOVED, from_tier=pb.TIER_DRAM)]
            events = [e async for e in client.watch(timeout_s=5)]
            assert [(e.seq, e.kind, e.from_tier) for e in events] == [
                (9, EventKind.REMOVED, Tier.DRAM)
            ]
        with pytest.raises(Unavailable, match="closed"):
            await client.stats()

    asyncio.run(scenario())
    assert store.calls["Lookup"] == 3 and store.calls["Put"] == 3
