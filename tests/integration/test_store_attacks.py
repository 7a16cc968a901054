"""The attacks of issue 10, tried against a live daemon (a `strata serve` child on loopback)
that runs with every store mechanism on at once: principals and tokens, a shared read-only
namespace, verified key chains, TLS required on gRPC and the TCP data path.

Each attack must be refused with its code, disturb nothing else, and leave the legitimate
tenant's pages intact: after every test `undisturbed` reads tenant A's pages back byte for byte
(with their tokens, as every SDK read now checks) and checks the daemon still runs and answers.

The daemon's config is the one docs/security.md shows as its worked example (`daemon.toml`
and `tokens.toml` below); the certificates are a throwaway CA's, for 127.0.0.1 only.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from client import Page, Scope, StoreClient, build_pages
from client.contract.errors import (
    CapacityExhausted,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from client.contract.page import PageHeader, payload_checksum
from client.contract.scope import KVLayout, chain_key
from client.transports.tls import TlsOptions
from client.transports.ucx_protocol import KIND_GET, PREAMBLE, parse_address, preamble
from kvstore.auth import hash_token
from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.integration

TOKENS = {
    "engine-a": "sk-store-a-7f3c9a1e5b2d4c6e",
    "mallory-a": "sk-store-a2-0d9e8f7a6b5c4d3e",  # a second writer of tenant-a (a co-tenant)
    "engine-b": "sk-store-b-4b7f19c2a8d6e035",
    "ops": "sk-store-ops-91c3e7a5f0b2d468",
}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=16)


def scope_of(namespace: str) -> Scope:
    return Scope(
        model_id="acme/llama-tiny",
        weights_revision="r1",
        tokenizer_fingerprint="tok1",
        kv_dtype="float16",
        layout=LAYOUT,
        namespace=namespace,
    )


A, B, SHARED = scope_of("tenant-a"), scope_of("tenant-b"), scope_of("shared")
B_DRAM_PAGES, B_SSD_PAGES = 4, 16  # tenant-b's quotas, in pages

TOKENS_TOML = f"""
[[principal]]
name = "engine-a"
token_sha256 = "{hash_token(TOKENS["engine-a"])}"
read = ["tenant-a", "shared"]
write = ["tenant-a"]
delete = true
trusted_local = true

[[principal]]
name = "mallory-a"
token_sha256 = "{hash_token(TOKENS["mallory-a"])}"
read = ["tenant-a"]
write = ["tenant-a"]
delete = false
trusted_local = false

[[principal]]
name = "engine-b"
token_sha256 = "{hash_token(TOKENS["engine-b"])}"
read = ["tenant-b", "shared"]
write = ["tenant-b"]
delete = true
trusted_local = false

[[principal]]
name = "ops"
token_sha256 = "{hash_token(TOKENS["ops"])}"
read = ["*"]
write = ["*"]
delete = true
operator = true
trusted_local = false
"""


def daemon_toml(folder: Path) -> str:
    return f"""
[server]
tcp = true
ucx = false

[auth]
tokens_file = "{folder / "tokens.toml"}"
shared_namespaces = ["shared"]

[tls]
cert = "{folder / "server.pem"}"
key = "{folder / "server.key"}"
require = true

