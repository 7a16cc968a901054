"""A coverage-guided (atheris / libFuzzer) target: mutated request bytes against a live daemon.

    STRATA_FUZZ_TARGET=rpc|lane|tcp [STRATA_FUZZ_AUTH=1] python tests/fuzz/rpc_target.py \
        [libFuzzer flags] [CORPUS ...]
    strata fuzz --target rpc|lane|tcp [--auth] [--seconds N | --runs N]

The daemon runs in this process (its kvstore/ and client/ code instrumented, so libFuzzer sees
the coverage of the daemon's parsing and checks) and is reached only over loopback, as any
client would reach it:

- `rpc`: byte 0 picks the method, byte 1 where a request stream ends abruptly, the rest is the
  serialized request (for Put, messages each prefixed by a little-endian u16 length), sent with
  no serializer over a plain grpc channel (`channel.unary_unary(path)`).
- `lane`: one frame on the same-host lane's unix socket: byte 0 the method id (0 = HELLO), byte
  1 the flags (bit 7: the frame announces the u32 of bytes 2-5 as its length instead of the
  truth; bit 6, with auth: a valid HELLO first), the rest the payload.
- `tcp`: one frame of the TCP data path (client/transports/tcp_protocol.py): byte 0 the kind,
  byte 1 flags (bit 0: a foreign magic, bit 1: announce the u32 of bytes 6-9 as meta length,
  bit 2, with auth: a valid HELLO first), bytes 2-5 aux, bytes 10-11 the meta length (capped by
  what is left), then the meta, then payload bytes sent right after the frame (a PUT_PAGES
  carries its payloads in the same send); the input's end ends what the client sends.

A crash is an answer that is not a clean status (UNKNOWN, INTERNAL, an ERROR frame of code
INTERNAL; tests/fuzz/rpc_calls.py `check`), a complete request left unanswered past a deadline,
or the daemon not answering NodeInfo afterwards. Every `AUDIT_EVERY` inputs, the store's own
`check_integrity` runs and every page the daemon serves is read back and checked
(rpc_calls.audit), and the legitimate tenant's pages must be intact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import struct
import sys
import tempfile
from pathlib import Path

import atheris
import xxhash
from google.protobuf.message import DecodeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fuzz package

import grpc

# Not instrumented: the tiers, the mover, metrics, config and the SDK's clients (imported first,
# so the block below does not instrument them: seconds of start-up for code that inputs do not
# reach). Instrumented: what parses and checks requests (service, lane, bulk server, store,
# index, leases, auth, chain, the codecs).
import client.async_client
import client.cluster.cluster_client  # noqa: F401
import kvstore.config
import kvstore.metrics
import kvstore.mover
import kvstore.tiers.dram
import kvstore.tiers.gpu
import kvstore.tiers.ssd  # noqa: F401

with atheris.instrument_imports(include=["kvstore", "client"]):
    from client import StoreClient, build_pages
    from client.contract.page import HEADER_FIXED_BYTES
    from client.contract.scope import chain_key
    from client.transports.lane_protocol import METHOD_IDS, REQUEST, RESPONSE
    from client.transports.tcp_protocol import (
        KIND_LOOKUP,
        KIND_LOOKUP_HITS,
        KIND_PUT_PAGES,
        encode_put_pages,
    )
    from client.transports.ucx_protocol import (
        KIND_DONE,
        KIND_ERROR,
        KIND_GET,
        KIND_HELLO,
        KIND_MANIFEST,
        KIND_WELCOME,
        MAGIC,
        PREAMBLE,
        VERSION,
    )
    from kvstore.auth import hash_token
    from kvstore.config import load_config
    from kvstore.server import Daemon

from fuzz.rpc_calls import (
    KINDS,
    METHODS,
    Call,
    audit,
    check,
    healthy,
    private_channel,
    send,
)
from fuzz.rpc_strategies import FUZZ_SCOPE, OTHER_SCOPE, World, fresh_pages, seed_calls

from kvstore_pb import store_pb2 as pb

TARGET = os.environ.get("STRATA_FUZZ_TARGET", "rpc")
# With auth: the daemon checks principals; the fuzzer's token holds namespace "fuzz" (lane and
# TCP inputs choose whether a HELLO with it comes first), the legitimate tenant's "legit".
AUTH = os.environ.get("STRATA_FUZZ_AUTH") == "1"
TOKENS = {"fuzzer": "fuzzer-token-0123456789", "legit": "legit-token-0123456789",
          "ops": "ops-token-0123456789"}  # fmt: skip
SELF_TEST = os.environ.get("STRATA_FUZZ_SELF_TEST") == "1"  # plant a bug: the harness must see it
AUDIT_EVERY = int(os.environ.get("STRATA_FUZZ_AUDIT_EVERY", "500"))
TIMEOUT_S = 5.0
CLEAN_CODES = {0} | {code.value[0] for code in (grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)}  # fmt: skip
TCP_INTERNAL = 7  # client/transports/ucx_protocol.py: the ERROR code of an exception that is not typed
TCP_ANSWERED = {KIND_GET, KIND_PUT_PAGES, KIND_LOOKUP}  # a complete one must get an answer
TCP_ANSWERS = {KIND_MANIFEST, KIND_DONE, KIND_ERROR, KIND_LOOKUP_HITS, KIND_WELCOME}
_HEADER_FIXED = HEADER_FIXED_BYTES
_KEY, _PARENT = 28, 44  # offsets of the key and the parent in a page header (client/contract/page.py)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def token(who: str) -> str | None:
    return TOKENS[who] if AUTH else None


def bearer(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),) if AUTH else ()


def tokens_file(folder: Path) -> Path:
    path = folder / "tokens.toml"
    path.write_text("".join(
        f'[[principal]]\nname = "{who}"\ntoken_sha256 = "{hash_token(TOKENS[who])}"\n'
        f"read = {rights}\nwrite = {rights}\ndelete = true\ntrusted_local = true\n"
        f"operator = {str(who == 'ops').lower()}\n\n"
        for who, rights in (("fuzzer", '["fuzz"]'), ("legit", '["legit"]'), ("ops", '["*"]'))
    ))  # fmt: skip
    path.chmod(0o600)
    return path


class Failures(logging.Handler):
    """Records what the daemon logs at ERROR or with a traceback (each one a finding)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(self.format(record))


