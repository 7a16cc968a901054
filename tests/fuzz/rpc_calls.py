"""Raw store calls for fuzzing a live daemon, and the properties every answer must have.

A `Call` is one RPC as bytes: the method's name and its serialized request message(s), sent over
a plain grpc channel with no serializers (`channel.unary_unary(path)` passes bytes through), so
a fuzzer can hand the daemon anything, well-formed or not. `send` returns an `Outcome`; `check`
says whether that outcome is acceptable:

- a clean status code: OK or one of the typed errors' codes (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED, FAILED_PRECONDITION, DATA_LOSS, UNAVAILABLE, PERMISSION_DENIED,
  UNAUTHENTICATED), never UNKNOWN or INTERNAL (an exception the daemon did not map), never a
  traceback in the details;
- an answer within the deadline (a unary call or a finite stream that times out is a hang;
  only Watch, which never ends by itself, is expected to run into its deadline).

`healthy` is the liveness property (NodeInfo answers within a deadline) and `audit` the storage
property: every page the daemon serves (each key its event stream reported stored and not
removed, read back with a raw Get) decodes, is the chain hash of its parent and tokens, belongs
to the scope digest it is stored under, validates for that scope when the scope is known, and
matches its payload checksum. Used by tests/integration/test_rpc_fuzz.py (hypothesis),
tests/fuzz/rpc_target.py (atheris) and `strata fuzz --target rpc`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from client.contract.errors import Corrupt, InvalidArgument
from client.contract.page import PageHeader
from client.contract.scope import KEY_BYTES, Scope, chain_key
from kvstore_pb import store_pb2 as pb

SERVICE = "/strata.store.v1.Store/"
_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["Store"]
# method name -> (client streaming, server streaming)
KINDS: dict[str, tuple[bool, bool]] = {
    m.name: (m.client_streaming, m.server_streaming) for m in _DESCRIPTOR.methods
}
METHODS: tuple[str, ...] = tuple(sorted(KINDS))

CLEAN = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
MAX_REPLIES = 10_000  # a stream that sends more than this is cut (and counts as a finding)


@dataclass(frozen=True, slots=True)
class Call:
    """One RPC: `requests` are serialized messages (exactly one unless the method streams
    requests). `abort_after` >= 0 ends a request stream abruptly after that many messages
    (the client cancels: a stream that ends early); -1 sends them all and half-closes."""

    method: str
    requests: tuple[bytes, ...]
    abort_after: int = -1  # (the daemon may have answered before: then its answer counts)
    note: str = ""

    def describe(self) -> str:
        sizes = ",".join(str(len(r)) for r in self.requests[:8])
        return f"{self.method}[{sizes}] abort_after={self.abort_after} {self.note}".strip()


@dataclass(frozen=True, slots=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: tuple[bytes, ...] = ()
    aborted: bool = False  # the request stream was ended by us (abort_after)


class _Requests:
    """The request messages of `call`, as an iterator that stops after `abort_after` of them
    and waits there (`reached`) until the caller has cancelled the call (`release`)."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self.reached = threading.Event()
        self._released = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        for n, message in enumerate(self._call.requests):
            if n == self._call.abort_after:
                break
            yield message
        if self._call.abort_after >= 0:
            self.reached.set()
            self._released.wait(10.0)

    def release(self) -> None:
        self._released.set()


def _stream_unary(
    channel: grpc.Channel,
    path: str,
    call: Call,
    timeout_s: float,
    md: tuple[tuple[str, str], ...] | None,
) -> Outcome:
    requests = _Requests(call)
    future = channel.stream_unary(path).future(iter(requests), timeout=timeout_s, metadata=md)
    future.add_done_callback(lambda _: requests.reached.set())  # an early answer counts
    try:
        if call.abort_after >= 0:
            requests.reached.wait(timeout_s)
            if not future.done() and future.cancel():  # the stream ends abruptly
                return Outcome(grpc.StatusCode.CANCELLED, "", (), True)
        return Outcome(grpc.StatusCode.OK, "", (future.result(),))
    finally:
        requests.release()


