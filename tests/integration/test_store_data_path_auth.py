"""Tokens on the bulk data paths (TCP, and UCX where ucxx works): the first frame of a connection
is HELLO with the token, the connection is bound to its principal, and each get and put is
checked against that principal's namespaces as the gRPC calls are (a get carries its scope; the
digest sent must be the scope's). Refusals come back as typed errors, are counted, and leave
the connection (or, for a bad HELLO, the daemon) serving.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
from conftest import (
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    chain,
    keys_of,
    make_scope,
    tokens_of,
)

import kvstore.tcp_server
from client import StoreClient
from client.contract.errors import InvalidArgument, PermissionDenied, Unauthenticated
from client.transports.ucx_protocol import (
    KIND_ERROR,
    KIND_GET,
    KIND_HELLO,
    KIND_MANIFEST,
    KIND_WELCOME,
    PREAMBLE,
    decode_error,
    parse_address,
    parse_preamble,
    preamble,
)
from client.transports.ucx_transport import UcxTransport
from kvstore.auth import hash_token
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

TOKENS = {"engine-a": "engine-a-token-0123456789", "engine-b": "engine-b-token-0123456789"}
A = make_scope("tenant-a")
B = make_scope("tenant-b")
HAVE_UCXX = importlib.util.find_spec("ucxx") is not None


def _tokens_file(path: Path) -> Path:
    text = "".join(
        f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(TOKENS[name])}"\n'
        f'read = ["{ns}"]\nwrite = ["{ns}"]\n\n'
        for name, ns in (("engine-a", "tenant-a"), ("engine-b", "tenant-b"))
    )
    path.write_text(text)
    path.chmod(0o600)
    return path


def _daemon(factory: DaemonFactory, tmp_path: Path, **paths: str) -> RunningDaemon:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    return factory(ssd=None, settings={"auth.tokens_file": str(tokens), **paths})


def _client(daemon: RunningDaemon, who: str, **kwargs: object) -> StoreClient:
    c = StoreClient(
        daemon.address,
        shared_memory=False,
        token=TOKENS[who],
        timeout_s=5.0,
        **kwargs,  # type: ignore[arg-type]
    )
    daemon.clients.append(c)
    return c


def _denied(daemon: RunningDaemon) -> dict[str, int]:
    return daemon.daemon._ucx._auth.denied_counts()  # type: ignore[union-attr]


def _frame(sock: socket.socket) -> tuple[int, int, bytes]:
    head = b""
    while len(head) < PREAMBLE.size:
        part = sock.recv(PREAMBLE.size - len(head))
        if not part:
            raise ConnectionError("closed")
        head += part
    frame = parse_preamble(head, 1 << 24)
    meta = b""
    while len(meta) < frame.meta_bytes:
        part = sock.recv(frame.meta_bytes - len(meta))
        if not part:
            raise ConnectionError("closed")
        meta += part
    return frame.kind, frame.aux, meta


def _get_frame(digest: bytes, scope: bytes, keys: bytes = b"") -> bytes:
    request = pb.GetRequest(scope_digest=digest, keys=keys, scope=scope).SerializeToString()
    return preamble(KIND_GET, 0, len(request)) + request


def _hello(token: str) -> bytes:
    raw = token.encode()
    return preamble(KIND_HELLO, 0, len(raw)) + raw


def _paths() -> list[str]:
    return ["tcp", "ucx"] if HAVE_UCXX else ["tcp"]


@pytest.mark.parametrize("path", _paths())
def test_each_request_is_checked_against_the_connections_principal(
    daemon_factory: DaemonFactory, tmp_path: Path, path: str
) -> None:
    daemon = _daemon(daemon_factory, tmp_path, **{f"server.{path}": "true"})
    kwargs = {"ucx": True} if path == "ucx" else {"tcp": True}
    a = _client(daemon, "engine-a", **kwargs)
    b = _client(daemon, "engine-b", **kwargs)
    a.connect()
    b.connect()
    assert (a.transport, b.transport) == (path, path)
    pages_a, pages_b = chain(A, 3, seed=1), chain(B, 2, seed=2)
    assert a.put(A, pages_a).stored == 3
    assert b.put(B, pages_b).stored == 2
    assert_intact(a, A, pages_a)
    with pytest.raises(PermissionDenied):
        b.get(
            A,
            keys_of(pages_a),
            [bytearray(A.page_payload_bytes) for _ in pages_a],
            tokens=tokens_of(pages_a),
        )
    poison = chain(A, 2, seed=9)
    with pytest.raises(PermissionDenied):
        b.put(A, poison)
    assert a.lookup(A, keys_of(poison)).hit_count == 0  # nothing of the refused put stored
    assert (a.transport, b.transport) == (path, path)  # a refusal is not a transport failure
    assert_intact(a, A, pages_a)
    assert_intact(b, B, pages_b)
    denied = _denied(daemon)
    assert denied.get("read", 0) >= 1 and denied.get("write", 0) >= 1
    daemon.check()


def test_the_first_frame_must_be_a_valid_hello(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = _daemon(daemon_factory, tmp_path, **{"server.tcp": "true"})
    host, port = parse_address(daemon.info.tcp_address)
    for first in (_get_frame(A.digest, A.encode()), _hello("not-a-token"), _hello("")):
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(first)
            kind, code, meta = _frame(sock)
            assert kind == KIND_ERROR
            assert isinstance(decode_error(code, meta), Unauthenticated)
            assert sock.recv(1) == b""  # and the connection is closed
    assert _denied(daemon).get("unauthenticated", 0) == 3
    # the SDK's end of it: a transport with a wrong token is refused with the typed error
    bad = UcxTransport(daemon.info.tcp_address, token="not-a-token")
    with pytest.raises(Unauthenticated):
        bad.open(5.0)
    bad.close()


def test_a_get_must_carry_a_scope_that_matches_its_digest(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = _daemon(daemon_factory, tmp_path, **{"server.tcp": "true"})
    a = _client(daemon, "engine-a")
    pages = chain(A, 2, seed=4)
    assert a.put(A, pages).stored == 2
    host, port = parse_address(daemon.info.tcp_address)
    keys = b"".join(keys_of(pages))
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(_hello(TOKENS["engine-b"]))
        assert _frame(sock)[0] == KIND_WELCOME
        # B's scope (which B may read), but A's digest: refused as a forgery
        sock.sendall(_get_frame(A.digest, B.encode(), keys))
        kind, code, meta = _frame(sock)
        assert kind == KIND_ERROR and isinstance(decode_error(code, meta), InvalidArgument)
        sock.sendall(_get_frame(A.digest, b"", keys))  # no scope at all
        kind, code, meta = _frame(sock)
        assert kind == KIND_ERROR and isinstance(decode_error(code, meta), InvalidArgument)
        sock.sendall(_get_frame(B.digest, B.encode(), keys))  # the connection serves on
        kind, count, _ = _frame(sock)
        assert (kind, count) == (KIND_MANIFEST, 2)
    assert _denied(daemon).get("scope_mismatch", 0) == 1
    assert_intact(a, A, pages)


def test_a_connection_that_sends_no_hello_is_closed(
    daemon_factory: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvstore.tcp_server, "HELLO_TIMEOUT_S", 0.3)
    daemon = _daemon(daemon_factory, tmp_path, **{"server.tcp": "true"})
    host, port = parse_address(daemon.info.tcp_address)
    with socket.create_connection((host, port), timeout=10) as silent:
        silent.sendall(preamble(KIND_HELLO, 0, 64))  # announces a token, never sends it
        assert silent.recv(1) == b""  # closed by the daemon, not by this timeout
    a = _client(daemon, "engine-a")  # serving on
    pages = chain(A, 1, seed=30)
    assert a.put(A, pages).stored == 1
