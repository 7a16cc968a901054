"""The SDK's end of the UCX bulk data path (DESIGN §6; framing in client/transports/ucx_protocol.py).

`UcxTransport` is one bulk data path to a daemon. Over UCX ("ucx://...") it is a blocking facade
over ucxx: every call runs as a coroutine on the process's bulk loop
(client/transports/ucx_runtime.py), each on an endpoint of its own (a fresh one per call, see
_MAX_IDLE_UCX_ENDPOINTS), so concurrent calls never share one; `get_async`/`put_async` are the
same calls awaitable from any event loop. Over TCP ("tcp://...") it hands every call to
`TcpTransport` (client/transports/tcp_transport.py: the caller's own thread does the socket
I/O, one round trip per call). Payloads are received straight into the caller's buffers and
sent straight from the caller's pages, with no copy made here. A get verifies each page's
header and (when asked) checksum, as the gRPC path does.

`UcxLink` is one StoreClient's choice of this path: used when ucxx imports and the daemon
advertises a listener that answers; otherwise (or after a transport failure) the client stays
on gRPC and says so once in the log. `ucxx` is imported lazily, never at module import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from client.contract.errors import (
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    StrataError,
    Unavailable,
)
from client.contract.page import PageHeader
from client.contract.types import PutStatus
from client.transports.tcp_protocol import GetOutcome, LookupHits, accept_entry
from client.transports.tcp_transport import AsyncTcpTransport, TcpTransport
from client.transports.tcp_transport import TransportFailed as TransportFailed
from client.transports.tls import TlsOptions
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
    ProtocolError,
    decode_error,
    decode_manifest,
    encode_put,
    fabric_configured,
    parse_address,
    parse_preamble,
    preamble,
    settle,
)
from client.transports.ucx_runtime import ucx_runtime

log = logging.getLogger(__name__)

T = TypeVar("T")
# No endpoint is kept between calls: while a connection is open the daemon has a receive posted,
# and ucxx 0.52 keeps a daemon core busy progressing it even when nothing arrives (measured: an
# idle connected client cost 100% of a core; one endpoint per call costs none, at the same
# throughput for bulk transfers).
_MAX_IDLE_UCX_ENDPOINTS = 0
_CONNECT_TIMEOUT_S = 5.0
_MAX_META_BYTES = 1 << 30


class _RemoteError(Exception):
    """A typed error the daemon answered; the endpoint is still in step and reusable."""

    def __init__(self, error: StrataError) -> None:
        super().__init__(str(error))
        self.error = error


def ucxx_installed() -> bool:
    """Whether the ucxx package is there to import (without importing it)."""
    return importlib.util.find_spec("ucxx") is not None


# ---- transport -------------------------------------------------------------------------------


class UcxTransport:
    """Blocking calls to the daemon's bulk data path at `address` ("ucx://host:port", or
    "tcp://host:port": handed to `TcpTransport`).

    `open()` connects one endpoint (TransportFailed if it cannot); `get`/`put` raise the typed
    error the daemon answered, DeadlineExceeded after `timeout_s`, TransportFailed when the
    connection breaks. Thread-safe. `close()` drops every endpoint. `lookup` is served over
    TCP only (TransportFailed over UCX: use gRPC).
    """

    def __init__(
        self,
        address: str,
        *,
        fallback_host: str = "",
        max_page_bytes: int = 0,
        tls: TlsOptions | None = None,
        token: str | None = None,
    ) -> None:
        self.address = address
        self._tcp: TcpTransport | None = None
        self._async_tcp: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncTcpTransport] = (
            weakref.WeakKeyDictionary()
        )
        self._async_lock = threading.Lock()
        self._tcp_args: dict[str, Any] = {
            "fallback_host": fallback_host,
            "max_page_bytes": max_page_bytes,
            "tls": tls,
            "token": token,
        }
        if address.startswith(TCP_SCHEME):
            self._tcp = TcpTransport(address, **self._tcp_args)
            return
        self._hello = (token or "").encode()
        try:
            self._host, self._port = parse_address(address, fallback_host)
        except InvalidArgument as exc:
            raise TransportFailed(str(exc)) from None
        self._max_page_bytes = max_page_bytes or (1 << 62)
        if tls is not None:
            raise TransportFailed("the UCX data path cannot be encrypted (this client uses TLS)")
        try:
            self._ucxx, self._loop = ucx_runtime()
        except Unavailable as exc:
            raise TransportFailed(str(exc)) from None
        self._max_idle = _MAX_IDLE_UCX_ENDPOINTS
        self._idle: list[Any] = []  # touched on the loop only
        self._closed = False

    @property
    def tcp(self) -> TcpTransport | None:
        """The TCP transport this hands its calls to (None over UCX)."""
        return self._tcp

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self, timeout_s: float) -> None:
        if self._tcp is not None:
            self._tcp.open(timeout_s)
            return

        async def probe() -> None:
            ep = await self._connect(min(timeout_s, _CONNECT_TIMEOUT_S))
            if self._max_idle:
                self._idle.append(ep)
            else:
                with contextlib.suppress(Exception):
                    ep.abort()

        self._run(probe(), timeout_s)

    def close(self) -> None:
        with self._async_lock:
            loops, self._async_tcp = list(self._async_tcp.values()), weakref.WeakKeyDictionary()
        for transport in loops:
            transport.close()  # (aborting an endpoint is safe from any thread)
        if self._tcp is not None:
            self._tcp.close()
            return
        if self._closed:
            return
        self._closed = True

        async def drop() -> None:
            idle, self._idle = self._idle, []
            for ep in idle:
                with contextlib.suppress(Exception):
                    ep.abort()

        with contextlib.suppress(Exception):
            self._run(drop(), _CONNECT_TIMEOUT_S)

    # ---- calls -----------------------------------------------------------------------------

    def get(
        self,
        request: bytes,
        scope_digest: bytes,
        keys: Sequence[bytes],
        into: Sequence[memoryview],
        *,
        verify: bool,
        timeout_s: float,
    ) -> GetOutcome:
        """Get the pages of the serialized GetRequest `request` (for `keys`) into `into`.

        Each delivered page's header is checked (key, scope, size) before its payload is received
        straight into its buffer; with `verify` its checksum is checked after. A page failing
        either is a miss, counted in `corrupt`; its buffer's contents are then unspecified.
        """
        if self._tcp is not None:
            return self._tcp.get(
                request, scope_digest, keys, into, verify=verify, timeout_s=timeout_s
            )
        self._check_open()
        return self._run(
            self._get_coro(request, scope_digest, keys, into, verify, timeout_s), timeout_s
        )

    def put(
        self,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        timeout_s: float,
    ) -> tuple[PutStatus, ...]:
        """Put pages: `begin` a serialized PutBegin, then each page's header and payload. The
        daemon verifies every payload and stores all the pages it lacks, or none (raising)."""
        if self._tcp is not None:
            return self._tcp.put(begin, headers, payloads, timeout_s=timeout_s)
        self._check_open()
        return self._run(self._put_coro(begin, headers, payloads, timeout_s), timeout_s)

    def lookup(self, request: bytes, asked: int, *, timeout_s: float) -> LookupHits:
        """The hits of the serialized LookupRequest `request` (of `asked` keys), over TCP."""
        if self._tcp is None:
            raise TransportFailed("lookups go over gRPC on the UCX data path")
        return self._tcp.lookup(request, asked, timeout_s=timeout_s)

    # ---- the same calls for asyncio callers (any event loop) ----------------------------------

    async def get_async(
        self,
        request: bytes,
        scope_digest: bytes,
        keys: Sequence[bytes],
        into: Sequence[memoryview],
        *,
        verify: bool,
        timeout_s: float,
    ) -> GetOutcome:
        """`get`, awaitable from any event loop: over TCP on that loop itself
        (`AsyncTcpTransport`), over UCX on the bulk loop."""
        if self._tcp is not None:
            return await self._loop_tcp().get(
                request, scope_digest, keys, into, verify=verify, timeout_s=timeout_s
            )
        self._check_open()
        coro = self._get_coro(request, scope_digest, keys, into, verify, timeout_s)
        return await self._run_async(coro, timeout_s)

    async def put_async(
        self,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        timeout_s: float,
    ) -> tuple[PutStatus, ...]:
        """`put`, awaitable from any event loop (as `get_async`)."""
        if self._tcp is not None:
            return await self._loop_tcp().put(begin, headers, payloads, timeout_s=timeout_s)
        self._check_open()
        return await self._run_async(self._put_coro(begin, headers, payloads, timeout_s), timeout_s)

    async def lookup_async(self, request: bytes, asked: int, *, timeout_s: float) -> LookupHits:
        """`lookup`, awaitable from any event loop (TCP only, as `lookup`)."""
        if self._tcp is None:
            raise TransportFailed("lookups go over gRPC on the UCX data path")
        return await self._loop_tcp().lookup(request, asked, timeout_s=timeout_s)

    def _loop_tcp(self) -> AsyncTcpTransport:
        """The asyncio TCP transport of the running loop (its connections are that loop's)."""
        loop = asyncio.get_running_loop()
        with self._async_lock:
            transport = self._async_tcp.get(loop)
            if transport is None:
                transport = AsyncTcpTransport(self.address, **self._tcp_args)
                self._async_tcp[loop] = transport
            return transport

    # ---- plumbing --------------------------------------------------------------------------

    async def _get_coro(
        self,
        request: bytes,
        scope_digest: bytes,
        keys: Sequence[bytes],
        into: Sequence[memoryview],
        verify: bool,
        timeout_s: float,
    ) -> GetOutcome:
        deadline = time.monotonic() + timeout_s
        headers, corrupt = await self._call(
            lambda ep: self._get(ep, request, scope_digest, keys, into, deadline)
        )
        if verify:
            for i, header in enumerate(headers):
                if header is None:
                    continue
                try:
                    header.verify_payload(into[i][: header.payload_bytes])
                except Corrupt as exc:
                    log.debug("ucx get: page %d dropped: %s", i, exc)
                    headers[i] = None
                    corrupt += 1
        return GetOutcome(tuple(headers), corrupt)

    async def _put_coro(
        self,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        timeout_s: float,
    ) -> tuple[PutStatus, ...]:
        deadline = time.monotonic() + timeout_s
        return await self._call(lambda ep: self._put(ep, begin, headers, payloads, deadline))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportFailed("the UCX transport is closed")

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # the coroutine keeps its own deadline and cleans up after it; this is a backstop
            return future.result(timeout_s + 2 * _CONNECT_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise TransportFailed(f"the UCX loop did not answer within {timeout_s:.1f} s") from None

    async def _run_async(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))
        try:
            return await asyncio.wait_for(future, timeout_s + 2 * _CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise TransportFailed(f"the UCX loop did not answer within {timeout_s:.1f} s") from None

    async def _connect(self, timeout_s: float) -> Any:
        try:
            ep = await asyncio.wait_for(
                self._ucxx.create_endpoint(self._host, self._port), max(timeout_s, 0.001)
            )
        except Exception as exc:
            raise TransportFailed(f"cannot connect to {self.address}: {exc!r}") from None
        try:
            await self._greet(ep, time.monotonic() + max(timeout_s, 0.001))
        except BaseException:
            with contextlib.suppress(Exception):
                ep.abort()
            raise
        return ep

    async def _greet(self, ep: Any, deadline: float) -> None:
        """The connection's HELLO (this client's token) and the daemon's WELCOME; the typed
        error (Unauthenticated) when it refuses, TransportFailed when the connection fails."""
        try:
            await self._send(ep, preamble(KIND_HELLO, 0, len(self._hello)), deadline)
            if self._hello:
                await self._send(ep, self._hello, deadline)
            kind, _, _ = await self._recv_frame(ep, deadline)
        except _RemoteError as remote:  # refused: the daemon's typed error, no fall back
            raise remote.error from None
        except Exception as exc:
            raise TransportFailed(f"no HELLO answer from {self.address}: {exc!r}") from None
        if kind != KIND_WELCOME:
            raise TransportFailed(f"{self.address} answered HELLO with frame {kind}")

    async def _call(self, op: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        if self._idle:  # (none are kept over UCX: _MAX_IDLE_UCX_ENDPOINTS)
            return await self._call_on(self._idle.pop(), op)
        return await self._call_on(await self._connect(_CONNECT_TIMEOUT_S), op)

    async def _call_on(self, ep: Any, op: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        reusable = False
        try:
            result = await op(ep)
            reusable = True
            return result
        except _RemoteError as remote:
            reusable = True
            raise remote.error from None
        except StrataError:
            raise
        except Exception as exc:  # ucxx's own errors: the connection is gone
            raise TransportFailed(f"UCX transfer with {self.address} failed: {exc!r}") from None
        finally:
            if reusable and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(ep)
            else:
                with contextlib.suppress(Exception):
                    ep.abort()

    async def _send(self, ep: Any, data: bytes, deadline: float) -> None:
        await self._within(ep.send(data), deadline)

    async def _recv_frame(self, ep: Any, deadline: float) -> tuple[int, int, bytearray]:
        head = bytearray(PREAMBLE.size)
        await self._within(ep.recv(head), deadline)
        frame = parse_preamble(head, _MAX_META_BYTES)
        meta = bytearray(frame.meta_bytes)
        if frame.meta_bytes:
            await self._within(ep.recv(meta), deadline)
        if frame.kind == KIND_ERROR:
            raise _RemoteError(decode_error(frame.aux, meta))
        return frame.kind, frame.aux, meta

    @staticmethod
    async def _within(aw: Coroutine[Any, Any, object], deadline: float) -> None:
        try:
            await asyncio.wait_for(aw, max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise DeadlineExceeded("UCX call did not complete within its deadline") from None

    async def _get(
        self,
        ep: Any,
        request: bytes,
        scope_digest: bytes,
        keys: Sequence[bytes],
        into: Sequence[memoryview],
        deadline: float,
    ) -> tuple[list[PageHeader | None], int]:
        await self._send(ep, preamble(KIND_GET, 0, len(request)), deadline)
        await self._send(ep, request, deadline)
        kind, aux, meta = await self._recv_frame(ep, deadline)
        if kind != KIND_MANIFEST or aux != len(keys):
            raise ProtocolError(f"expected a manifest of {len(keys)} pages, got frame {kind}/{aux}")
        entries = decode_manifest(meta, len(keys))
        headers: list[PageHeader | None] = [None] * len(keys)
        targets: list[memoryview | bytearray] = []
        corrupt = 0
        for i, entry in enumerate(entries):
            if not entry.present:
                continue
            if entry.payload_bytes > self._max_page_bytes:
                raise ProtocolError(f"page {i}: {entry.payload_bytes} bytes exceeds the page limit")
            header = accept_entry(entry, keys[i], scope_digest, into[i])
            if header is None:
                corrupt += 1
                if entry.payload_bytes:
                    targets.append(bytearray(entry.payload_bytes))  # received and dropped
                continue
            headers[i] = header
            if entry.payload_bytes:
                targets.append(into[i][: entry.payload_bytes])
        await settle([ep.recv(t) for t in targets], deadline - time.monotonic(), ep)
        return headers, corrupt

    async def _put(
        self,
        ep: Any,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        deadline: float,
    ) -> tuple[PutStatus, ...]:
        count = len(headers)
        meta = encode_put(begin, headers)
        await self._send(ep, preamble(KIND_PUT, count, len(meta)), deadline)
        await self._send(ep, meta, deadline)
        kind, aux, want = await self._recv_frame(ep, deadline)
        if kind != KIND_WANT or aux != count or len(want) != count:
            raise ProtocolError(f"expected a want list of {count} pages, got frame {kind}/{aux}")
        wanted = [payloads[i] for i in range(count) if want[i] and payloads[i].nbytes]
        await settle([ep.send(v) for v in wanted], deadline - time.monotonic(), ep)
        kind, aux, statuses = await self._recv_frame(ep, deadline)
        if kind != KIND_DONE or aux != count or len(statuses) != count:
            raise ProtocolError(f"expected {count} put statuses, got frame {kind}/{aux}")
        try:
            return tuple(PutStatus(s) for s in statuses)
        except ValueError:
            raise ProtocolError("unknown put status in a UCX reply") from None


# ---- one client's choice -------------------------------------------------------------------


class UcxLink:
    """Which bulk data path one StoreClient's remote calls take: UCX, TCP or (None) gRPC streams.

    `ucx` and `tcp` are the client's modes: True requires that path (Unavailable when it cannot
    be used), False never uses it, None uses it when possible. With both on auto, UCX is chosen
    when the environment configures a fabric for it (see `fabric_configured`); otherwise TCP
    (over plain TCP, UCX adds nothing and measures slower); otherwise UCX if it is the only one;
    otherwise gRPC. A transport failure sends the client to gRPC for good (said once in the log,
    as is the first choice). With `tls` the TCP data path goes over TLS and UCX (which cannot be
    encrypted) is never chosen: required, it is Unavailable. Thread-safe.
    """

    def __init__(
        self,
        mode: bool | None,
        grpc_address: str,
        tcp: bool | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
    ) -> None:
        self.mode = mode
        self.tcp_mode = tcp
        self._tls = tls
        self._token = token
        host, sep, _ = grpc_address.rpartition(":")
        self._grpc_host = host.strip("[]") if sep and not grpc_address.startswith("unix:") else ""
        self._lock = threading.Lock()
        self._key: object = None
        self._transport: UcxTransport | None = None
        self._given_up = mode is False and tcp is False

    @property
    def off(self) -> bool:
        """True when this client never uses a bulk path (both modes False, or given up)."""
        return self._given_up

    def transport(
        self,
        key: object,
        address: str,
        *,
        timeout_s: float,
        max_page_bytes: int,
        tcp_address: str = "",
    ) -> UcxTransport | None:
        """The transport for the connection `key` to a daemon advertising `address` ("ucx://...",
        "" for none) and `tcp_address` ("tcp://...", "" for none), opened on first use; None:
        use gRPC."""
        with self._lock:
            if self._given_up:
                return None
            if self._key is key and self._transport is not None:
                return self._transport
            old, self._transport, self._key = self._transport, None, key
            if old is not None:
                old.close()
            try:
                chosen = self._choose(address, tcp_address)
                transport = UcxTransport(
                    chosen,
                    fallback_host=self._grpc_host,
                    max_page_bytes=max_page_bytes,
                    tls=self._tls,
                    token=self._token,
                )
                try:
                    transport.open(timeout_s)
                except BaseException:
                    transport.close()
                    raise
            except TransportFailed as exc:
                self._give_up_locked(exc, logging.INFO)
                return None
            self._transport = transport
            log.info("bulk data path to %s", chosen)
            return transport

    def _choose(self, ucx_address: str, tcp_address: str) -> str:
        """The address to use; TransportFailed when none (or not the one required)."""
        encrypted = self._tls is not None
        ucx_usable = (
            self.mode is not False and bool(ucx_address) and ucxx_installed() and not encrypted
        )
        tcp_usable = self.tcp_mode is not False and bool(tcp_address)
        if self.mode is True:
            if encrypted:
                raise TransportFailed(
                    "the UCX data path cannot be encrypted (this client uses TLS)"
                )
            if not ucxx_installed():
                raise TransportFailed("ucxx is not installed (the `ucx` extra)")
            if not ucx_address:
                raise TransportFailed("the store has no UCX listener")
            return ucx_address
        if self.tcp_mode is True:
            if not tcp_address:
                raise TransportFailed("the store has no TCP data listener")
            return tcp_address
        if ucx_usable and (fabric_configured() or not tcp_usable):
            return ucx_address
        if tcp_usable:
            return tcp_address
        if self.mode is not False and ucx_address and not encrypted:
            raise TransportFailed("ucxx is not installed (the `ucx` extra)")
        raise TransportFailed("the store has no bulk data listener")

    def give_up(self, exc: TransportFailed) -> None:
        """Stop using the bulk path for this client (raises `exc` when it was required)."""
        with self._lock:
            transport, self._transport = self._transport, None
            if transport is not None:
                transport.close()
            self._give_up_locked(exc, logging.WARNING)

    def close(self) -> None:
        with self._lock:
            transport, self._transport = self._transport, None
            self._given_up = True
        if transport is not None:
            transport.close()

    def _give_up_locked(self, exc: TransportFailed, level: int) -> None:
        if self.mode is True:
            raise Unavailable(f"UCX was required but cannot be used: {exc}") from exc
        if self.tcp_mode is True:
            raise Unavailable(f"the TCP data path was required but cannot be used: {exc}") from exc
        if not self._given_up:
            log.log(level, "bulk data path not used (%s); this client uses gRPC", exc)
        self._given_up = True