def send(
    channel: grpc.Channel,
    call: Call,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Outcome:
    """Send `call` as raw bytes; the status and raw replies (never raises for a status)."""
    path = SERVICE + call.method
    client_streaming, server_streaming = KINDS[call.method]
    md = tuple(metadata) if metadata else None
    try:
        if client_streaming:
            return _stream_unary(channel, path, call, timeout_s, md)
        request = call.requests[0] if call.requests else b""
        if not server_streaming:
            reply = channel.unary_unary(path)(request, timeout=timeout_s, metadata=md)
            return Outcome(grpc.StatusCode.OK, "", (reply,))
        stream = channel.unary_stream(path)(request, timeout=timeout_s, metadata=md)
        try:
            replies = tuple(itertools.islice(stream, MAX_REPLIES + 1))
        finally:
            stream.cancel()
        return Outcome(grpc.StatusCode.OK, "", replies)
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")


def check(call: Call, outcome: Outcome) -> str | None:
    """Why `outcome` breaks a property (None: it is fine)."""
    code = outcome.code
    if outcome.aborted:
        return None
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return None if call.method == "Watch" else f"{call.method} hung past its deadline"
    if code not in CLEAN:
        return f"{call.method} answered {code.name}: {outcome.details[:300]!r}"
    if "Traceback" in outcome.details:
        return f"{call.method} leaked a traceback: {outcome.details[:300]!r}"
    if len(outcome.replies) > MAX_REPLIES:
        return f"{call.method} streamed more than {MAX_REPLIES} replies"
    return None


def healthy(
    channel: grpc.Channel, timeout_s: float, metadata: Sequence[tuple[str, str]] | None = None
) -> str | None:
    """None when NodeInfo answers within `timeout_s`, else why not."""
    outcome = send(channel, Call("NodeInfo", (b"",)), timeout_s, metadata)
    if outcome.code is not grpc.StatusCode.OK:
        return f"NodeInfo after the case: {outcome.code.name} {outcome.details[:200]!r}"
    return None


# ---- the storage property ------------------------------------------------------------------------


class Watcher:
    """Follows the daemon's event stream (a Watch of every scope): `live()` maps each key
    reported stored and not since removed to its scope digest. A Watch sees only events after
    it began: start it first, then `wait_for` the keys of a first put (its readiness signal)."""

    def __init__(
        self, channel: grpc.Channel, metadata: Sequence[tuple[str, str]] | None = None
    ) -> None:
        self._call = channel.unary_stream(SERVICE + "Watch")
        self._md = tuple(metadata) if metadata else None
        self._live: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._stream: grpc.Call | None = None
        self.error = ""
        self._thread = threading.Thread(target=self._follow, name="fuzz-watch", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def _follow(self) -> None:
        stream = self._call(pb.WatchRequest().SerializeToString(), metadata=self._md)
        self._stream = stream
        try:
            for raw in stream:
                ev = pb.Event.FromString(raw)
                with self._cond:
                    if ev.kind == pb.EVENT_KIND_STORED:
                        self._live[ev.key] = ev.scope_digest
                    elif ev.kind == pb.EVENT_KIND_REMOVED:
                        self._live.pop(ev.key, None)
                    self._cond.notify_all()
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.CANCELLED:
                self.error = f"watch ended: {err.code().name} {err.details()!r}"

    def wait_for(self, keys: Sequence[bytes], timeout_s: float = 10.0) -> bool:
        """Whether every key of `keys` was reported stored within `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: all(k in self._live for k in keys), timeout_s)

    def live(self) -> dict[bytes, bytes]:
        with self._cond:
            return dict(self._live)

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.cancel()  # type: ignore[attr-defined]
        self._thread.join(5)


@dataclass
class Audit:
    served: int = 0
    missing: int = 0
    bad: list[str] = field(default_factory=list)


def _page_problem(
    key: bytes, digest: bytes, header_raw: bytes, payload: bytes, scopes: Mapping[bytes, Scope]
) -> str | None:
    try:
        header = PageHeader.decode(header_raw)
    except Corrupt as exc:
        return f"page {key.hex()}: header does not decode: {exc}"
    if header.key != key:
        return f"page {key.hex()}: served under another key's header {header.key.hex()}"
    if header.scope_digest != digest:
        return f"page {key.hex()}: its header names scope {header.scope_digest.hex()}"
    if chain_key(header.parent, header.tokens) != header.key:
        return f"page {key.hex()}: key is not the hash of its parent and tokens"
    scope = scopes.get(digest)
    if scope is not None:
        try:
            header.validate_for(scope)
        except InvalidArgument as exc:
            return f"page {key.hex()}: does not validate for its scope: {exc}"
    if len(payload) != header.payload_bytes:
        return f"page {key.hex()}: {len(payload)} payload bytes, header says {header.payload_bytes}"
    try:
        header.verify_payload(payload)
    except Corrupt as exc:
        return f"page {key.hex()}: payload checksum: {exc}"
    return None


def private_channel(address: str) -> grpc.Channel:
    """A channel with its own connection (the daemon limits streams per connection: the audit
    must not queue behind what the fuzzer left open)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def audit(
    channel: grpc.Channel,
    live: Mapping[bytes, bytes],
    scopes: Mapping[bytes, Scope],
    *,
    batch: int = 32,
    timeout_s: float = 30.0,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Audit:
    """Read back every key of `live` (key -> scope digest) with raw Gets and check each page
    served (see `_page_problem`). A key not served is a miss (evicted, dropped as corrupt). A
    page under a scope digest not in `scopes` is a finding: nothing the fuzzer can send should
    make one (and with auth on a read must name its scope)."""
    report = Audit()
    by_scope: dict[bytes, list[bytes]] = {}
    for key, digest in live.items():
        by_scope.setdefault(digest, []).append(key)
    for digest, keys in by_scope.items():
        scope = scopes.get(digest)
        if scope is None:
            report.bad.append(f"{len(keys)} page(s) stored under an unknown scope {digest.hex()}")
            continue
        for start in range(0, len(keys), batch):
            part = keys[start : start + batch]
            request = pb.GetRequest(scope_digest=digest, scope=scope.encode(), keys=b"".join(part))
            get = Call("Get", (request.SerializeToString(),))
            for _ in range(50):  # a busy daemon refuses streams for a while: bounded retries
                outcome = send(channel, get, timeout_s, metadata)
                if outcome.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
                time.sleep(0.1)
            if outcome.code is not grpc.StatusCode.OK:
                report.bad.append(f"audit Get: {outcome.code.name} {outcome.details[:200]!r}")
                continue
            headers: dict[int, bytes] = {}
            payloads: dict[int, bytearray] = {}
            for raw in outcome.replies:
                reply = pb.GetResponse.FromString(raw)
                if reply.WhichOneof("part") == "missing":
                    report.missing += 1
                    continue
                chunk = reply.chunk
                if chunk.header:
                    headers[chunk.index] = chunk.header
                payloads.setdefault(chunk.index, bytearray()).extend(chunk.data)
            for index, header_raw in headers.items():
                if not 0 <= index < len(part):
                    report.bad.append(f"audit Get: chunk index {index} out of range")
                    continue
                report.served += 1
                problem = _page_problem(
                    part[index], digest, header_raw, bytes(payloads.get(index, b"")), scopes
                )
                if problem:
                    report.bad.append(problem)
    assert all(len(k) == KEY_BYTES for k in live)
    return report
