"""Bad input on the TCP data path before a connection has a principal: what an unauthenticated
peer may make the daemon hold is bounded by the frame it is allowed to send (kvstore/tcp_server.py).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import DaemonFactory, RunningDaemon, chain, make_scope

from client import StoreClient
from client.contract.errors import Unauthenticated
from client.transports.ucx_protocol import (
    KIND_ERROR,
    KIND_HELLO,
    PREAMBLE,
    decode_error,
    parse_address,
    parse_preamble,
    preamble,
)
from kvstore.auth import hash_token

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
