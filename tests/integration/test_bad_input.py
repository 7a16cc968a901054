"""Bad input never hurts the daemon: each case gets its typed error (or a miss), and afterwards the
daemon still serves both paths and every page committed before is there, byte for byte.

Malformed messages are sent with the raw generated stub (the SDK refuses to send most of them).
Lease expiry uses the store's injectable clock (`daemon_factory(clock=True)`), never a sleep.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from conftest import (
    PAGE_BYTES,
    DaemonFactory,
    KiB,
    RunningDaemon,
    assert_intact,
    buffers,
    chain,
    keys_of,
    make_scope,
    read_back,
    singles,
)

from client import (
    CapacityExhausted,
    InvalidArgument,
    KVLayout,
    Page,
    PageHeader,
    PutStatus,
    Scope,
    StoreClient,
    Tier,
    chain_key,
)
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAX_KEYS = 16
LIMITS = {
    "limits.max_keys_per_call": str(MAX_KEYS),
    "limits.chunk_bytes": "64KiB",
    "limits.max_message_bytes": "256KiB",
}
_seeds = itertools.count(1000)


# ---- helpers ------------------------------------------------------------------------------------


@dataclass
class Victim:
    """A daemon holding pages committed before the bad input: a chain in DRAM, pages on SSD."""

    d: RunningDaemon
    scope: Scope
    shm: StoreClient
    rpc: StoreClient
    stub: StoreStub
    committed: list[Page]

    def assert_unharmed(self) -> None:
        """Still serving on both paths; nothing committed earlier is lost or altered."""
        for client in (self.rpc, self.shm):
            assert_intact(client, self.scope, self.committed)
        fresh = singles(self.scope, 2, seed=next(_seeds))
        assert self.shm.put(self.scope, fresh[:1]).stored == 1
        assert self.rpc.put(self.scope, fresh[1:]).stored == 1
        assert_intact(self.shm, self.scope, fresh)
        assert_intact(self.rpc, self.scope, fresh)
        self.committed.extend(fresh)
        assert self.rpc.corrupt_pages == 0 and self.shm.corrupt_pages == 0
        self.d.check()


def start_victim(factory: DaemonFactory, scope: Scope, **kwargs: object) -> Victim:
    d = factory(**kwargs)
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    in_dram, on_ssd = chain(scope, 6, seed=900), singles(scope, 3, seed=901)
    assert shm.put(scope, in_dram).stored == 6
    assert rpc.put(scope, on_ssd, tier=Tier.SSD).stored == 3
    assert [d.tier_of(k) for k in keys_of(on_ssd)] == [(Tier.SSD,)] * 3
    return Victim(d, scope, shm, rpc, d.stub(), in_dram + on_ssd)


@pytest.fixture
def victim(daemon_factory: DaemonFactory, scope: Scope) -> Victim:
    return start_victim(daemon_factory, scope, settings=LIMITS)


def status_of(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError `call` raises (streams are drained, so their errors surface)."""
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if isinstance(result, Iterable) and not isinstance(result, bytes | pb.PutResponse):
            list(result)
    return err.value


def assert_code(call: Callable[[], object], code: grpc.StatusCode, match: str = "") -> None:
    err = status_of(call)
    assert err.code() == code, err.details()
    assert match.lower() in (err.details() or "").lower(), err.details()


def put_stream(
    scope_bytes: bytes, page_count: int, *chunks: pb.PageChunk, tier: int = 0
) -> list[pb.PutRequest]:
    begin = pb.PutRequest(begin=pb.PutBegin(scope=scope_bytes, page_count=page_count, tier=tier))
    return [begin, *(pb.PutRequest(chunk=c) for c in chunks)]


def chunks_of(index: int, page: Page, size: int) -> list[pb.PageChunk]:
    data = bytes(page.payload)
    return [
        pb.PageChunk(
            index=index,
            header=page.header.encode() if off == 0 else b"",
            offset=off,
            data=data[off : off + size],
        )
        for off in range(0, len(data), size)
    ]


def forged(scope: Scope, **changes: object) -> PageHeader:
    """A well-encoded header of a full page of `scope`, with some fields changed."""
    page = singles(scope, 1, seed=next(_seeds))[0]
    return dataclasses.replace(page.header, **changes)


def assert_no_leftovers(v: Victim) -> None:
    """No reservation or lease was left behind by a refused call."""
    stats = v.d.store.stats()
    assert stats.active_leases == 0
    assert not v.d.store._pending and not v.d.store._pending_keys
    v.d.check()


