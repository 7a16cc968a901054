"""TLS on the store's network paths (config `[tls]`, kvstore/tls.py, client/transports/tls.py): gRPC and the
TCP data path encrypted, client certificates when the daemon asks for them, plaintext refused
when TLS is required (no plaintext gRPC port, a plaintext TCP data-path connection closed at
once, no UCX listener), and a TLS client that never falls back to plaintext.

A throwaway CA, server and client certificates are made with the `openssl` command, for
127.0.0.1 only; every connection is on loopback.
"""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    DaemonFactory,
    RunningDaemon,
    assert_intact,
    buffers,
    chain,
    keys_of,
    make_scope,
    tokens_of,
)

from client import ClusterClient, StoreClient
from client.contract.errors import InvalidArgument, Unavailable
from client.transports.tls import ENV_CA, TlsOptions
from client.transports.ucx_protocol import (
    KIND_GET,
    KIND_MANIFEST,
    PREAMBLE,
    parse_address,
    parse_preamble,
    preamble,
)
from kvstore.config import load_config
from kvstore.server import Daemon
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import wait_for

pytestmark = pytest.mark.integration

_SUBJECT_CA = "/CN=strata-test-ca"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _issue(folder: Path, name: str, ca: Path, ca_key: Path, san: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (folder / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", f"/CN={name}")  # fmt: skip
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "2", "-out", str(cert), "-extfile", str(ext))  # fmt: skip
    return cert, key


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
             str(cert), "-days", "2", "-subj", f"{_SUBJECT_CA}-{name}")  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_key = _ca(folder, "ca")
    rogue_ca, rogue_ca_key = _ca(folder, "rogue-ca")
    server_cert, server_key = _issue(folder, "server", ca, ca_key, "IP:127.0.0.1,DNS:localhost")
    client_cert, client_key = _issue(folder, "engine", ca, ca_key, "DNS:engine")
    rogue_cert, rogue_key = _issue(folder, "rogue", rogue_ca, rogue_ca_key, "DNS:rogue")
    return Pki(ca, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)


def _tls_settings(pki: Pki, *, require: bool = False, client_ca: bool = False) -> dict[str, str]:
    settings = {
        "tls.cert": str(pki.server_cert),
        "tls.key": str(pki.server_key),
        "tls.require": "true" if require else "false",
        "server.tcp": "true",
    }
    if client_ca:
        settings["tls.client_ca"] = str(pki.ca)
    return settings


def _client(daemon: RunningDaemon, tls: TlsOptions | bool, **kwargs: object) -> StoreClient:
    client = StoreClient(daemon.address, shared_memory=False, tls=tls, **kwargs)  # type: ignore[arg-type]
    daemon.clients.append(client)
    return client


def _round_trip(client: StoreClient, name: str) -> None:
    scope = make_scope(name)
    pages = chain(scope, 3, seed=5)
    assert client.put(scope, pages).stored == 3
    into = buffers(scope, 3)
    result = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    assert result.hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]


def _tcp_bytes(daemon: RunningDaemon) -> int:
    moved = daemon.store.counters.bytes_moved
    return sum(v for (path, _, _), v in moved.items() if path == "tcp")


def _raw_get_frame() -> bytes:
    request = pb.GetRequest(scope_digest=make_scope("raw").digest, keys=b"").SerializeToString()
    return preamble(KIND_GET, 0, len(request)) + request


def _plaintext_answer(tcp_address: str) -> bytes:
    """What a plaintext data-path GET gets back: b"" when the daemon closes the connection."""
    host, port = parse_address(tcp_address)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(_raw_get_frame())
        got = b""
        try:
            while len(got) < PREAMBLE.size:
                part = sock.recv(PREAMBLE.size - len(got))
                if not part:
                    break
                got += part
        except ConnectionResetError:
            return b""
        return got


def test_grpc_and_tcp_data_path_over_tls(daemon_factory: DaemonFactory, pki: Pki) -> None:
    daemon = daemon_factory(ssd=None, settings=_tls_settings(pki))
    client = _client(daemon, TlsOptions(ca_file=str(pki.ca)))
    client.connect()
    assert client.transport == "tcp"
    _round_trip(client, "tls")
    # the daemon counts a get's bytes once its send has returned: the client may have the whole
    # reply (and be here) a moment before that
    want = 2 * 3 * len(chain(make_scope("tls"), 1)[0].payload)
    assert wait_for(lambda: _tcp_bytes(daemon) == want, 5.0), (_tcp_bytes(daemon), want)
    # the same daemon, without TLS on the client: the gRPC port speaks TLS only
    plain = _client(daemon, False, timeout_s=2.0, retries=0)
    with pytest.raises(Unavailable):
        plain.connect()
    daemon.check()


