"""Bad input on the TCP data path before a connection has a principal: what an unauthenticated
peer may make the daemon hold is bounded by the frame it is allowed to send (kvstore/tcp_server.py).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import xxhash
from conftest import DaemonFactory, RunningDaemon, chain, make_scope

from client import StoreClient
from client.contract.errors import InvalidArgument, Unauthenticated
from client.contract.page import checksum_deferred
from client.transports.tcp_protocol import KIND_PUT_PAGES, encode_put_pages
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_HELLO,
    PREAMBLE,
    decode_error,
    parse_address,
    parse_preamble,
    preamble,
)
from kvstore.auth import hash_token
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

TOKEN = "review-token-0123456789abcdef"
A = make_scope("tenant-a")


def _daemon(factory: DaemonFactory, tmp_path: Path) -> RunningDaemon:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[principal]]\nname = "engine-a"\ntoken_sha256 = "{hash_token(TOKEN)}"\n'
        'read = ["tenant-a"]\nwrite = ["tenant-a"]\n'
    )
    tokens.chmod(0o600)
    return factory(ssd=None, settings={"auth.tokens_file": str(tokens), "server.tcp": "true"})


def _answer(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """The daemon's next frame, or None when it closed the connection."""
    head = b""
    while len(head) < PREAMBLE.size:
        part = sock.recv(PREAMBLE.size - len(head))
        if not part:
            return None
        head += part
    frame = parse_preamble(head, 1 << 20)
    meta = b""
    while len(meta) < frame.meta_bytes:
        part = sock.recv(frame.meta_bytes - len(meta))
        if not part:
            return None
        meta += part
    return frame.kind, frame.aux, meta


def test_a_hello_that_announces_more_than_a_token_is_refused_at_once(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A HELLO carries a token: one that announces 64 MiB of it is refused on its preamble,
    before the daemon waits for (or allocates) any of it, so no unauthenticated connection can
    make the daemon hold megabytes, or hold its slot for a step's timeout per megabyte."""
    daemon = _daemon(daemon_factory, tmp_path)
    host, port = parse_address(daemon.info.tcp_address)
    with socket.create_connection((host, port), timeout=3.0) as sock:
        sock.sendall(preamble(KIND_HELLO, 0, 64 << 20))
        try:
            answer = _answer(sock)  # the socket's 3 s timeout bounds the wait
        except TimeoutError:
            pytest.fail("the daemon waited for 64 MiB of a HELLO from an unauthenticated peer")
        if answer is not None:
            kind, code, meta = answer
            assert kind == KIND_ERROR
            assert isinstance(decode_error(code, meta), Unauthenticated)
            assert sock.recv(1) == b""  # and closed
    # the daemon serves on
    client = StoreClient(daemon.address, shared_memory=False, token=TOKEN, timeout_s=5.0)
    daemon.clients.append(client)
    assert client.put(A, chain(A, 1, seed=71)).stored == 1


def test_a_tcp_put_may_not_leave_its_checksum_to_the_daemon_nor_set_unknown_flags(
    daemon_factory: DaemonFactory,
) -> None:
    """Over the network a page comes with its checksum: a PUT_PAGES whose header carries the
    deferred-checksum flag (FLAG_CHECKSUM_DEFERRED, the same-host form) or a flag bit nobody
    knows is refused whole, its payloads read so the connection stays in step, nothing stored."""
    daemon = daemon_factory(ssd=None, settings={"server.tcp": "true"})
    pages = chain(A, 2, seed=72)
    good = [p.header.encode() for p in pages]
    others = chain(A, 2, seed=73)
    deferred = [p.header.encode_for_same_host() for p in others]
    assert checksum_deferred(deferred[0])
    unknown = bytearray(good[0][:-8])
    unknown[6] = 2  # a flag bit nobody knows, with the header's own checksum made right
    forged = bytes(unknown) + xxhash.xxh3_64_intdigest(bytes(unknown)).to_bytes(8, "little")
    host, port = parse_address(daemon.info.tcp_address)
    with socket.create_connection((host, port), timeout=5.0) as sock:
        cases = ((deferred, others, "same-host"), ([forged, good[1]], pages, "reserved"))
        for headers, sent, why in cases:
            begin = pb.PutBegin(scope=A.encode(), page_count=2).SerializeToString()
            sizes = [A.page_payload_bytes] * 2
            meta = encode_put_pages(begin, headers, sizes)
            payloads = b"".join(bytes(p.payload) for p in sent)
            sock.sendall(preamble(KIND_PUT_PAGES, 2, len(meta)) + meta + payloads)
            answer = _answer(sock)
            assert answer is not None
            kind, code, text = answer
            assert kind == KIND_ERROR
            error = decode_error(code, text)
            assert isinstance(error, InvalidArgument) and why in str(error), error
        # still in step: a good put on the same connection is stored
        begin = pb.PutBegin(scope=A.encode(), page_count=2).SerializeToString()
        meta = encode_put_pages(begin, good, [A.page_payload_bytes] * 2)
        payloads = b"".join(bytes(p.payload) for p in pages)
        sock.sendall(preamble(KIND_PUT_PAGES, 2, len(meta)) + meta + payloads)
        answer = _answer(sock)
        assert answer is not None and answer[0] == KIND_DONE
    assert daemon.store.stats().pages == 2 and daemon.store.stats().active_leases == 0
    daemon.check()