[[quota]]
namespace = "tenant-b"
dram = "{B_DRAM_PAGES * B.page_payload_bytes}"
ssd = "{B_SSD_PAGES * B.page_payload_bytes}"
"""


# ---- the daemon ------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certificates(folder: Path) -> None:
    """ca.pem, and server.pem / server.key for IP 127.0.0.1 signed by it."""
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
             "-out", str(ca), "-days", "2", "-subj", "/CN=strata-attacks-ca")  # fmt: skip
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.pem"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", "/CN=strata-store")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "2", "-out", str(cert),
             "-extfile", str(folder / "san.ext"))  # fmt: skip
    key.chmod(0o600)


@dataclass
class Live:
    daemon: DaemonProcess
    folder: Path
    tls: TlsOptions
    channel: grpc.Channel
    clients: list[StoreClient]
    a_pages: list[Page]
    b_pages: list[Page]

    @property
    def address(self) -> str:
        return self.daemon.address

    def client(self, who: str | None, **kwargs: object) -> StoreClient:
        token = TOKENS.get(who or "", who)
        c = StoreClient(
            self.address, shared_memory=False, token=token, tls=self.tls, timeout_s=10.0,
            retries=0, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        self.clients.append(c)
        return c

    def stub(self) -> StoreStub:
        return StoreStub(self.channel)

    def tcp_address(self) -> str:
        reply = self.stub().NodeInfo(pb.NodeInfoRequest(), metadata=bearer("ops"), timeout=10)
        return reply.tcp_address


def bearer(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS.get(who, who)}"),)


def prompt(scope: Scope, count: int, seed: int) -> list[Page]:
    rng = random.Random(seed)
    tokens = [rng.randrange(32_000) for _ in range(count * LAYOUT.page_tokens)]
    payloads = [rng.randbytes(scope.page_payload_bytes) for _ in range(count)]
    return build_pages(scope, tokens, payloads)


def keys_of(pages: Sequence[Page]) -> list[bytes]:
    return [p.header.key for p in pages]


def read_back(client: StoreClient, scope: Scope, pages: Sequence[Page]) -> list[bytes | None]:
    into = [bytearray(scope.page_payload_bytes) for _ in pages]
    got = client.get(
        scope, [p.header.key for p in pages], into, tokens=[p.header.tokens for p in pages]
    )
    return [bytes(b) if h is not None else None for h, b in zip(got.headers, into, strict=True)]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = tmp_path_factory.mktemp("attacks")
    make_certificates(folder)
    tokens = folder / "tokens.toml"
    tokens.write_text(TOKENS_TOML)
    tokens.chmod(0o600)
    (folder / "daemon.toml").write_text(daemon_toml(folder))
    daemon = DaemonProcess(
        folder / "data", dram="64MiB", ssd="128MiB", extra=["--config", str(folder / "daemon.toml")]
    )
    with daemon:
        ca = (folder / "ca.pem").read_bytes()
        channel = grpc.secure_channel(daemon.address, grpc.ssl_channel_credentials(ca))
        d = Live(daemon, folder, TlsOptions(ca_file=str(folder / "ca.pem")), channel, [], [], [])
        d.a_pages, d.b_pages = prompt(A, 6, seed=1), prompt(B, 4, seed=2)
        assert d.client("engine-a").put(A, d.a_pages).stored == 6
        assert d.client("engine-b").put(B, d.b_pages).stored == 4
        try:
            yield d
        finally:
            for c in d.clients:
                c.close()
            channel.close()


@pytest.fixture(autouse=True)
def undisturbed(live: Live, request: pytest.FixtureRequest) -> Iterator[None]:
    """After each attack: the daemon runs and answers; A's and B's pages are intact (B filling
    its own quota may evict B's own pages: those still served must be B's, byte for byte)."""
    yield
    assert live.daemon.proc is not None and live.daemon.proc.poll() is None
    a, b = live.client("engine-a"), live.client("engine-b")
    assert read_back(a, A, live.a_pages) == [bytes(p.payload) for p in live.a_pages]
    got = read_back(b, B, live.b_pages)
    if request.node.name.startswith("test_a_tenant_past_its_quota"):
        got = [
            g if g is not None else bytes(p.payload) for g, p in zip(got, live.b_pages, strict=True)
        ]
    assert got == [bytes(p.payload) for p in live.b_pages]


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        result = call() if callable(call) else call
        if not isinstance(result, pb.PutResponse | pb.LookupResponse | pb.DeleteResponse):
            list(result)  # type: ignore[call-overload]
    return err.value.code()


def put_raw(
    live: Live, who: str, scope: Scope, headers: Sequence[bytes], payloads: Sequence[bytes]
) -> pb.PutResponse:
    """A gRPC put of raw headers (as an attacker would send them: no SDK checks)."""
    messages = [pb.PutRequest(begin=pb.PutBegin(scope=scope.encode(), page_count=len(headers)))]
    for i, (header, payload) in enumerate(zip(headers, payloads, strict=True)):
        messages.append(pb.PutRequest(chunk=pb.PageChunk(index=i, header=header, data=payload)))
    return live.stub().Put(iter(messages), metadata=bearer(who), timeout=10)


def forged(page: Page, **changes: object) -> bytes:
    """`page`'s header with fields changed, re-encoded with a correct header checksum (xxh3 is
    not keyed: an attacker can always recompute it)."""
    return dataclasses.replace(page.header, **changes).encode()  # type: ignore[arg-type]


# ---- a missing or wrong token ----------------------------------------------------------------


def test_a_call_without_a_token_or_with_a_wrong_one_is_unauthenticated(live: Live) -> None:
    stub = live.stub()
    lookup = pb.LookupRequest(
        scope_digest=A.digest, scope=A.encode(), keys=live.a_pages[0].header.key
    )
    assert code_of(lambda: stub.Lookup(lookup, timeout=10)) is grpc.StatusCode.UNAUTHENTICATED
    for token in ("sk-not-a-token-0000000000", TOKENS["engine-a"][:-1], ""):
        call = lambda t=token: stub.Lookup(lookup, metadata=bearer(t), timeout=10)  # noqa: E731
        assert code_of(call) is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Unauthenticated):
        live.client("sk-not-a-token-0000000000").lookup(A, [live.a_pages[0].header.key])
    with pytest.raises(Unauthenticated):  # nor may it write
        live.client(None).put(A, prompt(A, 1, seed=90))


# ---- one namespace's token against another's pages -------------------------------------------


def test_a_token_for_a_cannot_read_write_or_delete_b(live: Live) -> None:
    a = live.client("engine-a")
    keys = [p.header.key for p in live.b_pages]
    with pytest.raises(PermissionDenied):
        a.lookup(B, keys)
    with pytest.raises(PermissionDenied):
        read_back(a, B, live.b_pages)
    with pytest.raises(PermissionDenied):
        a.put(B, prompt(B, 2, seed=91))
    with pytest.raises(PermissionDenied):
        a.delete(B)
    with pytest.raises(PermissionDenied):
        a.delete(keys=keys)
    stub = live.stub()
    raw_get = pb.GetRequest(scope_digest=B.digest, scope=B.encode(), keys=b"".join(keys))
    assert code_of(lambda: stub.Get(raw_get, metadata=bearer("engine-a"), timeout=10)) is (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # B's digest presented with A's own scope: the daemon recomputes the digest and refuses
    lying = pb.GetRequest(scope_digest=B.digest, scope=A.encode(), keys=b"".join(keys))
    assert code_of(lambda: stub.Get(lying, metadata=bearer("engine-a"), timeout=10)) is (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # a scope-less delete by key that names B's keys
    by_key = pb.DeleteRequest(keys=b"".join(keys))
    assert code_of(lambda: stub.Delete(by_key, metadata=bearer("engine-a"), timeout=10)) is (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_a_token_for_a_cannot_watch_b(live: Live) -> None:
    stub = live.stub()
    into_b = pb.WatchRequest(scope_digest=B.digest, scope=B.encode())
    watch = stub.Watch(into_b, metadata=bearer("engine-a"), timeout=10)
    assert code_of(lambda: watch) is grpc.StatusCode.PERMISSION_DENIED
    # an unfiltered Watch shows A only A's namespace: B's put is not among its events, A's
    # next put is (the stream's readiness: A's marker arrives, B's page never before it)
    stream = stub.Watch(pb.WatchRequest(), metadata=bearer("engine-a"), timeout=30)
    seen: list[pb.Event] = []
    marker = prompt(A, 1, seed=92)
    secret = prompt(B, 1, seed=93)
    done = threading.Event()

    def follow() -> None:
        for event in stream:
            seen.append(event)
            if event.key == marker[0].header.key:
                break
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    b, a = live.client("engine-b"), live.client("engine-a")
    # until the stream is open, A's puts may go unseen: put markers until one is seen
    for attempt in range(50):
        assert b.put(B, prompt(B, 1, seed=1000 + attempt)).stored == 1
        assert a.put(A, prompt(A, 1, seed=2000 + attempt)).stored == 1
        if seen:
            break
        done.wait(0.1)
    assert seen, "the watch saw none of A's puts"
    assert b.put(B, secret).stored == 1
    assert a.put(A, marker).stored == 1
    assert done.wait(10), "A's marker never arrived"
    stream.cancel()
    assert all(e.scope_digest == A.digest for e in seen), "A's watch showed another namespace"
    assert secret[0].header.key not in {e.key for e in seen}


def test_only_operators_write_the_shared_namespace_that_every_tenant_reads(live: Live) -> None:
    system_prompt = prompt(SHARED, 2, seed=94)
    with pytest.raises(PermissionDenied):
        live.client("engine-a").put(SHARED, system_prompt)
    assert live.client("ops").put(SHARED, system_prompt).stored == 2
    for who in ("engine-a", "engine-b"):
        client = live.client(who)
        assert read_back(client, SHARED, system_prompt) == [bytes(p.payload) for p in system_prompt]
        with pytest.raises(PermissionDenied):
            client.delete(SHARED)
    # a shared namespace is readable by every principal, even one that does not list it
    assert live.client("mallory-a").lookup(SHARED, keys_of(system_prompt)).hit_count == 2


# ---- forged keys and chains ------------------------------------------------------------------


def test_a_crafted_key_collision_is_refused_by_the_daemon_and_by_the_sdk_read(live: Live) -> None:
    """Two token lists under one key: the victim's prompt (tokens T, key K) and the attacker's
    tokens T' presented under K. BLAKE2b-128 collisions cannot be built, so the attacker forges
    the header instead (key K, tokens T', checksum recomputed); the daemon's chain check refuses
    it, and a reader that presents T' for K gets a miss, not the victim's page."""
    victim = prompt(A, 2, seed=95)  # not stored yet: the attacker tries to pre-publish it
    theirs = list(victim[0].header.tokens)
    theirs[-1] ^= 1
    payload = random.Random(5).randbytes(A.page_payload_bytes)
    poisoned = forged(victim[0], tokens=tuple(theirs), payload_checksum=payload_checksum(payload))
    with pytest.raises(grpc.RpcError) as err:
        put_raw(live, "mallory-a", A, [poisoned], [payload])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    a = live.client("engine-a")
    assert a.lookup(A, [victim[0].header.key]).hit_count == 0  # nothing was planted
    assert a.put(A, victim).stored == 2  # the victim's own put stores (not ALREADY_PRESENT)
    # the SDK read check: T' presented for K is a miss, although K is stored
    into = [bytearray(A.page_payload_bytes)]
    got = live.client("mallory-a").get(A, [victim[0].header.key], into, tokens=[tuple(theirs)])
    assert got.headers == (None,) and got.rejected == 1
    assert read_back(a, A, victim) == [bytes(p.payload) for p in victim]


def test_a_forged_key_for_another_namespaces_page_is_refused(live: Live) -> None:
    """B knows A's prompt (hence A's keys) and tries to plant pages A would read."""
    target = live.a_pages[0]
    as_b = prompt(B, 1, seed=96)[0]
    payload = bytes(as_b.payload)
    attempts = {
        # A's key in B's scope: its tokens do not hash to it from B's digest
        "A's key, B's chain": forged(as_b, key=target.header.key),
        # A's key honestly computed from A's digest, under B's scope: the chain starts outside B
        "A's chain in B": forged(
            as_b,
            parent=A.digest,
            tokens=target.header.tokens,
            key=chain_key(A.digest, target.header.tokens),
        ),
        # B's scope digest swapped for A's, put under B's scope: not a page of this scope
        "A's digest": forged(as_b, scope_digest=A.digest),
    }
    for name, header in attempts.items():
        with pytest.raises(grpc.RpcError) as err:
            put_raw(live, "engine-b", B, [header], [payload])
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
    with pytest.raises(grpc.RpcError) as err:  # straight into A's scope
        put_raw(live, "engine-b", A, [target.header.encode()], [bytes(target.payload)])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    b = live.client("engine-b")
    assert b.lookup(B, [target.header.key]).hit_count == 0


def test_a_put_whose_chain_does_not_verify_is_refused_and_disturbs_nothing(live: Live) -> None:
    a = live.client("engine-a")
    orphan = build_pages(A, list(range(LAYOUT.page_tokens)), [bytes(A.page_payload_bytes)])[0]
    dangling_key = chain_key(bytes(range(16)), orphan.header.tokens)
    dangling = forged(orphan, parent=bytes(range(16)), key=dangling_key)
    good = prompt(A, 2, seed=97)
    with pytest.raises(grpc.RpcError) as err:
        put_raw(live, "engine-a", A, [good[0].header.encode(), dangling],
                [bytes(good[0].payload), bytes(orphan.payload)])  # fmt: skip
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "chain" in (err.value.details() or "")
    # the page before it in the stream was stored as any put's (pages commit as they arrive),
    # the dangling one was not; the next put of the prompt goes on from there
    assert a.lookup(A, [good[0].header.key]).hit_count == 1
    assert a.lookup(A, [dangling_key]).hit_count == 0
    assert [s.name for s in a.put(A, good).statuses] == ["ALREADY_PRESENT", "STORED"]
    with pytest.raises(InvalidArgument):  # the SDK sends what the daemon refuses: the same code
        a.put(A, [dataclasses.replace(orphan, header=PageHeader.decode(dangling))])


# ---- plaintext against a TLS daemon ----------------------------------------------------------


def test_plaintext_is_refused_on_grpc_and_on_the_tcp_data_path(live: Live) -> None:
    plain = grpc.insecure_channel(live.address)
    try:
        call = lambda: StoreStub(plain).NodeInfo(  # noqa: E731
            pb.NodeInfoRequest(), metadata=bearer("ops"), timeout=5
        )
        assert code_of(call) is grpc.StatusCode.UNAVAILABLE
    finally:
        plain.close()
    with pytest.raises(Unavailable):
        StoreClient(live.address, shared_memory=False, token=TOKENS["ops"], tls=False,
                    timeout_s=5.0, retries=0).connect()  # fmt: skip
    host, port = parse_address(live.tcp_address())
    request = pb.GetRequest(scope_digest=A.digest, keys=live.a_pages[0].header.key)
    meta = request.SerializeToString()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(preamble(KIND_GET, 0, len(meta)) + meta)
        try:
            answer = sock.recv(PREAMBLE.size)
        except ConnectionResetError:
            answer = b""
    assert answer == b"", "a plaintext data-path request was answered"


# ---- a tenant past its quota (last: it fills tenant-b) ---------------------------------------


def test_a_tenant_past_its_quota_is_refused_with_a_retry_hint_and_others_keep_serving(
    live: Live,
) -> None:
    """tenant-b may hold 4 pages in DRAM and 16 on SSD. Filling past that makes room from
    tenant-b's own pages only (tenant-a's stay, and tenant-b's usage stays within its quota);
    a put that cannot fit its quota at all is RESOURCE_EXHAUSTED with a retry hint (which the
    SDK's CapacityExhausted carries from the wire: gRPC's trailing `x-strata-retry-after`, or
    the data path's ERROR frame)."""
    b, a = live.client("engine-b"), live.client("engine-a")
    for n in range(2 * (B_DRAM_PAGES + B_SSD_PAGES)):  # twice what tenant-b may hold
        assert b.put(B, prompt(B, 1, seed=3000 + n)).stored == 1
    usage = namespace_bytes(live, "tenant-b")
    assert usage["dram"] <= B_DRAM_PAGES * B.page_payload_bytes
    assert usage["ssd"] <= B_SSD_PAGES * B.page_payload_bytes
    assert read_back(a, A, live.a_pages) == [bytes(p.payload) for p in live.a_pages]
    too_big = prompt(B, B_DRAM_PAGES + 1, seed=9999)
    with pytest.raises(CapacityExhausted) as refused:
        b.put(B, too_big)
    assert refused.value.retry_after_s > 0 and "quota" in str(refused.value)
    assert b.lookup(B, keys_of(too_big)).hit_count == 0  # refused whole: nothing changed
    # tenant-a is not held back by tenant-b's quota
    more = prompt(A, 4, seed=98)
    assert a.put(A, more).stored == 4
    assert read_back(a, A, more) == [bytes(p.payload) for p in more]


def namespace_bytes(live: Live, namespace: str) -> dict[str, float]:
    """strata_namespace_bytes{namespace, tier} from the daemon's metrics."""
    with urllib.request.urlopen(live.daemon.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {"dram": 0.0, "ssd": 0.0}
    for line in text.splitlines():
        if line.startswith("strata_namespace_bytes{") and f'namespace="{namespace}"' in line:
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out
