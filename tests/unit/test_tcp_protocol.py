"""The TCP data path's operations (client/transports/tcp_protocol.py), sans I/O: each run against
a scripted peer, step by step, with no socket."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Generator
from typing import TypeVar

import pytest
from conftest import make_scope

from client import KVLayout, build_pages
from client.contract.errors import CapacityExhausted, InvalidArgument
from client.contract.types import PutStatus, Tier
from client.transports.tcp_protocol import (
    KIND_LOOKUP,
    KIND_LOOKUP_HITS,
    KIND_PUT_PAGES,
    RECEIVE_GROUP_BYTES,
    Recv,
    RecvMany,
    RemoteError,
    Send,
    Step,
    decode_put_pages,
    encode_put_pages,
    encode_tiers,
    get_op,
    lookup_op,
    put_op,
    split_put_pages,
)
from client.transports.tcp_transport import CLIENT_SPIN_S, SocketReader, recv_some, send_parts
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_MANIFEST,
    PREAMBLE,
    ManifestEntry,
    ProtocolError,
    encode_error,
    encode_manifest,
    parse_preamble,
    preamble,
)

pytestmark = pytest.mark.unit

T = TypeVar("T")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)  # 16 KiB pages


def run(op: Generator[Step, None, T], reply: bytes) -> tuple[T, list[Send]]:
    """Drive `op`: every Send is recorded, every Recv is filled from `reply` in order (all of
    `reply` must be consumed)."""
    sends: list[Send] = []
    pos = 0
    try:
        step = next(op)
        while True:
            if isinstance(step, Send):
                sends.append(step)
            else:
                for view in (step.into,) if isinstance(step, Recv) else step.parts:
                    n = view.nbytes
                    assert pos + n <= len(reply), "the operation reads past the reply"
                    view[:] = reply[pos : pos + n]
                    pos += n
            step = op.send(None)
    except StopIteration as stop:
        assert pos == len(reply), "the operation left part of the reply unread"
        return stop.value, sends


def pages(count: int, seed: int = 1) -> list:  # type: ignore[type-arg]
    scope = make_scope(layout=LAYOUT)
    rng = random.Random(seed)
    tokens = list(range(seed, seed + count * LAYOUT.page_tokens))
    return build_pages(
        scope, tokens, [rng.randbytes(scope.page_payload_bytes) for _ in range(count)]
    )


def test_a_get_is_one_send_then_the_manifest_and_payloads() -> None:
    scope = make_scope(layout=LAYOUT)
    ps = pages(3)
    keys = [p.header.key for p in ps]
    entries = [
        ManifestEntry(ps[0].header.encode(), len(ps[0].payload)),
        ManifestEntry(b"", 0),
        ManifestEntry(ps[2].header.encode(), len(ps[2].payload)),
    ]
    manifest = encode_manifest(entries)
    reply = (
        preamble(KIND_MANIFEST, 3, len(manifest))
        + manifest
        + bytes(ps[0].payload)
        + bytes(ps[2].payload)
    )
    into = [memoryview(bytearray(scope.page_payload_bytes)) for _ in range(3)]
    out, sends = run(
        get_op(b"req", scope.digest, keys, into, verify=True, max_page_bytes=1 << 20), reply
    )
    assert len(sends) == 1  # the request, and nothing after the answer: one round trip
    assert b"".join(bytes(p) for p in sends[0].parts) == preamble(KIND_GET, 0, 3) + b"req"
    assert [h is not None for h in out.headers] == [True, False, True]
    assert out.corrupt == 0
    assert bytes(into[2]) == bytes(ps[2].payload)


def test_a_missing_get_reads_only_the_manifest() -> None:
    scope = make_scope(layout=LAYOUT)
    manifest = encode_manifest([ManifestEntry(b"", 0)])
    into = [memoryview(bytearray(scope.page_payload_bytes))]
    out, _ = run(
        get_op(b"r", scope.digest, [bytes(16)], into, verify=True, max_page_bytes=1 << 20),
        preamble(KIND_MANIFEST, 1, len(manifest)) + manifest,
    )
    assert (out.headers, out.corrupt) == ((None,), 0)


def test_a_page_failing_its_checksum_or_naming_another_key_is_a_counted_miss() -> None:
    scope = make_scope(layout=LAYOUT)
    ps = pages(2)
    flipped = bytearray(ps[0].payload)
    flipped[3] ^= 1
    manifest = encode_manifest([ManifestEntry(p.header.encode(), len(p.payload)) for p in ps])
    reply = preamble(KIND_MANIFEST, 2, len(manifest)) + manifest + bytes(flipped)
    reply += bytes(ps[1].payload)
    into = [memoryview(bytearray(scope.page_payload_bytes)) for _ in range(2)]
    asked = [ps[0].header.key, bytes(16)]  # the second header names a key not asked for
    out, _ = run(
        get_op(b"r", scope.digest, asked, into, verify=True, max_page_bytes=1 << 20), reply
    )
    assert (out.headers, out.corrupt) == ((None, None), 2)


def test_an_error_answer_is_the_typed_error_and_a_broken_manifest_a_protocol_error() -> None:
    scope = make_scope(layout=LAYOUT)
    code, meta = encode_error(CapacityExhausted("full", retry_after_s=0.25))
    into = [memoryview(bytearray(scope.page_payload_bytes))]
    with pytest.raises(RemoteError) as info:
        run(
            get_op(b"r", scope.digest, [bytes(16)], into, verify=False, max_page_bytes=1 << 20),
            preamble(KIND_ERROR, code, len(meta)) + meta,
        )
    assert isinstance(info.value.error, CapacityExhausted)
    assert info.value.error.retry_after_s == 0.25
    with pytest.raises(ProtocolError):
        run(
            get_op(b"r", scope.digest, [bytes(16)], into, verify=False, max_page_bytes=1 << 20),
            preamble(KIND_MANIFEST, 2, 0),
        )


def test_a_put_sends_the_frame_and_every_payload_at_once() -> None:
    ps = pages(3)
    headers = [p.header.encode() for p in ps]
    payloads = [memoryview(bytes(p.payload)) for p in ps]
    statuses = bytes([PutStatus.STORED, PutStatus.ALREADY_PRESENT, PutStatus.PENDING])
    out, sends = run(put_op(b"begin", headers, payloads), preamble(KIND_DONE, 3, 3) + statuses)
    assert out == (PutStatus.STORED, PutStatus.ALREADY_PRESENT, PutStatus.PENDING)
    assert len(sends) == 1
    parts = sends[0].parts
    frame = parse_preamble(bytes(parts[0]), 1 << 20)
    assert (frame.kind, frame.aux) == (KIND_PUT_PAGES, 3)
    assert all(a is b for a, b in zip(parts[2:], payloads, strict=True))  # no copy
    begin, got_headers, sizes = decode_put_pages(bytes(parts[1]), 3, 1 << 20)
    assert (begin, got_headers, sizes) == (b"begin", headers, [len(p.payload) for p in ps])
    with pytest.raises(ProtocolError):  # a DONE for another count
        run(put_op(b"b", headers, payloads), preamble(KIND_DONE, 2, 2) + statuses[:2])


def test_put_meta_refusals() -> None:
    meta = encode_put_pages(b"begin", [b"h1", b"h2"], [10, 20])
    head, sizes = split_put_pages(meta, 2, 1 << 20)
    assert sizes == [10, 20] and bytes(head).startswith(b"\x05\x00\x00\x00begin")
    with pytest.raises(ProtocolError, match="sizes"):
        split_put_pages(b"abc", 2, 1 << 20)
    with pytest.raises(ProtocolError, match="over"):
        split_put_pages(meta, 2, 15)
    with pytest.raises(InvalidArgument):  # the sizes read, the rest garbled: in step
        decode_put_pages(b"\xff" * 5 + meta[-16:], 2, 1 << 20)


def test_a_lookup_is_one_round_trip_with_a_tier_per_hit() -> None:
    tiers = encode_tiers([Tier.DRAM, Tier.SSD])
    out, sends = run(lookup_op(b"q", 5), preamble(KIND_LOOKUP_HITS, 2, 2) + tiers)
    assert (out.hit_count, out.tiers) == (2, (Tier.DRAM, Tier.SSD))
    assert b"".join(bytes(p) for p in sends[0].parts) == preamble(KIND_LOOKUP, 0, 1) + b"q"
    with pytest.raises(ProtocolError, match="hits"):  # more hits than keys asked
        run(lookup_op(b"q", 1), preamble(KIND_LOOKUP_HITS, 2, 2) + tiers)
    with pytest.raises(ProtocolError, match="tier"):
        run(lookup_op(b"q", 5), preamble(KIND_LOOKUP_HITS, 1, 1) + b"\x09")
    assert PREAMBLE.size == 16


def test_payloads_come_in_groups_each_checked_before_the_next_is_received() -> None:
    big = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, page_tokens=32)
    scope = make_scope(layout=big)
    per_group = RECEIVE_GROUP_BYTES // scope.page_payload_bytes
    n = 2 * per_group
    rng = random.Random(3)
    ps = build_pages(
        scope,
        list(range(n * big.page_tokens)),
        [rng.randbytes(scope.page_payload_bytes) for _ in range(n)],
    )
    manifest = encode_manifest([ManifestEntry(p.header.encode(), len(p.payload)) for p in ps])
    payloads = [bytearray(p.payload) for p in ps]
    payloads[5][0] ^= 1  # damaged on the wire
    reply = preamble(KIND_MANIFEST, n, len(manifest)) + manifest + b"".join(payloads)
    into = [memoryview(bytearray(scope.page_payload_bytes)) for _ in range(n)]
    op = get_op(
        b"r", scope.digest, [p.header.key for p in ps], into, verify=True, max_page_bytes=1 << 20
    )
    groups: list[int] = []
    pos = 0
    step = next(op)
    try:
        while True:
            views: tuple[memoryview, ...] = ()
            if isinstance(step, RecvMany):
                groups.append(len(step.parts))
                views = step.parts
            elif isinstance(step, Recv):
                views = (step.into,)
            for view in views:
                view[:] = reply[pos : pos + view.nbytes]
                pos += view.nbytes
            step = op.send(None)
    except StopIteration as stop:
        out = stop.value
    assert groups == [per_group, per_group]
    assert [h is not None for h in out.headers] == [i != 5 for i in range(n)]
    assert out.corrupt == 1


def test_a_manifest_of_absent_pages_only_is_every_key_missed_and_one_present_is_decoded() -> None:
    scope = make_scope(layout=LAYOUT)
    ps = pages(1)
    into = [memoryview(bytearray(scope.page_payload_bytes)) for _ in range(3)]
    absent = encode_manifest([ManifestEntry(b"", 0)] * 3)
    out, _ = run(
        get_op(b"r", scope.digest, [bytes(16)] * 3, into, verify=True, max_page_bytes=1 << 20),
        preamble(KIND_MANIFEST, 3, len(absent)) + absent,
    )
    assert (out.headers, out.corrupt) == ((None, None, None), 0)
    one = encode_manifest(
        [ManifestEntry(b"", 0), ManifestEntry(ps[0].header.encode(), len(ps[0].payload))]
    )
    keys = [bytes(16), ps[0].header.key]
    out, _ = run(
        get_op(b"r", scope.digest, keys, into[:2], verify=True, max_page_bytes=1 << 20),
        preamble(KIND_MANIFEST, 2, len(one)) + one + bytes(ps[0].payload),
    )
    assert [h is not None for h in out.headers] == [False, True]
    truncated = absent[:-1]  # all zero, but not whole entries: still refused
    with pytest.raises(ProtocolError):
        run(
            get_op(b"r", scope.digest, [bytes(16)] * 3, into, verify=True, max_page_bytes=1 << 20),
            preamble(KIND_MANIFEST, 3, len(truncated)) + truncated,
        )


def test_a_lookup_answer_in_one_tier_and_in_several_decodes_page_by_page() -> None:
    same = encode_tiers([Tier.DRAM] * 4)
    out, _ = run(lookup_op(b"q", 4), preamble(KIND_LOOKUP_HITS, 4, 4) + same)
    assert out.tiers == (Tier.DRAM,) * 4
    mixed = encode_tiers([Tier.DRAM, Tier.DRAM, Tier.SSD])
    out, _ = run(lookup_op(b"q", 4), preamble(KIND_LOOKUP_HITS, 3, 3) + mixed)
    assert out.tiers == (Tier.DRAM, Tier.DRAM, Tier.SSD)
    out, _ = run(lookup_op(b"q", 4), preamble(KIND_LOOKUP_HITS, 0, 0))
    assert out.tiers == ()
    with pytest.raises(ProtocolError, match="tier"):  # an unknown tier after known ones
        run(lookup_op(b"q", 4), preamble(KIND_LOOKUP_HITS, 2, 2) + b"\x01\x09")


def test_blocking_sockets_bound_every_wait_by_the_deadline() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    peer, _ = listener.accept()
    try:
        client.settimeout(None)  # as TcpTransport keeps its plain sockets: blocking
        reader = SocketReader(client)
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # the peer never answers
            reader.fill_one(memoryview(bytearray(PREAMBLE.size)), time.monotonic() + 0.2)
        assert 0.15 < time.monotonic() - start < 5
        peer.sendall(b"abcdefgh" * 2)
        head = memoryview(bytearray(4))
        assert reader.fill_one(head, time.monotonic() + 5) == 4  # one receive, read ahead
        assert bytes(head) == b"abcd" and reader.buffered == 12
        rest = memoryview(bytearray(12))
        assert reader.fill_one(rest, time.monotonic() + 5) == 12 and reader.buffered == 0
        assert bytes(rest) == b"efgh" + b"abcdefgh"
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # the peer reads nothing: a large send cannot end
            send_parts(client, [bytes(64 << 20)], time.monotonic() + 0.2)
        assert 0.15 < time.monotonic() - start < 5
        peer.close()  # with bytes it never read: the close resets the connection
        with pytest.raises(ConnectionResetError):
            reader.fill_one(memoryview(bytearray(4)), time.monotonic() + 5)
    finally:
        for sock in (client, peer, listener):
            sock.close()


def test_a_client_receive_polls_briefly_before_it_sleeps_and_keeps_its_deadline() -> None:
    a, b = socket.socketpair()
    try:
        into = memoryview(bytearray(8))
        started = time.perf_counter()
        with pytest.raises(TimeoutError):  # nothing comes: the spin, then poll to the deadline
            recv_some(a, into, time.monotonic() + 0.05, CLIENT_SPIN_S)
        assert 0.04 < time.perf_counter() - started < 2.0
        b.sendall(b"abc")
        assert recv_some(a, into, time.monotonic() + 1.0, CLIENT_SPIN_S) == 3
        assert bytes(into[:3]) == b"abc"
        b.close()
        assert recv_some(a, into, time.monotonic() + 1.0, CLIENT_SPIN_S) == 0  # the peer closed
    finally:
        a.close()
