"""Who gets the same-host path, and who can read the daemon's files.

- The lane's HELLO binds a connection to the token's principal; the daemon serves it only to a
  `trusted_local` principal whose process runs as the daemon's user (or one of
  `auth.local_uids`, as SO_PEERCRED reports it). Anyone else is refused with a clear code, the
  SDK falls back to the remote path (said once in the log), and a client that insists on shared
  memory gets Unavailable.
- The data folder and every file in it are private to the daemon's user (0700 folders, 0600
  files: RocksDB's, the SSD segment files, the DRAM segment), including what an earlier run left
  readable; the metrics endpoint can listen apart and carries no secret.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import DaemonFactory, RunningDaemon, assert_intact, chain, make_scope

import client.store_client
import kvstore.lane
from client import AsyncStoreClient, StoreClient
from client.contract.errors import Unavailable
from client.transports.lane import Lane, LaneError, LaneStub
from client.transports.lane_protocol import METHOD_IDS, REQUEST, RESPONSE, STATUS_OK, recv_exact
from kvstore.auth import hash_token
from kvstore.tiers.private import make_private, private_folder, shared_folder
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.integration

TOKENS = {"engine": "engine-token-0123456789", "tool": "tool-token-0123456789"}
A = make_scope("tenant-a")


def _tokens_file(path: Path) -> Path:
    text = "".join(
        f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(TOKENS[name])}"\n'
        f'read = ["tenant-a"]\nwrite = ["tenant-a"]\ntrusted_local = {trusted}\n\n'
        for name, trusted in (("engine", "true"), ("tool", "false"))
    )
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def daemon(daemon_factory: DaemonFactory, tmp_path: Path) -> RunningDaemon:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    return daemon_factory(ssd=None, settings={"auth.tokens_file": str(tokens)})


def _client(daemon: RunningDaemon, who: str, **kwargs: object) -> StoreClient:
    c = StoreClient(daemon.address, token=TOKENS[who], timeout_s=5.0, **kwargs)  # type: ignore[arg-type]
    daemon.clients.append(c)
    return c


def _node_info(lane: Lane) -> pb.NodeInfoResponse:
    body = lane.call(METHOD_IDS["NodeInfo"], b"", 5.0, one_way=False)
    return pb.NodeInfoResponse.FromString(body)


def _denied(daemon: RunningDaemon, reason: str) -> int:
    return daemon.daemon._lane._auth.denied_counts().get(reason, 0)  # type: ignore[union-attr]


def test_a_trusted_principal_of_the_daemons_user_gets_the_lane(daemon: RunningDaemon) -> None:
    engine = _client(daemon, "engine")
    engine.connect()
    assert engine.transport == "shm"
    assert isinstance(engine._conn.stub, LaneStub)  # type: ignore[union-attr]
    pages = chain(A, 3)
    assert engine.put(A, pages).stored == 3
    assert_intact(engine, A, pages)
    assert _denied(daemon, "local_untrusted") == 0


def test_an_untrusted_principal_falls_back_to_the_remote_path(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="client.transports.shm")
    tool = _client(daemon, "tool")
    tool.connect()
    assert tool.transport == "grpc"  # no segment mapped, no lane
    assert tool._conn.maps == ()  # type: ignore[union-attr]
    assert "offers this client no shared-memory segment" in caplog.text
    pages = chain(A, 2, seed=3)
    assert tool.put(A, pages).stored == 2  # its namespace rights hold on the remote path
    assert_intact(tool, A, pages)
    insist = _client(daemon, "tool", shared_memory=True)
    with pytest.raises(Unavailable, match="no shared-memory segment"):
        insist.connect()
    # what the daemon shows and serves it: no segment, no lane, no slots
    stub = daemon.stub()
    bearer = (("authorization", f"Bearer {TOKENS['tool']}"),)
    info = stub.NodeInfo(pb.NodeInfoRequest(), metadata=bearer, timeout=5)
    assert (list(info.segments), info.local_address) == ([], "")
    engine_info = stub.NodeInfo(
        pb.NodeInfoRequest(), metadata=(("authorization", f"Bearer {TOKENS['engine']}"),), timeout=5
    )
    assert len(engine_info.segments) == 1 and engine_info.local_address
    reserve = pb.ReserveRequest(scope=A.encode(), headers=[p.header.encode() for p in chain(A, 1)])
    acquire = pb.AcquireRequest(scope=A.encode(), keys=pages[0].header.key)
    for call, request in ((stub.Reserve, reserve), (stub.Acquire, acquire)):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, metadata=bearer, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "trusted_local" in refused.value.details()
    lane = Lane(engine_info.local_address, TOKENS["tool"])  # its token on the lane: refused
    with pytest.raises(LaneError, match="trusted_local"):
        _node_info(lane)
    lane.close()
    assert _denied(daemon, "local_untrusted") == 3
    assert_intact(tool, A, pages)


async def _async_transport(address: str, token: str) -> str:
    client = AsyncStoreClient(address, token=token, timeout_s=5.0)
    try:
        await client.connect()
        return client.transport
    finally:
        await client.close()


def test_the_async_client_gets_the_same_host_path_only_when_trusted(daemon: RunningDaemon) -> None:
    assert asyncio.run(_async_transport(daemon.address, TOKENS["engine"])) == "shm"
    assert asyncio.run(_async_transport(daemon.address, TOKENS["tool"])) == "grpc"


def test_the_lane_refuses_a_bad_token_and_a_missing_hello(daemon: RunningDaemon) -> None:
    address = daemon.info.local_address
    wrong = Lane(address, "not-a-token")
    with pytest.raises(LaneError) as refused:
        _node_info(wrong)
    assert refused.value.refused and "UNAUTHENTICATED" in str(refused.value.code())
    wrong.close()
    # a raw connection that skips HELLO: refused and closed, the call never served
    path = address.removeprefix("lane:")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        body = pb.StatsRequest().SerializeToString()
        sock.sendall(REQUEST.pack(len(body), 9, 0, 0) + body)
        length, status, _ = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        assert status != STATUS_OK
        assert b"HELLO" in bytes(recv_exact(sock, length))
        assert sock.recv(1) == b""  # closed
    engine = _client(daemon, "engine")  # the daemon serves on
    engine.connect()
    assert engine.transport == "shm"


def test_a_lane_connection_that_sends_no_hello_is_closed(
    daemon_factory: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvstore.lane, "HELLO_TIMEOUT_S", 0.3)
    tokens = _tokens_file(tmp_path / "tokens.toml")
    daemon = daemon_factory(ssd=None, settings={"auth.tokens_file": str(tokens)})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(10)
        silent.connect(daemon.info.local_address.removeprefix("lane:"))
        silent.sendall(REQUEST.pack(64, 0, 0, 0))  # HELLO announcing a token it never sends
        assert silent.recv(1) == b""  # closed by the daemon, not by this timeout
    engine = _client(daemon, "engine")  # and a client that says HELLO is served
    engine.connect()
    assert engine.transport == "shm"


def test_another_user_is_refused_unless_listed(
    daemon_factory: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernel's answer to SO_PEERCRED, as if the client ran as another user
    other = os.getuid() + 4242
    monkeypatch.setattr(kvstore.lane, "_peer_cred", lambda conn: (os.getpid(), other))
    tokens = _tokens_file(tmp_path / "tokens.toml")
    closed = daemon_factory(ssd=None, settings={"auth.tokens_file": str(tokens)})
    lane = Lane(closed.info.local_address, TOKENS["engine"])
    with pytest.raises(LaneError, match=f"uid {other} may not use the same-host path"):
        _node_info(lane)
    lane.close()
    assert stat.S_IMODE(os.stat(closed.info.local_address.removeprefix("lane:")).st_mode) == 0o600
    listed = daemon_factory(
        ssd=None,
        settings={"auth.tokens_file": str(tokens), "auth.local_uids": str(other)},
    )
    sock = listed.info.local_address.removeprefix("lane:")
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o666  # HELLO decides who may use it
    lane = Lane(listed.info.local_address, TOKENS["engine"])
    reply = _node_info(lane)
    assert reply.node_id == listed.address
    lane.close()
    untrusted = Lane(listed.info.local_address, TOKENS["tool"])  # listed user, untrusted principal
    with pytest.raises(LaneError, match="trusted_local"):
        _node_info(untrusted)
    untrusted.close()


def test_a_listed_user_gets_the_segment_by_descriptor(
    daemon_factory: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    other = os.getuid() + 4242
    daemon = daemon_factory(
        ssd=None, settings={"auth.tokens_file": str(tokens), "auth.local_uids": str(other)}
    )
    # the daemon's own user: opens the segment by name, gets no descriptor
    own = Lane(daemon.info.local_address, TOKENS["engine"])
    _node_info(own)
    assert own.take_segment_fds() == []
    own.close()
    # a client of the listed user: the kernel says `other`, and the segment file (0600) does
    # not open for it
    monkeypatch.setattr(kvstore.lane, "_peer_cred", lambda conn: (os.getpid(), other))

    def cannot_open(node: object, wanted: bool | None) -> tuple[()]:
        if wanted:
            raise Unavailable("cannot open /dev/shm/...: Permission denied")
        return ()

    monkeypatch.setattr(client.store_client, "map_node_segments", cannot_open)
    for wanted in (None, True):
        engine = _client(daemon, "engine", shared_memory=wanted)
        engine.connect()
        assert engine.transport == "shm"
        scope = make_scope("tenant-a")
        pages = chain(scope, 3, seed=20 + int(bool(wanted)))
        assert engine.put(scope, pages).stored == 3  # copied through the handed-over map
        assert_intact(engine, scope, pages)
        assert_intact(daemon.client(shared_memory=False, token=TOKENS["engine"]), scope, pages)
    tool = _client(daemon, "tool")  # the listed user with an untrusted token: remote path
    tool.connect()
    assert tool.transport == "grpc"


def test_an_open_daemon_checks_the_user_too(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvstore.lane, "_peer_cred", lambda conn: (os.getpid(), os.getuid() + 7))
    daemon = daemon_factory(ssd=None)
    client = daemon.client(shared_memory=None)
    assert client.transport == "grpc"
    with pytest.raises(Unavailable):
        daemon.client(shared_memory=True)


# ---- private files -------------------------------------------------------------------------


def _modes(folder: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(folder.stat().st_mode)}
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            path = Path(root) / name
            out[str(path.relative_to(folder))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def test_the_data_folder_is_private_to_the_daemons_user(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    (data / "ssd" / "segments").mkdir(parents=True, mode=0o755)
    for folder in (data, data / "ssd", data / "ssd" / "segments"):
        folder.chmod(0o755)
    left = data / "ssd" / "LOG.old.from-an-older-run"
    left.write_text("readable by all")
    left.chmod(0o644)
    other = data / "notes.txt"  # not the daemon's: left alone (unreachable in a 0700 folder)
    other.write_text("mine")
    other.chmod(0o644)
    old_umask = os.umask(0o022)
    try:
        daemon = daemon_factory(
            dram="4MiB",
            ssd="64MiB",
            data_dir=data,
            settings={"ssd.write_mode": "write-through", "ssd.sync_writes": "true"},
        )
        segment = Path("/dev/shm") / daemon.info.segment_name
        assert stat.S_IMODE(segment.stat().st_mode) == 0o600
        client = daemon.client(shared_memory=False)
        scope = make_scope("private")
        pages = chain(scope, 8, seed=11)
        assert client.put(scope, pages).stored == 8
        daemon.store.drain()  # written through to the SSD tier: RocksDB records, segment files
        modes = _modes(data)
        files = [name for name in modes if (data / name).is_file()]
        assert any(name.startswith("ssd/segments/") for name in files), modes
        assert any(name.startswith("ssd/") and name.endswith(".log") for name in files), modes
        daemon.stop()
        modes = _modes(data)  # RocksDB writes more files as it closes
    finally:
        os.umask(old_umask)
    assert os.umask(0o022) == 0o022  # stop() gave the process its umask back
    os.umask(old_umask)
    assert modes.pop("notes.txt") == 0o644
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (data / name).is_dir() else 0o600)
    }
    assert not wrong, wrong
    assert modes["ssd/LOG.old.from-an-older-run"] == 0o600
    assert len(modes) > 6


def test_a_shared_folder_is_never_taken_over(tmp_path: Path) -> None:
    shared = tmp_path / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky and open to all, like /tmp
    (shared / "someone-elses.txt").write_text("x")
    (shared / "someone-elses.txt").chmod(0o644)
    assert shared_folder(shared) and shared_folder(Path.home()) and shared_folder(Path("/"))
    assert make_private(shared) == 0
    private_folder(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "someone-elses.txt").stat().st_mode) == 0o644
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    (own / "f").write_text("x")
    (own / "f").chmod(0o644)
    assert not shared_folder(own)
    assert make_private(own) == 2
    assert stat.S_IMODE((own / "f").stat().st_mode) == 0o600


def test_metrics_listen_apart_and_carry_no_secret(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    tokens = _tokens_file(tmp_path / "tokens.toml")
    daemon = daemon_factory(
        ssd=None,
        settings={"auth.tokens_file": str(tokens), "server.metrics_host": "127.0.0.2"},
    )
    assert daemon.info.metrics_url.startswith("http://127.0.0.2:")
    port = int(daemon.info.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):  # not on the gRPC address
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    _client(daemon, "tool").connect()  # a refusal (lane), counted
    bad = StoreClient(daemon.address, shared_memory=False, token="wrong-token", retries=0)
    daemon.clients.append(bad)
    with pytest.raises(Exception):  # noqa: B017 - Unauthenticated; only the count matters here
        bad.connect()
    text = urllib.request.urlopen(daemon.info.metrics_url, timeout=5).read().decode()
    assert "strata_auth_denied_total" in text
    for secret in (*TOKENS.values(), *(hash_token(t) for t in TOKENS.values()), "wrong-token"):
        assert secret not in text
    assert "engine" not in text and "tool" not in text  # no principal names either
