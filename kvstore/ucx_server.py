"""The daemon's end of the bulk data paths, UCX and TCP (framing in client/transports/ucx_protocol.py).

A ucxx listener and a TCP listener on the process's bulk loop (client/transports/ucx_runtime.py); both
kinds of connection are served by the same code (a TCP socket behaves as a ucxx endpoint,
client/transports/tcp_endpoint.py). Each connected endpoint is served
one request at a time: a get acquires its pages, sends them straight from their DRAM slots and
releases them; a put reserves DRAM slots, receives each payload straight into its slot, verifies
every checksum (a network receive), then commits — or aborts and stores nothing. Typed errors go
back as ERROR frames; the connection stays usable. A client that disconnects mid-transfer only
ends its own connection: its leases are released or aborted, the daemon keeps serving.

Who calls: the first frame of a connection is HELLO with the client's token; the connection is
bound to its principal (Unauthenticated ends it) and every get and put is checked against that
principal's namespaces, as the gRPC calls are (a get carries its scope's canonical encoding; its
digest must be the one sent).

`ucxx` is imported only by `start_ucx()`: a daemon without it serves TCP and gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from client.contract.errors import (
    Corrupt,
    InvalidArgument,
    PermissionDenied,
    StrataError,
    Unauthenticated,
    Unavailable,
)
from client.contract.page import PageHeader
from client.contract.scope import KEY_BYTES, unpack_keys
from client.transports.tcp_endpoint import (
    TLS_HANDSHAKE_TIMEOUT_S,
    ByteStream,
    SocketEndpoint,
    accept_tls,
)
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_HELLO,
    KIND_MANIFEST,
    KIND_PUT,
    KIND_WANT,
    KIND_WELCOME,
    PREAMBLE,
    TCP_SCHEME,
    Frame,
    ManifestEntry,
    ProtocolError,
    decode_put,
    encode_error,
    encode_manifest,
    format_address,
    parse_preamble,
    preamble,
    settle,
)
from client.transports.ucx_runtime import bulk_loop, ucx_runtime
from kvstore.auth import OPEN, Authenticator, Principal
from kvstore.keys import IoClass, Tier, io_class_from_wire, tier_from_wire
from kvstore.store import Reservation, Store
from kvstore.tls import TLS_HANDSHAKE_BYTE, ServerTls
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_TCP_BACKLOG = 128
_META_STEP_BYTES = 1 << 20  # frame metadata over TCP is taken in steps of this, as it arrives
_POOL_THREADS = 8  # per I/O class
# With auth on, a connection's first frame (HELLO) must arrive within this long, else it is
# closed: an unauthenticated connection holds nothing for longer.
HELLO_TIMEOUT_S = 10.0
_T = TypeVar("_T")


async def _recv_meta(ep: Any, n_bytes: int) -> bytearray:
    """A frame's `n_bytes` of metadata. Over TCP (a byte stream) memory is committed only as
    the bytes arrive, a step at a time: a header that announces 72 MiB and sends nothing costs
    one step, not 72 MiB. A UCX message is received whole (its size is the sender's)."""
    if n_bytes <= _META_STEP_BYTES or not isinstance(ep, ByteStream):
        meta = bytearray(n_bytes)
        if n_bytes:
            await ep.recv(meta)
        return meta
    meta = bytearray()
    while len(meta) < n_bytes:
        part = bytearray(min(_META_STEP_BYTES, n_bytes - len(meta)))
        await ep.recv(part)
        meta += part
    return meta


def _admit_and_renew(admission: Any, store: Store, lease_id: int) -> StrataError | None:
    """Enter `admission` (blocking), then renew the read lease `lease_id` (if any): the error
    of the renewal, if it failed (the admission is held either way)."""
    admission.__enter__()
    if lease_id:
        try:
            store.renew(lease_id)
        except StrataError as exc:
            return exc
    return None


async def _first_byte(conn: socket.socket, loop: asyncio.AbstractEventLoop) -> int:
    """The first byte a new connection sends, left unread (-1 if it closes first); waits at
    most the TLS handshake timeout (TimeoutError)."""
    conn.setblocking(False)
    readable = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(conn.fileno(), ready)
    try:
        await asyncio.wait_for(readable, TLS_HANDSHAKE_TIMEOUT_S)
    finally:
        loop.remove_reader(conn.fileno())
    head = conn.recv(1, socket.MSG_PEEK)
    return head[0] if head else -1


class BulkServer:
    """Serves the bulk data paths of `store` on `host`: UCX (`start_ucx`) and TCP (`start_tcp`),
    port 0 = any free port. Each start returns the address to advertise ("ucx://host:port",
    "tcp://host:port") and raises Unavailable when that listener cannot start (for UCX also
    when ucxx cannot be imported); `stop()` closes the listeners and every connection.

    `tls`: the TCP listener speaks TLS (a connection whose first byte opens a TLS handshake is
    served over TLS; a plaintext one only unless `tls.require`, else it is closed at once), and
    with `tls.require` the UCX listener is not started (UCX here cannot encrypt).
    """

    def __init__(
        self,
        store: Store,
        host: str,
        tls: ServerTls | None = None,
        auth: Authenticator | None = None,
    ) -> None:
        self._store = store
        self._host = host
        self._auth = auth if auth is not None else Authenticator(None)
        self._tls = tls
        self._tls_context = tls.ssl_context() if tls is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None  # the ucxx listener
        self._tcp_socket: socket.socket | None = None
        self._tcp_accepting: asyncio.Task[None] | None = None
        self._endpoints: set[Any] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        limits = store.config.limits
        self._max_meta = limits.max_message_bytes
        self._reserve_ms = limits.max_reserve_lease_ms
        # a transfer must end well before its lease could run out under it
        self._put_timeout_s = limits.max_reserve_lease_ms / 2000
        self._get_timeout_s = limits.lease_ttl_ms / 2000
        # Store calls and admission waits run in a thread pool per I/O class, not the loop's
        # default pool: background work waiting for its turn (or for the background cap) can
        # hold only the background threads, never the ones a critical get needs.
        self._pools = {
            io: ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix=f"strata-bulk-{io.name}")
            for io in IoClass
        }

    async def _call(self, io: IoClass, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` in the thread pool of I/O class `io`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pools[io], functools.partial(fn, *args))

    # ---- lifecycle -------------------------------------------------------------------------

    def start_ucx(self, port: int = 0) -> str:
        if self._tls is not None and self._tls.require:
            raise Unavailable("TLS is required and the UCX data path cannot be encrypted")
        ucxx, loop = ucx_runtime()  # raises Unavailable without a usable ucxx

        async def listen() -> Any:
            return ucxx.create_listener(self._accept, port=port)

        try:
            self._listener = asyncio.run_coroutine_threadsafe(listen(), loop).result(
                _START_TIMEOUT_S
            )
        except Exception as exc:
            raise Unavailable(f"no UCX listener on port {port}: {exc}") from None
        self._loop = loop
        address = format_address(self._host, int(self._listener.port))
        log.info("UCX data path listening at %s", address)
        return address

    def start_tcp(self, port: int = 0) -> str:
        loop = bulk_loop()
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                self._host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise Unavailable(f"no TCP data listener on {self._host}:{port}: {exc}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(_TCP_BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"no TCP data listener on {self._host}:{port}: {exc}") from None

        async def accept() -> None:
            while True:
                conn, _ = await loop.sock_accept(sock)
                # held here until it runs (it then tracks itself in _handlers)
                self._handlers.add(asyncio.ensure_future(self._accept_tcp(conn, loop)))

        async def listen() -> asyncio.Task[None]:
            return asyncio.ensure_future(accept())

        self._tcp_accepting = asyncio.run_coroutine_threadsafe(listen(), loop).result(
            _START_TIMEOUT_S
        )
        self._tcp_socket, self._loop = sock, loop
        address = format_address(self._host, int(sock.getsockname()[1]), TCP_SCHEME)
        log.info("TCP data path listening at %s", address)
        return address

    def stop(self) -> None:
        """Close the listeners and every connection (their leases are released). The process's
        bulk loop itself lives on (client/transports/ucx_runtime.py)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(_STOP_TIMEOUT_S * 2)
        except Exception as exc:
            log.warning("bulk data listeners did not close cleanly: %r", exc)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def _close(self) -> None:
        if self._tcp_accepting is not None:  # no new connections while the old ones end
            self._tcp_accepting.cancel()
        for ep in list(self._endpoints):
            with contextlib.suppress(Exception):
                ep.abort()
        if self._handlers:
            _, pending = await asyncio.wait(list(self._handlers), timeout=_STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._tcp_accepting = None  # cancelled above
        if self._tcp_socket is not None:
            self._tcp_socket.close()
            self._tcp_socket = None

    # ---- connections -------------------------------------------------------------------------

    async def _accept_tcp(self, conn: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """Serve one accepted TCP connection: plaintext, or over TLS when this server has TLS
        and the client opens with a TLS handshake (a plaintext one is closed at once when TLS
        is required). A failed handshake ends only that connection."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            ctx = self._tls_context
            if ctx is None:
                ep: ByteStream = SocketEndpoint(conn, loop)
            else:
                first = await _first_byte(conn, loop)
                if first == TLS_HANDSHAKE_BYTE:
                    ep = await accept_tls(conn, ctx)
                elif self._tls is not None and self._tls.require:
                    log.warning("TCP data path: plaintext connection refused (TLS is required)")
                    conn.close()
                    return
                else:
                    ep = SocketEndpoint(conn, loop)
        except Exception as exc:  # handshake failed or timed out, the peer left
            log.warning("TCP data path: connection refused: %r", exc)
            conn.close()
            return
        finally:
            self._handlers.discard(task)
        await self._accept(ep)

    async def _accept(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._endpoints.add(ep)
        path = "tcp" if isinstance(ep, ByteStream) else "ucx"  # for the byte counters
        principal: Principal | None = None
        try:
            while True:
                if principal is None and not self._auth.open:  # HELLO comes at once, or never
                    frame, meta = await asyncio.wait_for(self._frame(ep), HELLO_TIMEOUT_S)
                else:
                    frame, meta = await self._frame(ep)
                if principal is None:
                    principal = await self._hello(ep, frame.kind, meta)
                    if principal is None:
                        return  # refused (and told so)
                    if frame.kind == KIND_HELLO:
                        continue
                if frame.kind == KIND_GET:
                    await self._get(ep, meta, path, principal)
                elif frame.kind == KIND_PUT:
                    await self._put(ep, frame.aux, meta, path, principal)
                else:
                    raise ProtocolError(f"unexpected UCX frame kind {frame.kind}")
        except ProtocolError as exc:
            log.warning("UCX connection closed: %s", exc)
        except Exception as exc:  # the peer went away (ucxx raises its own error classes)
            log.debug("UCX connection ended: %r", exc)
        finally:
            self._endpoints.discard(ep)
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                ep.abort()

    async def _frame(self, ep: Any) -> tuple[Frame, bytearray]:
        head = bytearray(PREAMBLE.size)
        await ep.recv(head)
        frame = parse_preamble(head, self._max_meta)
        return frame, await _recv_meta(ep, frame.meta_bytes)

    async def _hello(self, ep: Any, kind: int, meta: bytearray) -> Principal | None:
        """The principal of a connection whose first frame is `kind` (WELCOME sent for a HELLO),
        or None when it is refused (ERROR sent: the connection is to be closed)."""
        auth = self._auth
        if kind != KIND_HELLO:
            if auth.open:
                return OPEN  # an open daemon serves clients that send no HELLO
            auth.denied(None, "unauthenticated")
            await self._send_error(ep, Unauthenticated("the first frame must be HELLO"))
            return None
        try:
            principal = auth.authenticate(bytes(meta).decode("utf-8", "replace") or None)
        except Unauthenticated as exc:
            auth.denied(None, "unauthenticated")
            await self._send_error(ep, exc)
            return None
        await ep.send(preamble(KIND_WELCOME))
        return principal

    def _read_digest(self, principal: Principal, request: store_pb2.GetRequest) -> bytes:
        """The scope digest of a get after the principal's read check (as the gRPC Get)."""
        auth = self._auth
        if not request.scope:
            if not auth.open:
                raise InvalidArgument("this daemon checks namespaces: the request must carry scope")
            if len(request.scope_digest) != KEY_BYTES:
                raise InvalidArgument(f"scope digest must be {KEY_BYTES} bytes")
            return request.scope_digest
        digest, namespace = auth.scope_namespace(request.scope)
        if request.scope_digest and request.scope_digest != digest:
            auth.denied(principal, "scope_mismatch")
            raise InvalidArgument("scope_digest is not the digest of scope")
        if not auth.open:
            try:
                principal.check_read(namespace)
            except PermissionDenied:
                auth.denied(principal, "read")
                raise
        return digest

    def _check_write(self, principal: Principal, namespace: str, digest: bytes) -> None:
        auth = self._auth
        if auth.open:
            return
        try:
            principal.check_write(namespace)
        except PermissionDenied:
            auth.denied(principal, "write")
            raise
        auth.remember(digest, namespace)

    async def _send_error(self, ep: Any, exc: BaseException) -> None:
        if not isinstance(exc, StrataError):
            log.exception("UCX request failed", exc_info=exc)
        code, meta = encode_error(exc)
        await ep.send(preamble(KIND_ERROR, code, len(meta)))
        await ep.send(meta)

    # ---- get -------------------------------------------------------------------------------

    async def _get(self, ep: Any, meta: bytearray, path: str, principal: Principal) -> None:
        store = self._store
        try:
            try:
                request = store_pb2.GetRequest.FromString(bytes(meta))
            except DecodeError:
                raise InvalidArgument("malformed GetRequest") from None
            limit = store.config.limits.max_keys_per_call
            if len(request.keys) > limit * KEY_BYTES:  # refused before the keys are split
                raise InvalidArgument(
                    f"{len(request.keys) // KEY_BYTES} keys in one get; the limit is {limit}"
                )
            keys = unpack_keys(request.keys)
            digest = self._read_digest(principal, request)
            io = io_class_from_wire(request.io_class)
            acq = await self._call(io, store.acquire, digest, keys, io)
        except StrataError as exc:
            await self._send_error(ep, exc)
            return
        try:
            dram = store.tiers.dram
            entries: list[ManifestEntry] = []
            views: list[memoryview] = []
            for page in acq.pages:
                if page is None:
                    entries.append(ManifestEntry(b"", 0))
                    continue
                entries.append(ManifestEntry(page.header, page.length))
                if page.length:
                    views.append(dram.view(page.offset, page.length))
            manifest = encode_manifest(entries)
            total = sum(v.nbytes for v in views)
            admission = store.scheduler.admit(io, total)
            # The read fence of the daemon's own copy: the lease is renewed right after the
            # admission wait (in the same thread: an admitted operation never waits for a pool
            # thread while it holds its slot) and the whole send is bounded by half of it, so
            # no slot can be freed (and reused) while its bytes are still being sent.
            renewed = await self._call(io, _admit_and_renew, admission, store, acq.lease_id)
            try:
                if isinstance(renewed, StrataError):
                    await self._send_error(ep, renewed)
                    return
                await settle(
                    [
                        ep.send(preamble(KIND_MANIFEST, len(entries), len(manifest))),
                        ep.send(manifest),
                        *(ep.send(v) for v in views),
                    ],
                    self._get_timeout_s,
                    ep,
                )
            finally:
                admission.__exit__(None, None, None)
            if any(
                page is not None and dram.generation(page.offset) != page.generation
                for page in acq.pages
            ):  # not reached while the lease holds; if a clock jumped, end the connection
                with store.counters.lock:
                    store.counters.stale_fenced += 1
                raise ProtocolError("a page left its slot while being sent")
            store.counters.add_bytes(path, "out", io, total)
        finally:
            if acq.lease_id:
                await self._call(io, store.release, acq.lease_id)

    # ---- put -------------------------------------------------------------------------------

    async def _put(
        self, ep: Any, page_count: int, meta: bytearray, path: str, principal: Principal
    ) -> None:
        store = self._store
        limits = store.config.limits
        try:
            if page_count > limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{page_count} pages in one put; the limit is {limits.max_keys_per_call}"
                )
            raw_begin, headers = decode_put(meta, page_count)
            try:
                begin = store_pb2.PutBegin.FromString(raw_begin)
            except DecodeError:
                raise InvalidArgument("malformed PutBegin") from None
            if begin.page_count != page_count:
                raise InvalidArgument(
                    f"PutBegin announces {begin.page_count} pages, sent {page_count}"
                )
            scope = store.scope_of(begin.scope)
            self._check_write(principal, scope.namespace, scope.digest)
            io = io_class_from_wire(begin.io_class)
            tier = tier_from_wire(begin.tier)
            res = await self._call(
                io,
                functools.partial(
                    store.reserve,
                    scope,
                    headers,
                    self._reserve_ms,
                    io,
                    client=f"{path}:{id(ep)}",
                    chain_prefix=begin.chain_prefix,
                ),
            )
        except StrataError as exc:
            await self._send_error(ep, exc)
            return
        lease = res.lease_id
        try:
            want = bytes(1 if s.reserved else 0 for s in res.slots)
            await ep.send(preamble(KIND_WANT, page_count, len(want)))
            await ep.send(want)
            dram = store.tiers.dram
            views = [dram.view(s.offset, s.length) for s in res.slots if s.reserved and s.length]
            admission = store.scheduler.admit(io, sum(v.nbytes for v in views))
            await self._call(io, admission.__enter__)
            try:
                await settle([ep.recv(v) for v in views], self._put_timeout_s, ep)
            finally:
                admission.__exit__(None, None, None)
            try:
                await self._call(io, self._verify_and_commit, res, headers, tier, io, path)
                lease = 0  # committed: the lease has ended
            except StrataError as exc:
                await self._send_error(ep, exc)
                return
            statuses = bytes(
                store_pb2.PUT_STATUS_STORED
                if s.reserved
                else store_pb2.PUT_STATUS_PENDING
                if s.pending
                else store_pb2.PUT_STATUS_ALREADY_PRESENT
                for s in res.slots
            )
            await ep.send(preamble(KIND_DONE, page_count, len(statuses)))
            await ep.send(statuses)
        finally:
            if lease:
                await self._call(io, store.abort, lease)

    def _verify_and_commit(
        self,
        res: Reservation,
        headers: Sequence[bytes],
        tier: Tier | None,
        io: IoClass,
        path: str,
    ) -> int:
        """Check every received payload against its header; commit all or (raising) none."""
        store = self._store
        dram = store.tiers.dram
        bad: list[int] = []
        for i, slot in enumerate(res.slots):
            if not slot.reserved:
                continue
            try:
                PageHeader.decode(headers[i]).verify_payload(dram.view(slot.offset, slot.length))
            except Corrupt:
                bad.append(i)
        if bad:
            with store.counters.lock:
                store.counters.corrupt_dropped += len(bad)
            raise Corrupt(
                f"{len(bad)} page(s) failed the payload checksum after the network receive "
                f"(first: page {bad[0]}); nothing of this put was stored"
            )
        return store.commit(res.lease_id, tier, io, path=path)
