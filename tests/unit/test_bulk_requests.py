"""What both bulk servers check of a request before the store (kvstore/bulk_requests.py): a
get's scope and keys, a put's PutBegin and its writer, refused with the typed error the
server answers (and, with tokens, counted as the gRPC calls count them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_scope

from client.contract.errors import InvalidArgument, PermissionDenied
from client.transports.ucx_protocol import encode_put
from kvstore.auth import OPEN, Authenticator, Principal
from kvstore.bulk_requests import decode_bulk_get, decode_bulk_put, read_digest
from kvstore.config import load_config
from kvstore.keys import IoClass, Tier
from kvstore.store import Store
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit

SCOPE = make_scope("team")
READER = Principal("reader", read=frozenset({"team"}))
OTHER = Principal("other", read=frozenset({"elsewhere"}), write=frozenset({"elsewhere"}))
WRITER = Principal("writer", write=frozenset({"team"}))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    cfg = load_config(
        None,
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "server.port": "0",  # a segment name of its own
            "dram.capacity_bytes": "4MiB",
            "ssd.enabled": "false",
        },
    )
    s = Store(cfg)
    try:
        yield s
    finally:
        s.close()


def _get(keys: bytes, **fields: object) -> bytes:
    return pb.GetRequest(keys=keys, **fields).SerializeToString()  # type: ignore[arg-type]


def test_a_get_is_checked_as_the_grpc_get_checks_it(store: Store) -> None:
    closed, open_ = Authenticator({}), Authenticator(None)
    scope = SCOPE.encode()
    get = decode_bulk_get(store, closed, READER, _get(bytes(32), scope=scope, io_class=2))
    assert (get.digest, get.keys, get.io) == (SCOPE.digest, [bytes(16)] * 2, IoClass.NORMAL)
    with pytest.raises(PermissionDenied):
        decode_bulk_get(store, closed, OTHER, _get(bytes(16), scope=scope))
    with pytest.raises(InvalidArgument, match="must carry scope"):  # tokens: the scope, always
        decode_bulk_get(store, closed, READER, _get(bytes(16), scope_digest=SCOPE.digest))
    with pytest.raises(InvalidArgument, match="not the digest"):
        decode_bulk_get(store, open_, OPEN, _get(bytes(16), scope=scope, scope_digest=bytes(16)))
    assert read_digest(open_, OPEN, b"", SCOPE.digest) == SCOPE.digest  # open: a bare digest
    with pytest.raises(InvalidArgument, match="16 bytes"):
        read_digest(open_, OPEN, b"", b"short")
    with pytest.raises(InvalidArgument, match="malformed GetRequest"):
        decode_bulk_get(store, open_, OPEN, b"\xff\xff")
    limit = store.config.limits.max_keys_per_call
    with pytest.raises(InvalidArgument, match=f"{limit + 1} keys in one get"):
        decode_bulk_get(store, open_, OPEN, _get(bytes(16 * (limit + 1)), scope=scope))
    assert closed.denied_counts() == {"read": 1}  # counted as the gRPC Get counts it


def _put(page_count: int, announced: int, scope: bytes = b"") -> bytes:
    begin = pb.PutBegin(
        scope=scope or SCOPE.encode(), page_count=announced, io_class=3, tier=pb.TIER_DRAM
    )
    return encode_put(begin.SerializeToString(), [b"h%d" % i for i in range(page_count)])


def test_a_puts_begin_is_decoded_and_its_writer_checked(store: Store) -> None:
    closed = Authenticator({})
    put = decode_bulk_put(store, closed, WRITER, _put(2, 2), 2)
    assert (put.scope, put.headers, put.io, put.tier) == (
        SCOPE,
        (b"h0", b"h1"),
        IoClass.BACKGROUND,
        Tier.DRAM,
    )
    assert closed.namespace_of(SCOPE.digest) == "team"  # remembered for the store's quotas
    with pytest.raises(PermissionDenied):
        decode_bulk_put(store, closed, READER, _put(1, 1), 1)
    with pytest.raises(InvalidArgument, match="announces 3 pages, sent 2"):
        decode_bulk_put(store, closed, WRITER, _put(2, 3), 2)
    with pytest.raises(InvalidArgument, match="malformed PutBegin"):
        decode_bulk_put(store, closed, WRITER, encode_put(b"\xff\xff", []), 0)
    with pytest.raises(InvalidArgument, match="truncated"):
        decode_bulk_put(store, closed, WRITER, _put(1, 2)[:-1], 2)