FAILURES = Failures()


class Live:
    """The daemon under fuzzing, a legitimate tenant's pages in it, and a gRPC channel."""

    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="strata-fuzz-"))
        self.daemon = Daemon(
            load_config(
                env={},
                overrides={
                    "server.host": "127.0.0.1",
                    "server.port": "0",
                    "server.metrics_port": "-1",
                    "server.unix_socket": str(folder / "lane.sock"),
                    "server.ucx": "false",
                    "server.tcp": "true",
                    "data_dir": str(folder / "data"),
                    "dram.capacity_bytes": "32MiB",
                    "ssd.capacity_bytes": "64MiB",
                    "limits.max_keys_per_call": "64",
                    "limits.chunk_bytes": "64KiB",
                    "limits.max_message_bytes": "320KiB",
                    "limits.lease_ttl_ms": "2000",
                    "limits.max_reserve_lease_ms": "2000",
                    **({"auth.tokens_file": str(tokens_file(folder))} if AUTH else {}),
                },
            )
        )
        info = self.daemon.start()
        self.address = info.address
        self.lane_path = info.local_address.removeprefix("lane:")
        host, _, port = info.tcp_address.removeprefix("tcp://").rpartition(":")
        self.tcp = (host, int(port))
        self.channel = grpc.insecure_channel(self.address)
        self.client = StoreClient(self.address, shared_memory=True, token=token("legit"))
        fuzzer = StoreClient(self.address, shared_memory=False, token=token("fuzzer"))
        rng = random.Random(7)
        layout = FUZZ_SCOPE.layout
        legit_scope = FUZZ_SCOPE.__class__(
            model_id="legit/model", weights_revision="w", tokenizer_fingerprint="t",
            kv_dtype="float16", layout=layout, namespace="legit",
        )  # fmt: skip
        self.legit_scope = legit_scope
        tokens = [rng.randrange(50_000) for _ in range(8 * layout.page_tokens)]
        payloads = [rng.randbytes(legit_scope.page_payload_bytes) for _ in range(8)]
        self.legit = build_pages(legit_scope, tokens, payloads)
        assert self.client.put(legit_scope, self.legit).stored == 8
        known = build_pages(
            FUZZ_SCOPE,
            [rng.randrange(50_000) for _ in range(6 * layout.page_tokens)],
            [rng.randbytes(FUZZ_SCOPE.page_payload_bytes) for _ in range(6)],
        )
        assert fuzzer.put(FUZZ_SCOPE, known).stored == 6
        fuzzer.close()
        self.world = World(FUZZ_SCOPE, OTHER_SCOPE, tuple(p.header.key for p in known), 64)
        self.inputs = 0

    def check_all(self) -> None:
        """The store's own integrity check, an audit of every page it serves, the legit pages."""
        store = self.daemon.store
        assert store is not None
        store.check_integrity()
        store.tiers.dram.check_integrity()
        with store._lock:
            live = {
                e.key: e.scope_digest for e in (store.index.get(k) for k in store.index_keys()) if e
            }
        scopes = {**self.world.scopes, self.legit_scope.digest: self.legit_scope}
        with private_channel(self.address) as channel:
            report = audit(channel, live, scopes, metadata=bearer("ops"))
        assert not report.bad, report.bad[:5]
        into = [bytearray(self.legit_scope.page_payload_bytes) for _ in self.legit]
        got = self.client.get(
            self.legit_scope,
            [p.header.key for p in self.legit],
            into,
            tokens=[p.header.tokens for p in self.legit],
        )
        assert all(h is not None for h in got.headers), "a legitimate page went missing"
        assert [bytes(b) for b in into] == [bytes(p.payload) for p in self.legit]