def test_tls_required_refuses_plaintext_everywhere(
    daemon_factory: DaemonFactory, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstore.server")
    settings = {**_tls_settings(pki, require=True), "server.ucx": "true"}
    daemon = daemon_factory(ssd=None, settings=settings)
    assert daemon.info.ucx_address == ""  # UCX cannot be encrypted: not started
    assert "cannot be encrypted" in caplog.text
    assert daemon.info.tcp_address
    assert _plaintext_answer(daemon.info.tcp_address) == b""  # closed at once, no answer
    plain = _client(daemon, False, timeout_s=2.0, retries=0)
    with pytest.raises(Unavailable):
        plain.connect()
    # an encrypted client is served on both paths all the while
    client = _client(daemon, TlsOptions(ca_file=str(pki.ca)))
    client.connect()
    assert client.transport == "tcp"
    _round_trip(client, "required")
    daemon.check()


def test_tls_not_required_still_serves_a_plaintext_data_path(
    daemon_factory: DaemonFactory, pki: Pki
) -> None:
    daemon = daemon_factory(ssd=None, settings=_tls_settings(pki))
    head = _plaintext_answer(daemon.info.tcp_address)
    assert parse_preamble(head, 1 << 20).kind == KIND_MANIFEST


def test_client_certificates_required(daemon_factory: DaemonFactory, pki: Pki) -> None:
    daemon = daemon_factory(ssd=None, settings=_tls_settings(pki, require=True, client_ca=True))
    anonymous = _client(daemon, TlsOptions(ca_file=str(pki.ca)), timeout_s=2.0, retries=0)
    with pytest.raises(Unavailable):
        anonymous.connect()
    rogue = TlsOptions(
        ca_file=str(pki.ca), cert_file=str(pki.rogue_cert), key_file=str(pki.rogue_key)
    )
    with pytest.raises(Unavailable):
        _client(daemon, rogue, timeout_s=2.0, retries=0).connect()
    # the TCP data path asks for the certificate too: a TLS handshake without one gets nothing
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    host, port = parse_address(daemon.info.tcp_address)
    with socket.create_connection((host, port), timeout=5) as raw:
        answer = b""
        with (
            pytest.raises((ssl.SSLError, ConnectionError)),
            ctx.wrap_socket(raw, server_hostname=host) as tls_sock,
        ):
            tls_sock.sendall(_raw_get_frame())
            answer = tls_sock.recv(PREAMBLE.size)
            if not answer:
                raise ConnectionError("closed")
        assert answer == b""
    engine = TlsOptions(
        ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)
    )
    client = _client(daemon, engine)
    client.connect()
    assert client.transport == "tcp"
    _round_trip(client, "mutual")
    daemon.check()


def test_a_tls_client_never_uses_unencrypted_paths(
    daemon_factory: DaemonFactory, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = daemon_factory(ssd=None, settings=_tls_settings(pki))
    # UCX required by a TLS client: refused, not served in the clear
    ucx = _client(daemon, TlsOptions(ca_file=str(pki.ca)), ucx=True)
    ucx.connect()
    with pytest.raises(Unavailable, match="cannot be encrypted"):
        _ = ucx.transport
    # a certificate from an unknown CA is refused: no fall back to plaintext or to no check
    system_cas = _client(daemon, True, timeout_s=2.0, retries=0)
    with pytest.raises(Unavailable):
        system_cas.connect()
    # the environment's default: STRATA_STORE_TLS_CA alone turns TLS on
    monkeypatch.setenv(ENV_CA, str(pki.ca))
    from_env = StoreClient(daemon.address, shared_memory=False)
    daemon.clients.append(from_env)
    from_env.connect()
    assert from_env.transport == "tcp"
    _round_trip(from_env, "env")


def test_a_cluster_client_speaks_tls_to_every_node(daemon_factory: DaemonFactory, pki: Pki) -> None:
    nodes = [daemon_factory(ssd=None, settings=_tls_settings(pki)) for _ in range(2)]
    tls = TlsOptions(ca_file=str(pki.ca))
    scope = make_scope("cluster")
    pages = chain(scope, 4, seed=8)
    addresses = [n.address for n in nodes]
    with ClusterClient(addresses=addresses, replicas=2, shared_memory=False, tls=tls) as cluster:
        assert cluster.put(scope, pages).stored == 4
        assert cluster.lookup(scope, keys_of(pages)).hit_count == 4
    for node in nodes:  # both replicas hold every page, written over TLS TCP
        assert _tcp_bytes(node) == 4 * len(pages[0].payload)
        assert_intact(_client(node, tls), scope, pages)
    with (
        ClusterClient(addresses=addresses, tls=False, timeout_s=2.0) as plain,
        pytest.raises(Unavailable),
    ):
        plain.put(scope, pages)


def test_tls_config_is_checked(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(InvalidArgument, match=r"tls\.require"):
        load_config(env={}, overrides={"tls.require": "true"})
    with pytest.raises(InvalidArgument, match=r"tls\.cert and tls\.key"):
        load_config(env={}, overrides={"tls.cert": str(pki.server_cert)})
    with pytest.raises(InvalidArgument, match="cert_file and key_file"):
        TlsOptions(cert_file=str(pki.client_cert))
    missing = load_config(
        env={},
        overrides={
            "tls.cert": str(tmp_path / "nope.pem"),
            "tls.key": str(pki.server_key),
            "data_dir": str(tmp_path / "data"),
            "server.port": "0",
            "server.metrics_port": "-1",
            "ssd.enabled": "false",
            "dram.capacity_bytes": "4MiB",
        },
    )
    with pytest.raises(InvalidArgument, match="cannot read"):
        Daemon(missing).start()