# ---- malformed messages ---------------------------------------------------------------------------


def test_bad_key_length(victim: Victim) -> None:
    v, s = victim, victim.stub
    short_key, digest = b"k" * 15, v.scope.digest
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    assert_code(
        lambda: s.Lookup(pb.LookupRequest(scope_digest=digest, keys=short_key), timeout=10),
        INVALID,
        "multiple of 16",
    )
    assert_code(
        lambda: s.Lookup(pb.LookupRequest(scope_digest=digest[:15], keys=b""), timeout=10),
        INVALID,
        "16 bytes",
    )
    assert_code(
        lambda: s.Get(pb.GetRequest(scope_digest=digest, keys=short_key), timeout=10), INVALID
    )
    assert_code(lambda: s.Get(pb.GetRequest(scope_digest=b"", keys=b"k" * 16), timeout=10), INVALID)
    assert_code(
        lambda: s.Acquire(pb.AcquireRequest(scope_digest=digest, keys=short_key), timeout=10),
        INVALID,
    )
    assert_code(lambda: s.Delete(pb.DeleteRequest(keys=short_key), timeout=10), INVALID)
    assert_code(lambda: s.Delete(pb.DeleteRequest(scope_digest=digest + b"x"), timeout=10), INVALID)
    assert_code(lambda: s.Delete(pb.DeleteRequest(), timeout=10), INVALID)
    assert_code(lambda: s.Watch(pb.WatchRequest(scope_digest=b"xyz"), timeout=10), INVALID)
    # the SDK refuses such keys before any RPC
    with pytest.raises(InvalidArgument):
        v.rpc.lookup(v.scope, [short_key])
    with pytest.raises(InvalidArgument):
        v.shm.get(v.scope, [short_key], buffers(v.scope, 1), tokens=None)
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_truncated_packed_keys(victim: Victim) -> None:
    v, s = victim, victim.stub
    packed = b"".join(keys_of(v.committed[:3]))[:-8]  # 2.5 keys
    digest = v.scope.digest
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    assert_code(
        lambda: s.Lookup(pb.LookupRequest(scope_digest=digest, keys=packed), timeout=10),
        INVALID,
        "multiple of 16",
    )
    assert_code(lambda: s.Get(pb.GetRequest(scope_digest=digest, keys=packed), timeout=10), INVALID)
    assert_code(
        lambda: s.Acquire(pb.AcquireRequest(scope_digest=digest, keys=packed), timeout=10), INVALID
    )
    # a delete whose key list is truncated deletes nothing, not the keys that did parse
    assert_code(lambda: s.Delete(pb.DeleteRequest(keys=packed), timeout=10), INVALID)
    assert v.rpc.lookup(v.scope, keys_of(v.committed[:6])).hit_count == 6
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_garbage_header_bytes(victim: Victim) -> None:
    v, s = victim, victim.stub
    good = singles(v.scope, 1, seed=next(_seeds))[0]
    raw = good.header.encode()
    flipped = bytearray(raw)
    flipped[60] ^= 0xFF  # inside the key: the header checksum no longer matches
    for header in (os.urandom(300), raw[:40], raw[:-1], bytes(flipped), b""):
        assert_code(
            lambda header=header: s.Reserve(
                pb.ReserveRequest(scope=v.scope.encode(), headers=[raw, header]), timeout=10
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "header",
        )
        chunk = pb.PageChunk(index=0, header=header, offset=0, data=bytes(good.payload))
        assert_code(
            lambda chunk=chunk: s.Put(iter(put_stream(v.scope.encode(), 1, chunk)), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    # the good header next to the garbage was not reserved or stored either
    assert v.rpc.lookup(v.scope, [good.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_put_stream_without_put_begin(victim: Victim) -> None:
    v, s = victim, victim.stub
    page = singles(v.scope, 1, seed=next(_seeds))[0]
    chunk = chunks_of(0, page, PAGE_BYTES)[0]
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    assert_code(lambda: s.Put(iter([pb.PutRequest(chunk=chunk)]), timeout=10), INVALID, "PutBegin")
    assert_code(lambda: s.Put(iter([]), timeout=10), INVALID, "PutBegin")
    assert_code(lambda: s.Put(iter([pb.PutRequest()]), timeout=10), INVALID, "PutBegin")
    twice = [*put_stream(v.scope.encode(), 1), pb.PutRequest(begin=pb.PutBegin(scope=b"x"))]
    assert_code(lambda: s.Put(iter(twice), timeout=10), INVALID, "PutBegin")
    # announced 2 pages, sent 1: the page that arrived whole is stored, the call still fails
    assert_code(
        lambda: s.Put(iter(put_stream(v.scope.encode(), 2, chunk)), timeout=10),
        INVALID,
        "announced 2",
    )
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_chunks_out_of_order(victim: Victim) -> None:
    v, s = victim, victim.stub
    a, b = singles(v.scope, 2, seed=next(_seeds))
    ca, cb = chunks_of(0, a, 4 * KiB), chunks_of(1, b, 4 * KiB)
    enc = v.scope.encode()
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    # page 1 before page 0
    page1_first = [pb.PageChunk(index=1, header=c.header, offset=c.offset, data=c.data) for c in ca]
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 2, *page1_first)), timeout=10), INVALID, "out of order"
    )
    # within a page: the third chunk comes before the second
    swapped = [ca[0], ca[2], ca[1], ca[3]]
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 1, *swapped)), timeout=10), INVALID, "does not continue"
    )
    # a chunk repeated
    assert_code(lambda: s.Put(iter(put_stream(enc, 1, ca[0], ca[1], ca[1])), timeout=10), INVALID)
    # the header sent again in the middle of a page
    again = pb.PageChunk(index=0, header=a.header.encode(), offset=4 * KiB, data=ca[1].data)
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 1, ca[0], again)), timeout=10),
        INVALID,
        "header repeated",
    )
    # the first chunk of a page without its header
    headless = pb.PageChunk(index=0, offset=0, data=ca[0].data)
    assert_code(lambda: s.Put(iter(put_stream(enc, 1, headless)), timeout=10), INVALID, "header")
    # page indexes skipping one (0, then 2)
    skip = [pb.PageChunk(index=2, header=c.header, offset=c.offset, data=c.data) for c in cb]
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 2, *ca, *skip)), timeout=10), INVALID, "out of order"
    )
    assert v.rpc.lookup(v.scope, [b.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()
    # in order, the same chunks are fine
    reply = s.Put(iter(put_stream(enc, 2, *ca, *cb)), timeout=10)
    assert list(reply.statuses) == [pb.PUT_STATUS_ALREADY_PRESENT, pb.PUT_STATUS_STORED]
    assert_intact(v.rpc, v.scope, [a, b])


def test_short_payload(victim: Victim) -> None:
    v, s = victim, victim.stub
    a, b = singles(v.scope, 2, seed=next(_seeds))
    ca = chunks_of(0, a, 4 * KiB)
    enc = v.scope.encode()
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    # half a payload, then the stream ends
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 1, *ca[:2])), timeout=10),
        INVALID,
        f"got {8 * KiB} of {PAGE_BYTES}",
    )
    # half a payload, then the next page
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 2, *ca[:2], *chunks_of(1, b, PAGE_BYTES))), timeout=10),
        INVALID,
        f"got {8 * KiB} of {PAGE_BYTES}",
    )
    # more bytes than the header says
    extra = pb.PageChunk(index=0, offset=PAGE_BYTES, data=b"x")
    assert_code(lambda: s.Put(iter(put_stream(enc, 1, *ca, extra)), timeout=10), INVALID)
    # right length, wrong bytes: fails the checksum (DATA_LOSS), counted, not stored
    wrong = pb.PageChunk(index=0, header=a.header.encode(), offset=0, data=os.urandom(PAGE_BYTES))
    assert_code(
        lambda: s.Put(iter(put_stream(enc, 1, wrong)), timeout=10),
        grpc.StatusCode.DATA_LOSS,
        "checksum",
    )
    assert v.rpc.stats().corrupt_dropped == 1
    assert v.rpc.lookup(v.scope, [a.header.key]).hit_count == 0
    assert v.rpc.lookup(v.scope, [b.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_scope_encoding_that_does_not_decode(victim: Victim) -> None:
    v, s = victim, victim.stub
    page = singles(v.scope, 1, seed=next(_seeds))[0]
    enc = v.scope.encode()
    bad_scopes = [b"", b"garbage", enc[:-3], enc + b"\x00", enc.replace(b"STRATA", b"STRATB", 1)]
    for scope_bytes in bad_scopes:
        assert_code(
            lambda sb=scope_bytes: s.Reserve(
                pb.ReserveRequest(scope=sb, headers=[page.header.encode()]), timeout=10
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "scope",
        )
        assert_code(
            lambda sb=scope_bytes: s.Put(
                iter(put_stream(sb, 1, *chunks_of(0, page, PAGE_BYTES))), timeout=10
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "scope",
        )
    assert v.rpc.lookup(v.scope, [page.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_malformed_frames_on_the_same_host_lane(victim: Victim) -> None:
    """The unix-socket lane that carries same-host control calls: garbage there is answered or
    the connection is closed, and nobody else notices."""
    import socket
    import struct

    from client.transports.lane_protocol import METHOD_IDS, REQUEST, RESPONSE, SCHEME

    v = victim
    local = v.d.info.local_address
    assert local.startswith(SCHEME), local
    path = local[len(SCHEME) :]

    def exchange(frame: bytes) -> tuple[int, bytes] | None:
        """Send raw bytes; the (status, body) answered, or None when the daemon hung up."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)  # then the client is gone
            head = b""
            while len(head) < RESPONSE.size:
                part = sock.recv(RESPONSE.size - len(head))
                if not part:
                    return None
                head += part
            length, status, _ = RESPONSE.unpack(head)
            body = b""
            while len(body) < length:
                part = sock.recv(length - len(body))
                assert part, "reply cut short"
                body += part
            return status, body

    def frame(method: int, payload: bytes) -> bytes:
        return REQUEST.pack(len(payload), method, 0, 0) + payload

    INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    answer = exchange(frame(99, b""))
    assert answer is not None and answer[0] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    answer = exchange(frame(METHOD_IDS["Lookup"], b"\xff\xff\xff"))  # not a protobuf message
    assert answer is not None and answer[0] == INVALID
    bad_keys = pb.LookupRequest(scope_digest=v.scope.digest, keys=b"k" * 15).SerializeToString()
    answer = exchange(frame(METHOD_IDS["Lookup"], bad_keys))
    assert answer is not None and answer[0] == INVALID and b"multiple of 16" in answer[1]
    bogus_commit = pb.CommitRequest(lease_id=424242).SerializeToString()
    answer = exchange(frame(METHOD_IDS["Commit"], bogus_commit))
    assert answer is not None and answer[0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    # a frame announcing more than the limit, a truncated frame, a truncated frame header
    assert exchange(struct.pack("<IBBH", 1 << 30, METHOD_IDS["Stats"], 0, 0)) is None
    assert exchange(REQUEST.pack(100, METHOD_IDS["Stats"], 0, 0) + b"xx") is None
    assert exchange(b"\x01\x02") is None
    assert_no_leftovers(v)
    v.assert_unharmed()


# ---- sizes and counts -----------------------------------------------------------------------------


def test_oversize_page(victim: Victim) -> None:
    """A header announcing a payload over limits.max_page_bytes (64 MiB) is refused up front."""
    v, s = victim, victim.stub
    big = make_scope(layout=KVLayout(num_layers=64, num_kv_heads=32, head_dim=256, page_tokens=64))
    assert big.page_payload_bytes > v.d.config.limits.max_page_bytes
    tokens = tuple(range(64))
    header = PageHeader(
        scope_digest=big.digest,
        key=chain_key(big.digest, tokens),
        parent=big.digest,
        tokens=tokens,
        dtype="float16",
        layout=big.layout,
        payload_bytes=big.page_payload_bytes,
        payload_checksum=0,
    )
    assert_code(
        lambda: s.Reserve(
            pb.ReserveRequest(scope=big.encode(), headers=[header.encode()]), timeout=10
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_page_bytes",
    )
    chunk = pb.PageChunk(index=0, header=header.encode(), offset=0, data=b"\x00" * 1024)
    assert_code(
        lambda: s.Put(iter(put_stream(big.encode(), 1, chunk)), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_page_bytes",
    )
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_message_over_max_message_bytes(victim: Victim) -> None:
    """gRPC itself refuses a message over limits.max_message_bytes (256 KiB here)."""
    v, s = victim, victim.stub
    limit = v.d.config.limits.max_message_bytes
    assert limit == 256 * KiB
    page = singles(v.scope, 1, seed=next(_seeds))[0]
    huge = pb.PageChunk(index=0, header=page.header.encode(), offset=0, data=b"\x00" * (limit + 1))
    assert_code(
        lambda: s.Put(iter(put_stream(v.scope.encode(), 1, huge)), timeout=10),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    keys = os.urandom(16) * ((limit // 16) + 1)
    assert_code(
        lambda: s.Lookup(pb.LookupRequest(scope_digest=v.scope.digest, keys=keys), timeout=10),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert v.rpc.lookup(v.scope, [page.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()
    # the SDK keeps its chunks inside the node's limit: a put bigger than one message works
    many = singles(v.scope, 20, seed=next(_seeds))  # 320 KiB in one call
    assert v.rpc.put(v.scope, many).stored == 20
    assert_intact(v.rpc, v.scope, many)


def test_too_many_keys_in_one_call(victim: Victim) -> None:
    v, s = victim, victim.stub
    pages = singles(v.scope, MAX_KEYS + 1, seed=next(_seeds))
    packed = b"".join(keys_of(pages))
    digest, enc = v.scope.digest, v.scope.encode()
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    calls: list[Callable[[], object]] = [
        lambda: s.Lookup(pb.LookupRequest(scope_digest=digest, keys=packed), timeout=10),
        lambda: s.Get(pb.GetRequest(scope_digest=digest, keys=packed), timeout=10),
        lambda: s.Acquire(pb.AcquireRequest(scope_digest=digest, keys=packed), timeout=10),
        lambda: s.Delete(pb.DeleteRequest(keys=packed), timeout=10),
        lambda: s.Reserve(
            pb.ReserveRequest(scope=enc, headers=[p.header.encode() for p in pages]), timeout=10
        ),
        lambda: s.Put(iter(put_stream(enc, MAX_KEYS + 1)), timeout=10),
    ]
    for call in calls:
        assert_code(call, INVALID, f"limit is {MAX_KEYS}")
    assert v.rpc.lookup(v.scope, keys_of(pages[:1])).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()
    # the SDK splits calls by the node's limit, so the same pages go through it
    assert v.shm.node_info().limits.max_keys_per_call == MAX_KEYS
    assert v.shm.put(v.scope, pages).stored == MAX_KEYS + 1
    assert_intact(v.rpc, v.scope, pages)
    assert v.rpc.delete(keys=keys_of(pages)) == MAX_KEYS + 1


# ---- pages that do not match their scope or key ---------------------------------------------------


def test_header_of_another_scope(victim: Victim) -> None:
    v, s = victim, victim.stub
    other = make_scope("another tenant")
    theirs = singles(other, 1, seed=next(_seeds))[0]
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    assert_code(
        lambda: s.Reserve(
            pb.ReserveRequest(scope=v.scope.encode(), headers=[theirs.header.encode()]), timeout=10
        ),
        INVALID,
        "scope digest",
    )
    assert_code(
        lambda: s.Put(
            iter(put_stream(v.scope.encode(), 1, *chunks_of(0, theirs, PAGE_BYTES))), timeout=10
        ),
        INVALID,
        "scope digest",
    )
    # reading our keys under another scope's digest is a miss, never our KV
    ours = v.committed[:6]
    assert read_back(v.rpc, other, ours) == [None] * 6
    assert read_back(v.shm, other, ours) == [None] * 6
    assert v.rpc.lookup(other, keys_of(ours)).hit_count == 0
    assert v.rpc.delete(scope=other) == 0
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_wrong_layout_dtype_or_size(victim: Victim) -> None:
    v, s = victim, victim.stub
    lay = v.scope.layout
    cases = {
        "layout": forged(
            v.scope, layout=KVLayout(lay.num_layers, 1, lay.head_dim * 2, lay.page_tokens)
        ),
        "float16": forged(v.scope, dtype="bfloat16"),
        "payload": forged(v.scope, payload_bytes=PAGE_BYTES // 2),
    }
    page_tokens = lay.page_tokens
    partial_tokens = tuple(range(page_tokens - 1))
    cases["full pages"] = forged(
        v.scope, tokens=partial_tokens, key=chain_key(v.scope.digest, partial_tokens)
    )
    for match, header in cases.items():
        assert_code(
            lambda header=header: s.Reserve(
                pb.ReserveRequest(scope=v.scope.encode(), headers=[header.encode()]), timeout=10
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            match,
        )
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_key_that_is_not_the_chain_key(victim: Victim) -> None:
    v, s = victim, victim.stub
    page = singles(v.scope, 1, seed=next(_seeds))[0]
    # claim to be a page already stored: with its key, but other tokens
    target = v.committed[1]
    lying = dataclasses.replace(page.header, key=target.header.key, parent=target.header.parent)
    random_key = dataclasses.replace(page.header, key=os.urandom(16))
    for header in (lying, random_key):
        assert_code(
            lambda header=header: s.Reserve(
                pb.ReserveRequest(scope=v.scope.encode(), headers=[header.encode()]), timeout=10
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chain_key",
        )
        chunk = pb.PageChunk(index=0, header=header.encode(), offset=0, data=bytes(page.payload))
        assert_code(
            lambda chunk=chunk: s.Put(iter(put_stream(v.scope.encode(), 1, chunk)), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chain_key",
        )
    assert_no_leftovers(v)
    v.assert_unharmed()


# ---- leases -------------------------------------------------------------------------------------


def test_unknown_leases(victim: Victim) -> None:
    v, s = victim, victim.stub
    FAILED = grpc.StatusCode.FAILED_PRECONDITION
    for bogus in (0, 987654321, 2**64 - 1):
        assert_code(lambda b=bogus: s.Commit(pb.CommitRequest(lease_id=b), timeout=10), FAILED)
        assert_code(lambda b=bogus: s.Renew(pb.RenewRequest(lease_id=b), timeout=10), FAILED)
        assert s.Release(pb.ReleaseRequest(lease_id=bogus), timeout=10).released is False
    # a read lease is not a reservation: Commit refuses it and leaves it as it was
    held = s.Acquire(
        pb.AcquireRequest(scope_digest=v.scope.digest, keys=b"".join(keys_of(v.committed[:2]))),
        timeout=10,
    )
    assert held.lease_id
    assert_code(
        lambda: s.Commit(pb.CommitRequest(lease_id=held.lease_id), timeout=10),
        FAILED,
        "not a write reservation",
    )
    assert s.Renew(pb.RenewRequest(lease_id=held.lease_id, lease_ms=5000), timeout=10)
    assert s.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released is True
    assert all(v.d.store.index.get(k).leases == 0 for k in keys_of(v.committed[:2]))  # type: ignore[union-attr]
    # a reservation commits once; then its id is unknown
    page = singles(v.scope, 1, seed=next(_seeds))[0]
    res = s.Reserve(
        pb.ReserveRequest(scope=v.scope.encode(), headers=[page.header.encode()]), timeout=10
    )
    assert s.Release(pb.ReleaseRequest(lease_id=res.lease_id), timeout=10).released is True
    assert_code(lambda: s.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10), FAILED)
    assert v.rpc.lookup(v.scope, [page.header.key]).hit_count == 0
    assert_no_leftovers(v)
    v.assert_unharmed()


def test_reservation_that_expired_before_commit(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    v = start_victim(daemon_factory, scope, clock=True, settings={"limits.lease_ttl_ms": "2000"})
    s, clock = v.stub, v.d.clock
    assert clock is not None
    pages = singles(scope, 2, seed=next(_seeds))
    FAILED = grpc.StatusCode.FAILED_PRECONDITION
    blocks = v.d.store.tiers.dram.allocated_blocks
    # expired, and reaped by the store's own sweep before the Commit arrives
    res = s.Reserve(
        pb.ReserveRequest(scope=scope.encode(), headers=[pages[0].header.encode()]), timeout=10
    )
    assert v.d.store.tiers.dram.allocated_blocks == blocks + 1
    clock.advance(2.5)
    assert v.d.store.reap_leases() == 1
    # its slot stays quarantined (the writer may still be copying into it) until the late call
    assert v.d.store.tiers.dram.allocated_blocks == blocks + 1
    assert_code(lambda: s.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10), FAILED)
    assert v.d.store.tiers.dram.allocated_blocks == blocks  # its slot is free again
    # expired, not yet reaped: the Commit itself finds it expired
    res = s.Reserve(
        pb.ReserveRequest(scope=scope.encode(), headers=[pages[1].header.encode()], lease_ms=100),
        timeout=10,
    )
    clock.advance(0.2)
    assert_code(lambda: s.Renew(pb.RenewRequest(lease_id=res.lease_id), timeout=10), FAILED)
    assert_code(lambda: s.Commit(pb.CommitRequest(lease_id=res.lease_id), timeout=10), FAILED)
    assert s.Release(pb.ReleaseRequest(lease_id=res.lease_id), timeout=10).released is False
    assert v.rpc.lookup(scope, [pages[0].header.key]).hit_count == 0
    assert v.rpc.lookup(scope, [pages[1].header.key]).hit_count == 0
    assert v.rpc.stats().lease_expiries == 2
    # a read lease that runs out unpins its pages
    held = s.Acquire(
        pb.AcquireRequest(scope_digest=scope.digest, keys=b"".join(keys_of(v.committed[:3]))),
        timeout=10,
    )
    clock.advance(2.5)
    assert v.d.store.reap_leases() == 1
    assert all(v.d.store.index.get(k).leases == 0 for k in keys_of(v.committed[:3]))  # type: ignore[union-attr]
    assert s.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released is False
    # the expired reservations' pages can be put for real now
    assert v.shm.put(scope, pages).statuses == (PutStatus.STORED,) * 2
    assert_intact(v.rpc, scope, pages)
    assert_no_leftovers(v)
    v.assert_unharmed()


# ---- a full tier ----------------------------------------------------------------------------------


def test_write_into_a_full_tier_with_nothing_evictable(
    daemon_factory: DaemonFactory, scope: Scope
) -> None:
    """SSD off, DRAM full of leased pages: writes are refused with RESOURCE_EXHAUSTED and a retry
    hint; reads still work; nothing is disturbed; once the leases go, writes go through."""
    d = daemon_factory(
        dram="1MiB",
        ssd=None,
        settings={
            "dram.high_watermark": "1.0",
            "dram.low_watermark": "1.0",
        },
    )
    shm, rpc, s = d.client(shared_memory=True), d.client(shared_memory=False), d.stub()
    resident = singles(scope, 64, seed=next(_seeds))
    for i in range(0, 64, 16):
        assert shm.put(scope, resident[i : i + 16]).stored == 16
    held = s.Acquire(
        pb.AcquireRequest(scope_digest=scope.digest, keys=b"".join(keys_of(resident))), timeout=10
    )
    assert held.lease_id and all(p.present for p in held.pages)
    new = singles(scope, 1, seed=next(_seeds))
    for client in (shm, rpc):
        with pytest.raises(CapacityExhausted) as exc:
            client.put(scope, new)
        assert exc.value.retry_after_s > 0
    err = status_of(
        lambda: s.Reserve(
            pb.ReserveRequest(scope=scope.encode(), headers=[new[0].header.encode()]), timeout=10
        )
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.trailing_metadata() or ())
    assert int(trailing["retry-after-ms"]) > 0
    err = status_of(
        lambda: s.Put(
            iter(put_stream(scope.encode(), 1, *chunks_of(0, new[0], PAGE_BYTES))), timeout=10
        )
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(err.trailing_metadata() or ())["retry-after-ms"]) > 0
    # reads are never blocked by the full tier, and nothing moved or changed
    assert_intact(rpc, scope, resident)
    assert_intact(shm, scope, resident)
    assert [d.tier_of(k) for k in keys_of(resident)] == [(Tier.DRAM,)] * 64
    assert rpc.lookup(scope, keys_of(new)).hit_count == 0
    assert rpc.stats().pages == 64
    assert d.store.counters.refused_full == 4
    d.check()
    # the leases end: the same write now evicts (drops: no SSD) the least recent page
    assert s.Release(pb.ReleaseRequest(lease_id=held.lease_id), timeout=10).released
    assert shm.put(scope, new).stored == 1
    assert_intact(rpc, scope, new)
    assert rpc.stats().pages == 64
    d.check()


# ---- on-disk corruption ---------------------------------------------------------------------------


def flip_in_files(folder: Path, pattern: bytes, delta: int) -> list[str]:
    """Flip the byte `delta` past each occurrence of `pattern` in the tier's payload segment files
    and RocksDB's SST files."""
    hit: list[str] = []
    for path in sorted(folder.rglob("*")):
        if path.suffix not in (".seg", ".sst"):
            continue
        data = path.read_bytes()
        at = data.find(pattern)
        while at >= 0:
            with open(path, "r+b") as fh:
                fh.seek(at + delta)
                fh.write(bytes([data[at + delta] ^ 0x5A]))
            hit.append(path.name)
            at = data.find(pattern, at + 1)
    return hit


def test_flipped_byte_in_an_ssd_page(daemon_factory: DaemonFactory, scope: Scope) -> None:
    d = daemon_factory()
    rpc = d.client(shared_memory=False)
    on_ssd = singles(scope, 4, seed=next(_seeds))
    in_dram = chain(scope, 2, seed=next(_seeds))
    assert rpc.put(scope, on_ssd, tier=Tier.SSD).stored == 4
    assert rpc.put(scope, in_dram).stored == 2
    data_dir = d.data_dir
    d.stop()  # a clean stop flushes the SSD tier to its files
    victim = on_ssd[1]
    hit = flip_in_files(data_dir / "ssd", bytes(victim.payload[:64]), 100)
    assert hit == ["00000001.seg"], hit  # payloads never pass through RocksDB

    d = daemon_factory(data_dir=data_dir)
    assert d.store.rebuilt_pages == 4  # the index is rebuilt from the (intact) headers
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    assert rpc.lookup(scope, [victim.header.key]).tiers == (Tier.SSD,)
    for client in (rpc, shm):
        assert read_back(client, scope, [victim]) == [None]  # a miss, never the bad bytes
        assert rpc.stats().corrupt_dropped == 1  # counted once, then forgotten
        assert rpc.lookup(scope, [victim.header.key]).hit_count == 0
    good = [p for p in on_ssd if p is not victim]
    assert_intact(shm, scope, good)
    assert_intact(rpc, scope, good)
    assert read_back(rpc, scope, in_dram) == [None, None]  # DRAM-only pages do not survive
    assert rpc.stats().corrupt_dropped == 1
    assert rpc.corrupt_pages == 0  # the daemon caught it; the client never saw the bad bytes
    # the dropped page can be published again, and then it is served
    assert shm.put(scope, [victim]).stored == 1
    assert_intact(rpc, scope, [victim])
    d.check()


# ---- a client that dies holding leases ------------------------------------------------------------

_DYING_CLIENT = """
import mmap, os, sys
import grpc
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

address, segment, digest, keys, scope, header = sys.argv[1:7]
stub = StoreStub(grpc.insecure_channel(address))
# a same-host writer maps the segment first, as the SDK does: the daemon believes the pid a
# gRPC client claims only of a process that maps it
fd = os.open("/dev/shm/" + segment, os.O_RDWR)
m = mmap.mmap(fd, 0)
held = stub.Acquire(pb.AcquireRequest(scope_digest=bytes.fromhex(digest),
                                      keys=bytes.fromhex(keys)), timeout=10)
res = stub.Reserve(pb.ReserveRequest(scope=bytes.fromhex(scope), headers=[bytes.fromhex(header)],
                                     client_pid=os.getpid()), timeout=10)
slot = res.slots[0]
m[slot.offset : slot.offset + 100] = b"half-written page " * 5 + b"xxxxxxxxxx"  # then it dies
print(held.lease_id, res.lease_id, sum(p.present for p in held.pages), slot.reserved, flush=True)
os._exit(0)
"""


def test_client_that_dies_holding_leases(daemon_factory: DaemonFactory, scope: Scope) -> None:
    d = daemon_factory(
        dram="1MiB",
        ssd=None,
        clock=True,
        settings={
            "dram.high_watermark": "1.0",
            "dram.low_watermark": "1.0",
            "limits.lease_ttl_ms": "5000",
        },
    )
    shm, rpc = d.client(shared_memory=True), d.client(shared_memory=False)
    resident = singles(scope, 63, seed=next(_seeds))
    for i in range(0, 63, 21):
        shm.put(scope, resident[i : i + 21])
    late = singles(scope, 1, seed=next(_seeds))[0]
    args = [
        d.address,
        d.info.segment_name,
        scope.digest.hex(),
        b"".join(keys_of(resident)).hex(),
        scope.encode().hex(),
        late.header.encode().hex(),
    ]
    done = subprocess.run(
        [sys.executable, "-c", _DYING_CLIENT, *args],
        cwd=REPO,
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read_lease, write_lease, present, reserved = done.stdout.split()
    assert int(read_lease) > 0 and int(write_lease) > 0
    assert (present, reserved) == ("63", "True")
    # the dead client's leases still hold: every slot is leased or reserved
    assert rpc.stats().active_leases == 2
    with pytest.raises(CapacityExhausted):
        shm.put(scope, singles(scope, 1, seed=next(_seeds)))
    assert rpc.lookup(scope, [late.header.key]).hit_count == 0  # never committed: invisible
    # they run out (the store's clock moves past their expiry; no waiting)
    assert d.clock is not None
    d.clock.advance(6)
    assert d.store.reap_leases() == 2
    stats = rpc.stats()
    assert (stats.active_leases, stats.lease_expiries) == (0, 2)
    d.check()
    # eviction proceeds: a full DRAM's worth of new pages goes in
    fresh = singles(scope, 64, seed=next(_seeds))
    for i in range(0, 64, 16):
        assert shm.put(scope, fresh[i : i + 16]).stored == 16
    assert_intact(rpc, scope, fresh)
    # the half-written reservation never became a page; its key can be published properly
    assert rpc.put(scope, [late]).statuses == (PutStatus.STORED,)
    assert_intact(shm, scope, [late])
    assert d.tier_of(resident[0].header.key) == ()  # the old pages made room
    d.check()
