"""Reserve and Acquire hand out slots of the shared-memory segment, so the daemon serves them only
to calls that come from its own host: the lane, its unix socket, loopback. A `trusted_local`
token used from another host would otherwise commit slots it never wrote and read their old
bytes (perhaps another tenant's) back under its own key."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import chain, make_scope

from kvstore.auth import hash_token
from kvstore.config import load_config
from kvstore.service import NodeIdentity, StoreService
from kvstore.store import Store
from kvstore_pb import store_pb2 as pb

TOKEN = "engine-token-0123456789"
SCOPE = make_scope("tenant-a")


class _Aborted(Exception):
    pass


class _Context:
    """What the handlers read of a grpc.ServicerContext: the peer, the token, abort."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),)

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, metadata: object) -> None:
        pass

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[StoreService]:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[principal]]\nname = "engine"\ntoken_sha256 = "{hash_token(TOKEN)}"\n'
        'read = ["tenant-a"]\nwrite = ["tenant-a"]\ntrusted_local = true\n'
    )
    tokens.chmod(0o600)
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path / "data"),
            "dram.capacity_bytes": "16MiB",
            "dram.segment_name": f"strata-test-{uuid.uuid4().hex[:12]}",
            "ssd.enabled": "false",
            "auth.tokens_file": str(tokens),
        },
    )
    store = Store(config)
    try:
        yield StoreService(store, NodeIdentity("t", "this-host", ""))
    finally:
        store.close()


def _calls(service: StoreService) -> list[tuple[str, object, object]]:
    pages = chain(SCOPE, 1, seed=6)
    reserve = pb.ReserveRequest(scope=SCOPE.encode(), headers=[p.header.encode() for p in pages])
    acquire = pb.AcquireRequest(scope=SCOPE.encode(), keys=pages[0].header.key)
    return [("Reserve", service.Reserve, reserve), ("Acquire", service.Acquire, acquire)]


@pytest.mark.parametrize("peer", ["ipv4:10.1.2.3:40000", "ipv6:[2001:db8::7]:40000"])
def test_a_trusted_token_from_another_host_gets_no_slots(service: StoreService, peer: str) -> None:
    for name, call, request in _calls(service):
        context = _Context(peer)
        with pytest.raises(_Aborted):
            call(request, context)  # type: ignore[operator]
        assert context.code == grpc.StatusCode.PERMISSION_DENIED, name
        assert "loopback" in context.details and peer in context.details
    assert service.auth.denied_counts().get("local_untrusted") == 2


@pytest.mark.parametrize(
    "peer", ["lane", "unix:/run/strata.sock", "ipv4:127.0.0.1:40000", "ipv6:[::1]:40000"]
)
def test_the_same_host_is_served(service: StoreService, peer: str) -> None:
    for name, call, request in _calls(service):
        reply = call(request, _Context(peer))  # type: ignore[operator]
        assert reply is not None, name
        if name == "Reserve":
            assert reply.lease_id and reply.slots[0].reserved  # type: ignore[attr-defined]
            service.store.abort(reply.lease_id)  # type: ignore[attr-defined]
    assert service.auth.denied_counts().get("local_untrusted", 0) == 0