LIVE: Live | None = None


def live() -> Live:
    global LIVE
    if LIVE is None:
        LIVE = Live()
    return LIVE


# ---- rpc -------------------------------------------------------------------------------------


def split_messages(data: bytes) -> tuple[bytes, ...]:
    """u16-length-prefixed messages; what is left over is the last one."""
    out: list[bytes] = []
    pos = 0
    while pos + 2 <= len(data) and len(out) < 64:
        (n,) = _U16.unpack_from(data, pos)
        out.append(data[pos + 2 : pos + 2 + n])
        pos += 2 + n
    if pos < len(data):
        out.append(data[pos:])
    return tuple(out)


def join_messages(messages: tuple[bytes, ...]) -> bytes:
    return b"".join(_U16.pack(len(m)) + m for m in messages)


RESEAL, REKEY = 0x10, 0x20  # byte 1 flags of the rpc target


def _repair(header: bytes, flags: int) -> bytes:
    """A page header with its key recomputed from its parent and tokens (REKEY) and its header
    checksum recomputed (RESEAL): what any client can do, so that mutations get past those two
    checks to what lies behind them (the scope, the chain, the commit)."""
    fixed = _HEADER_FIXED
    if len(header) < fixed + 8:
        return header
    if flags & REKEY:
        count = (len(header) - fixed - 8) // 4
        tokens = struct.unpack_from(f"<{count}I", header, fixed)
        parent = header[_PARENT : _PARENT + 16]
        header = header[:_KEY] + chain_key(parent, tokens) + header[_KEY + 16 :]
    return header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))


def _repaired(method: str, message: bytes, flags: int) -> bytes:
    """`message` with the page headers it carries repaired (see `_repair`), if it parses."""
    try:
        if method == "Put":
            request = pb.PutRequest.FromString(message)
            if request.WhichOneof("part") != "chunk" or not request.chunk.header:
                return message
            request.chunk.header = _repair(request.chunk.header, flags)
            return request.SerializeToString()
        if method == "Reserve":
            reserve = pb.ReserveRequest.FromString(message)
            reserve.headers[:] = [_repair(h, flags) for h in reserve.headers]
            return reserve.SerializeToString()
    except DecodeError:
        pass
    return message


