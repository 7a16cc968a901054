"""The remote data path (streamed Put and Get) of a real Store, registered either way.

`kvstore.service.add_to_server` moves page data as hand-encoded protobuf; the generated
`add_StoreServicer_to_server` uses the generated classes. Both must serve the SDK's client and a
third-party client built from store.proto alike, chunked or not, and refuse a corrupt payload.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import buffers, chain, keys_of, make_scope, tokens_of

from client import Page, PutStatus, StoreClient
from client.contract.errors import Corrupt
from kvstore.config import load_config
from kvstore.service import NodeIdentity, StoreService, add_to_server
from kvstore.store import Store
from kvstore_pb import store_pb2 as pb
from kvstore_pb import store_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

CHUNK = 4096  # a 16 KiB page travels as 4 chunks

Register = Callable[[StoreService, grpc.Server], None]
REGISTRATIONS: dict[str, Register] = {
    "hand-encoded": add_to_server,
    "generated": pb_grpc.add_StoreServicer_to_server,
}


@pytest.fixture(params=list(REGISTRATIONS))
def address(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "dram.capacity_bytes": "32MiB",
            "dram.segment_name": f"strata-test-{uuid.uuid4().hex[:12]}",
            "ssd.enabled": "false",
            "limits.chunk_bytes": str(CHUNK),
        },
    )
    store = Store(config)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    REGISTRATIONS[request.param](StoreService(store, NodeIdentity("t", "another-host", "")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
        store.close()


def test_sdk_client_round_trip(address: str) -> None:
    scope = make_scope()
    pages = chain(scope, 5)
    with StoreClient(address, shared_memory=False) as client:
        assert client.put(scope, pages[:3]).stored == 3
        statuses = client.put(scope, pages).statuses
        assert statuses == (PutStatus.ALREADY_PRESENT,) * 3 + (PutStatus.STORED,) * 2
        into = buffers(scope, 6)
        result = client.get(scope, [*keys_of(pages), bytes(16)], into, tokens=None)
        assert result.hit_count == 5 and result.headers[5] is None
        assert [bytes(b) for b in into[:5]] == [bytes(p.payload) for p in pages]
        assert client.corrupt_pages == 0
        assert client.stats().pages == 5  # the unary methods are registered too


def _third_party_put(
    stub: pb_grpc.StoreStub, scope_bytes: bytes, pages: list[Page], flip: int = -1
) -> pb.PutResponse:
    """A put the way any client generated from store.proto sends it (one chunk per page)."""

    def requests() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(begin=pb.PutBegin(scope=scope_bytes, page_count=len(pages)))
        for i, page in enumerate(pages):
            data = bytearray(page.payload)
            if i == flip:
                data[-1] ^= 1
            yield pb.PutRequest(
                chunk=pb.PageChunk(index=i, header=page.header.encode(), data=bytes(data))
            )

    return stub.Put(requests(), timeout=10)


def test_third_party_client_built_from_the_proto(address: str) -> None:
    scope = make_scope("third-party")
    pages = chain(scope, 3, seed=7)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StoreStub(channel)
        reply = _third_party_put(stub, scope.encode(), pages)
        assert list(reply.statuses) == [pb.PUT_STATUS_STORED] * 3
        request = pb.GetRequest(
            scope_digest=scope.digest, keys=b"".join([*keys_of(pages), bytes(16)])
        )
        got: dict[int, bytearray] = {}
        missing = []
        for msg in stub.Get(request, timeout=10):
            if msg.WhichOneof("part") == "missing":
                missing.append(msg.missing)
                continue
            chunk = msg.chunk
            buf = got.setdefault(chunk.index, bytearray())
            assert chunk.offset == len(buf) and bool(chunk.header) == (chunk.offset == 0)
            buf += chunk.data
        assert missing == [3]
        assert [bytes(got[i]) for i in range(3)] == [bytes(p.payload) for p in pages]
        with pytest.raises(grpc.RpcError) as info:
            _third_party_put(stub, scope.encode(), chain(scope, 2, seed=8), flip=1)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS


def test_sdk_client_reads_what_a_third_party_wrote(address: str) -> None:
    scope = make_scope("mixed")
    pages = chain(scope, 2, seed=9)
    with grpc.insecure_channel(address) as channel:
        _third_party_put(pb_grpc.StoreStub(channel), scope.encode(), pages)
    with StoreClient(address, shared_memory=False) as client:
        into = buffers(scope, 2)
        assert client.get(scope, keys_of(pages), into, tokens=tokens_of(pages)).hit_count == 2
        assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


def test_corrupt_put_from_the_sdk_is_refused(address: str) -> None:
    scope = make_scope("corrupt")
    page = chain(scope, 1, seed=11)[0]
    bad = Page(page.header, bytes([page.payload[0] ^ 1]) + bytes(page.payload[1:]))
    with StoreClient(address, shared_memory=False) as client, pytest.raises(Corrupt):
        client.put(scope, [bad])