def fuzz_rpc(d: Live, data: bytes) -> None:
    """Byte 1: bits 0-3 where a request stream ends abruptly (15: it does not), RESEAL and
    REKEY (page headers in Put chunks and Reserve repaired before sending)."""
    if len(data) < 2:
        return
    method = METHODS[data[0] % len(METHODS)]
    body, flags = data[2:], data[1]
    messages = split_messages(body) if KINDS[method][0] else (body,)
    if flags & (RESEAL | REKEY):
        messages = tuple(_repaired(method, m, flags) for m in messages)
    if KINDS[method][0]:
        call = Call(method, messages, -1 if flags & 15 == 15 else flags & 15)
    else:
        call = Call(method, messages)
    timeout = 0.05 if method == "Watch" else TIMEOUT_S
    outcome = send(d.channel, call, timeout, bearer("fuzzer"))
    problem = check(call, outcome)
    if problem:
        raise AssertionError(f"{problem} [{call.describe()}]")
    if SELF_TEST and method == "NodeInfo" and outcome.code is grpc.StatusCode.OK:
        raise AssertionError("self test: an answered NodeInfo counts as a failure")


# ---- lane ------------------------------------------------------------------------------------


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None when the daemon closed the connection first."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


LANE_HELLO = 0x40  # lane flags bit: a HELLO with the fuzzer's token comes first (auth only)


def lane_hello(sock: socket.socket) -> None:
    """Send HELLO with the fuzzer's token; it must be answered OK (the fuzzer is trusted)."""
    hello = (TOKENS["fuzzer"]).encode()
    sock.sendall(REQUEST.pack(len(hello), 0, 0, 0) + hello)
    head = _recv(sock, RESPONSE.size)
    assert head is not None, "the daemon closed the lane after a valid HELLO"
    size, status, _ = RESPONSE.unpack(head)
    body = _recv(sock, size) or b""
    assert status == 0, f"a valid HELLO was answered {status}: {body[:200]!r}"


def fuzz_lane(d: Live, data: bytes) -> None:
    if len(data) < 6:
        return
    method, flags = data[0] % 16, data[1]
    payload = data[6:]
    lying = bool(flags & 0x80)
    length = _U32.unpack_from(data, 2)[0] if lying else len(payload)
    frame = REQUEST.pack(length, method, flags & 0x3F, 0) + payload
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(d.lane_path)
        if AUTH and flags & LANE_HELLO:
            lane_hello(sock)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(frame)
        if lying or flags & 1:  # announced more than it sent, or asked for no answer
            return
        try:
            head = _recv(sock, RESPONSE.size)
        except ConnectionResetError:
            return
        except TimeoutError:
            raise AssertionError(f"lane method {method}: no answer in {TIMEOUT_S} s") from None
        if head is None:
            return  # the daemon ended the connection (a frame it will not serve)
        size, status, _ = RESPONSE.unpack(head)
        body = _recv(sock, size) or b""
        if status not in CLEAN_CODES:
            raise AssertionError(f"lane method {method} answered status {status}: {body[:300]!r}")
        if b"Traceback" in body:
            raise AssertionError(f"lane method {method} leaked a traceback: {body[:300]!r}")


# ---- tcp -------------------------------------------------------------------------------------


TCP_HELLO = 0x04  # tcp flags bit: a HELLO with the fuzzer's token comes first (auth only)


def tcp_hello(sock: socket.socket) -> None:
    """Send HELLO with the fuzzer's token; it must be answered WELCOME."""
    hello = TOKENS["fuzzer"].encode()
    sock.sendall(PREAMBLE.pack(MAGIC, VERSION, KIND_HELLO, 0, len(hello)) + hello)
    head = _recv(sock, PREAMBLE.size)
    assert head is not None, "the daemon closed the TCP connection after a valid HELLO"
    _, _, kind, _, meta = PREAMBLE.unpack(head)
    body = _recv(sock, min(meta, 1 << 16)) or b""
    assert kind == KIND_WELCOME, f"a valid HELLO was answered kind {kind}: {body[:200]!r}"


def fuzz_tcp(d: Live, data: bytes) -> None:
    if len(data) < 12:
        return
    kind, flags = data[0] % 12, data[1]
    aux = _U32.unpack_from(data, 2)[0]
    rest = data[12:]
    meta_len = min(_U16.unpack_from(data, 10)[0], len(rest))
    meta, payload = rest[:meta_len], rest[meta_len:]
    lying = bool(flags & 2)
    announced = _U32.unpack_from(data, 6)[0] if lying else meta_len
    magic = MAGIC ^ 0x0101 if flags & 1 else MAGIC
    frame = PREAMBLE.pack(magic, VERSION, kind, aux, announced) + meta
    with socket.create_connection(d.tcp, timeout=TIMEOUT_S) as sock:
        if AUTH and flags & TCP_HELLO:
            tcp_hello(sock)
        with contextlib.suppress(OSError):  # the daemon may have closed it already
            sock.sendall(frame + payload)
            if not lying:
                sock.shutdown(socket.SHUT_WR)  # what was not sent will not come
        if lying:
            return
        try:
            head = _recv(sock, PREAMBLE.size)
        except ConnectionResetError:
            return
        except TimeoutError:
            if kind in TCP_ANSWERED and not flags & 1:
                raise AssertionError(f"tcp frame kind {kind}: no answer in {TIMEOUT_S} s") from None
            return
        if head is None:
            return
        _, _, got_kind, got_aux, got_meta = PREAMBLE.unpack(head)
        body = _recv(sock, min(got_meta, 1 << 20)) or b""
        if got_kind == KIND_ERROR and got_aux == TCP_INTERNAL:
            raise AssertionError(f"tcp frame kind {kind}: an INTERNAL error: {body[:300]!r}")
        assert got_kind in TCP_ANSWERS, f"tcp frame kind {kind} answered kind {got_kind}"


FUZZERS = {"rpc": fuzz_rpc, "lane": fuzz_lane, "tcp": fuzz_tcp}


def one_input(data: bytes) -> None:
    d = live()
    FUZZERS[TARGET](d, data)
    problem = healthy(d.channel, TIMEOUT_S, bearer("ops"))
    if problem:
        raise AssertionError(problem)
    if FAILURES.records:
        raise AssertionError("the daemon logged an error:\n" + FAILURES.records[0])
    d.inputs += 1
    if d.inputs % AUDIT_EVERY == 0:
        d.check_all()


# ---- seeds -----------------------------------------------------------------------------------


def seeds(world: World) -> dict[str, bytes]:
    pages = fresh_pages(world.scope, 2, seed=11)
    out: dict[str, bytes] = {}
    if TARGET == "rpc":
        for call in seed_calls(world, pages):
            index = METHODS.index(call.method)
            body = join_messages(call.requests) if KINDS[call.method][0] else call.requests[0]
            out[f"rpc-{call.method}"] = bytes([index, 15 | RESEAL | REKEY]) + body
    elif TARGET == "lane":
        for call in seed_calls(world, pages):
            if call.method in METHOD_IDS:
                out[f"lane-{call.method}"] = (
                    bytes([METHOD_IDS[call.method], LANE_HELLO, 0, 0, 0, 0]) + call.requests[0]
                )
        out["lane-hello"] = bytes([0, 0, 0, 0, 0, 0])
    else:
        s = world.scope
        get = pb.GetRequest(
            scope_digest=s.digest, scope=s.encode(), keys=b"".join(world.known_keys[:3])
        )
        meta = get.SerializeToString()
        out["tcp-get"] = bytes([KIND_GET, TCP_HELLO]) + bytes(8) + _U16.pack(len(meta)) + meta
        lookup = pb.LookupRequest(
            scope_digest=s.digest, scope=s.encode(), keys=b"".join(world.known_keys[:3])
        ).SerializeToString()
        out["tcp-lookup"] = (
            bytes([KIND_LOOKUP, TCP_HELLO]) + bytes(8) + _U16.pack(len(lookup)) + lookup
        )
        begin = pb.PutBegin(scope=s.encode(), page_count=len(pages)).SerializeToString()
        meta = encode_put_pages(begin, [h for h, _ in pages], [len(p) for _, p in pages])
        out["tcp-put"] = (
            bytes([KIND_PUT_PAGES, TCP_HELLO]) + _U32.pack(len(pages)) + bytes(4) + _U16.pack(len(meta)) + meta
            + b"".join(p for _, p in pages)
        )  # fmt: skip
    return out


def main() -> None:
    logging.getLogger().addHandler(FAILURES)  # the only handler: expected warnings stay quiet
    logging.getLogger().setLevel(logging.WARNING)
    args = list(sys.argv)
    # corpus folders get the seeds (a file named instead is an input to run again)
    folders = [Path(a) for a in args[1:] if not a.startswith("-") and not Path(a).is_file()]
    if folders:
        world = live().world
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            for name, blob in seeds(world).items():
                (folder / name).write_bytes(blob)
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
