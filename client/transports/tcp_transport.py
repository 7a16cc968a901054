"""The SDK's end of the TCP data path (operations in client/transports/tcp_protocol.py), with two
drivers over the same operations:

- `TcpTransport`, blocking: the caller's own thread does the socket I/O (no event-loop hop):
  `sendmsg` straight from the caller's pages (one call for a frame and many payloads),
  `recv_into` straight into the caller's buffers. A few connections are kept alive for the
  next calls; concurrent calls each take a connection of their own. Over TLS the socket is an
  `ssl.SSLSocket` in the same thread (no scatter/gather there: a send per buffer).
- `AsyncTcpTransport`, asyncio: the same operations on the running loop, over the bulk
  endpoints of client/transports/tcp_endpoint.py (`loop.sock_sendall` / `sock_recv_into`, or a
  TLS layer over them).

Both raise the typed error the daemon answered (the connection is kept), DeadlineExceeded past
the call's deadline, and TransportFailed when the connection cannot be made or breaks (the
client then falls back to gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

from client.contract.errors import DeadlineExceeded, InvalidArgument, Unavailable
from client.contract.types import PutStatus
from client.transports.socket_io import NOWAIT, recv_some, remaining, wait_ready
from client.transports.tcp_endpoint import (
    TLS_HANDSHAKE_TIMEOUT_S,
    ByteStream,
    EndpointClosed,
    connect_tcp,
    connect_tls,
)
from client.transports.tcp_protocol import (
    GetOutcome,
    LookupHits,
    Recv,
    RemoteError,
    Send,
    Step,
    get_op,
    hello_op,
    lookup_op,
    put_op,
)
from client.transports.tls import TlsOptions
from client.transports.ucx_protocol import ProtocolError, parse_address

T = TypeVar("T")
Op = Generator[Step, None, T]

MAX_IDLE_CONNECTIONS = 8  # an idle TCP connection costs the daemon a parked thread, no CPU
CONNECT_TIMEOUT_S = 5.0
_SOCKET_BUFFER_BYTES = 4 << 20
_MAX_IOV = 512  # buffers per sendmsg (Linux allows 1024)
_TLS_JOIN_BYTES = 16 << 10  # a TLS record's most plaintext


class TransportFailed(Unavailable):
    """The bulk path itself failed (no listener, connection lost): use gRPC instead."""


class _Closed(Exception):
    """The connection ended under a call; `replied`: whether any of the answer had come."""

    def __init__(self, message: str, replied: bool) -> None:
        super().__init__(message)
        self.replied = replied


# ---- blocking driver -----------------------------------------------------------------------


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


# A client's receive that would block first polls for up to this long (non-blocking tries,
# yielding the CPU between them) before it sleeps in poll(): a reply that comes within it costs
# no wake-up by the kernel (the same measure as the lane's, client/transports/lane.py). The
# daemon's end polls for up to server.reply_poll_us after each answer (kvstore/tcp_server.py).
CLIENT_SPIN_S = 100e-6


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview], deadline: float) -> None:
    """Send every byte of `parts` on the blocking socket `sock` before `deadline`: one
    `sendmsg` for many buffers on a plain socket, a `sendall` per buffer over TLS."""
    if isinstance(sock, ssl.SSLSocket):  # small parts joined: one TLS record, not one each
        small = bytearray()
        for part in parts:
            if len(part) < _TLS_JOIN_BYTES:
                small += part
                continue
            if small:
                sock.settimeout(remaining(deadline))
                sock.sendall(small)
                small.clear()
            sock.settimeout(remaining(deadline))
            sock.sendall(part)
        if small:
            sock.settimeout(remaining(deadline))
            sock.sendall(small)
        return
    if len(parts) == 1:  # one buffer (a small request): a plain send, usually all at once
        part = parts[0]
        try:
            sent = sock.send(part, NOWAIT)
        except BlockingIOError:
            sent = 0
        if sent == len(part):
            return
        parts = (memoryview(part)[sent:],)
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    while pending:
        try:
            sent = sock.sendmsg(pending[:_MAX_IOV], (), NOWAIT)
        except BlockingIOError:
            wait_ready(sock, select.POLLOUT, deadline)
            continue
        while sent and pending:
            n = pending[0].nbytes
            if sent >= n:
                sent -= n
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0
        if pending and deadline != math.inf:
            remaining(deadline)  # a peer taking a trickle does not stretch the deadline


def recv_exact(sock: socket.socket, into: memoryview, deadline: float) -> int:
    """Fill `into` from `sock` before `deadline`; returns the bytes received before the peer
    closed (short of `into.nbytes` only then)."""
    view = into.cast("B") if into.format != "B" or into.ndim != 1 else into
    got, size = 0, view.nbytes
    while got < size:
        n = recv_some(sock, view[got:], deadline)
        if n == 0:
            return got
        got += n
    return got


def recv_many(sock: socket.socket, parts: Sequence[memoryview], deadline: float) -> int:
    """Fill each of `parts` in order from `sock` before `deadline`: on a plain socket one
    `recvmsg_into` scatters what has arrived over many of them. Returns the bytes received
    (short of their total only when the peer closed)."""
    if isinstance(sock, ssl.SSLSocket):
        got = 0
        for part in parts:
            n = recv_exact(sock, part, deadline)
            got += n
            if n < part.nbytes:
                break
        return got
    pending = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
    got = 0
    while pending:
        try:
            n, _, _, _ = sock.recvmsg_into(pending[:_MAX_IOV], 0, NOWAIT)
        except BlockingIOError:
            wait_ready(sock, select.POLLIN, deadline)
            continue
        if n == 0:
            return got
        got += n
        while n and pending:
            size = pending[0].nbytes
            if n >= size:
                n -= size
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
        if pending and deadline != math.inf:
            remaining(deadline)
    return got


READ_AHEAD_BYTES = 64 << 10


class SocketReader:
    """The receiving side of one blocking socket, through a small read-ahead buffer: a frame's
    preamble, its meta and small payloads that arrived together come in with one receive;
    what is left of a large receive goes straight into its buffers (`recv_many`). Bytes read
    ahead stay here for the next receive on the same connection."""

    __slots__ = ("_end", "_sock", "_spin_s", "_start", "_view")

    def __init__(self, sock: socket.socket, spin_s: float = 0.0) -> None:
        self._sock = sock
        self._spin_s = spin_s  # see recv_some
        self._view = memoryview(bytearray(READ_AHEAD_BYTES))
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet."""
        return self._end - self._start

    def fill(self, parts: Sequence[memoryview], deadline: float) -> int:
        """Fill each of `parts` in order before `deadline`; returns the bytes handed out (short
        of their total only when the peer closed)."""
        pending = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
        got = self._take(pending)
        while pending:
            left = sum(p.nbytes for p in pending)
            if left >= READ_AHEAD_BYTES:
                return got + recv_many(self._sock, pending, deadline)
            n = recv_some(self._sock, self._view, deadline, self._spin_s)
            if n == 0:
                return got
            self._start, self._end = 0, n
            got += self._take(pending)
        return got

    def fill_one(self, into: memoryview, deadline: float) -> int:
        """`fill((into,), deadline)`, for a byte view (a frame's preamble or meta): taken
        from the buffer with one copy when it is all there already."""
        start, size = self._start, into.nbytes
        if self._end - start < size or into.format != "B" or into.ndim != 1:
            return self.fill((into,), deadline)
        into[:] = self._view[start : start + size]
        self._start = start + size
        if self._start == self._end:
            self._start = self._end = 0
        return size

    def _take(self, pending: list[memoryview]) -> int:
        """Hand buffered bytes out to `pending` (consumed from the front); the count."""
        got = 0
        while pending and self._start < self._end:
            part = pending[0]
            n = min(part.nbytes, self._end - self._start)
            part[:n] = self._view[self._start : self._start + n]
            self._start += n
            got += n
            if n == part.nbytes:
                pending.pop(0)
            else:
                pending[0] = part[n:]
        if self._start == self._end:
            self._start = self._end = 0
        return got


def drive(sock: socket.socket, reader: SocketReader, op: Op[T], deadline: float) -> T:
    """Run the operation `op` on the blocking socket `sock` (received through `reader`).
    Raises what `op` raises, _Closed when the peer ends the connection, TimeoutError past
    `deadline`, OSError."""
    replied = False
    try:
        step = next(op)
        while True:
            if isinstance(step, Send):
                try:
                    send_parts(sock, step.parts, deadline)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    raise _Closed(f"TCP send failed: {exc}", replied) from None
            elif isinstance(step, Recv):
                try:
                    got = reader.fill_one(step.into, deadline)
                except ConnectionResetError as exc:
                    raise _Closed(f"TCP receive failed: {exc}", replied) from None
                if got < step.into.nbytes:
                    raise _Closed("the daemon closed the TCP connection", replied or got > 0)
                replied = True
            else:
                try:
                    got = reader.fill(step.parts, deadline)
                except ConnectionResetError as exc:
                    raise _Closed(f"TCP receive failed: {exc}", replied) from None
                if got < sum(p.nbytes for p in step.parts):
                    raise _Closed("the daemon closed the TCP connection", replied or got > 0)
                replied = True
            step = op.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        op.close()


class Connection:
    """One connected blocking socket (plain or TLS) and its reader."""

    __slots__ = ("reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = SocketReader(sock, CLIENT_SPIN_S)

    def idle_ok(self) -> bool:
        """Whether a kept connection is in step: nothing read ahead may be left over. (One the
        daemon closed meanwhile shows at its next call, before any answer: the call then goes
        on over another connection, see `TcpTransport._call`.)"""
        return not self.reader.buffered

    def close(self) -> None:
        self.sock.close()


class TcpTransport:
    """Blocking calls to the daemon's TCP data path at `address` ("tcp://host:port"), made in
    the caller's thread. Thread-safe: each call takes a connection of its own (a kept one, or
    a new one: connect, TLS handshake when `tls`, HELLO with `token`). `open()` makes the first
    connection (TransportFailed if it cannot); `close()` drops every kept one."""

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
        try:
            self._host, self._port = parse_address(address, fallback_host)
        except InvalidArgument as exc:
            raise TransportFailed(str(exc)) from None
        self._hello = (token or "").encode()
        self._max_page_bytes = max_page_bytes or (1 << 62)
        self._tls = tls
        self._ssl = tls.ssl_context() if tls is not None else None
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self, timeout_s: float) -> None:
        self._keep(self._connect(time.monotonic() + min(timeout_s, CONNECT_TIMEOUT_S)))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

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
        """Get the pages of the serialized GetRequest `request` (for `keys`) into `into`, one
        round trip (tcp_protocol.get_op says what is checked)."""
        return self._call(
            lambda: get_op(
                request,
                scope_digest,
                keys,
                into,
                verify=verify,
                max_page_bytes=self._max_page_bytes,
            ),
            timeout_s,
        )

    def put(
        self,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        timeout_s: float,
    ) -> tuple[PutStatus, ...]:
        """Put pages (`begin` a serialized PutBegin, each page's header and payload) in one
        round trip; the daemon verifies every payload and stores all it lacks, or none."""
        return self._call(lambda: put_op(begin, headers, payloads), timeout_s)

    def lookup(self, request: bytes, asked: int, *, timeout_s: float) -> LookupHits:
        """The hits of the serialized LookupRequest `request` (of `asked` keys)."""
        return self._call(lambda: lookup_op(request, asked), timeout_s)

    # ---- plumbing --------------------------------------------------------------------------

    def _call(self, make: Callable[[], Op[T]], timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        for _ in range(
            MAX_IDLE_CONNECTIONS + 1
        ):  # kept connections the daemon closed, then a new one
            conn, kept = self._take(deadline)
            try:
                result: T = drive(conn.sock, conn.reader, make(), deadline)
            except RemoteError as remote:
                self._keep(conn)
                raise remote.error from None
            except _Closed as exc:
                conn.close()
                if kept and not exc.replied:  # the daemon closed it before this call: again
                    continue
                raise TransportFailed(f"transfer with {self.address} failed: {exc}") from None
            except TimeoutError:
                conn.close()
                raise DeadlineExceeded("TCP call did not complete within its deadline") from None
            except ProtocolError:
                conn.close()
                raise
            except OSError as exc:
                conn.close()
                raise TransportFailed(f"transfer with {self.address} failed: {exc!r}") from None
            except BaseException:
                conn.close()
                raise
            self._keep(conn)
            return result
        raise TransportFailed(f"no usable connection to {self.address}")

    def _take(self, deadline: float) -> tuple[Connection, bool]:
        with self._lock:
            if self._closed:
                raise TransportFailed("the TCP transport is closed")
            while self._idle:
                conn = self._idle.pop()
                if conn.idle_ok():
                    return conn, True
                conn.close()
        return self._connect(min(deadline, time.monotonic() + CONNECT_TIMEOUT_S)), False

    def _keep(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self, deadline: float) -> Connection:
        try:
            sock = socket.create_connection(
                (self._host, self._port), timeout=max(deadline - time.monotonic(), 0.001)
            )
        except OSError as exc:
            raise TransportFailed(f"cannot connect to {self.address}: {exc!r}") from None
        try:
            _tune(sock)
            if self._ssl is None:
                sock.settimeout(None)  # blocking; each call bounds its waits (see _wait)
            else:
                name = (self._tls.server_name if self._tls else "") or self._host
                sock.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
                sock = self._ssl.wrap_socket(sock, server_hostname=name)
            conn = Connection(sock)
            drive(conn.sock, conn.reader, hello_op(self._hello), deadline)
        except RemoteError as remote:  # refused (Unauthenticated): no fall back
            sock.close()
            raise remote.error from None
        except (OSError, _Closed, ProtocolError, ssl.SSLError) as exc:
            sock.close()
            raise TransportFailed(f"no HELLO answer from {self.address}: {exc!r}") from None
        except BaseException:
            sock.close()
            raise
        return conn


# ---- asyncio driver ------------------------------------------------------------------------


async def drive_async(ep: ByteStream, op: Op[T]) -> T:
    """Run the operation `op` over the bulk endpoint `ep` on the running loop. Raises what `op`
    raises, and EndpointClosed (client/transports/tcp_endpoint.py) when the connection ends."""
    try:
        step = next(op)
        while True:
            if isinstance(step, Send):
                for part in step.parts:
                    if len(part):
                        await ep.send(part)
            elif isinstance(step, Recv):
                await ep.recv(step.into)
            else:
                for view in step.parts:
                    await ep.recv(view)
            step = op.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        op.close()


class AsyncTcpTransport:
    """The TCP data path for asyncio callers: the calls of `TcpTransport`, as coroutines on the
    loop that first uses it (its connections belong to that loop). Concurrent calls each take
    a connection of their own; a few are kept for the next calls."""

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
        try:
            self._host, self._port = parse_address(address, fallback_host)
        except InvalidArgument as exc:
            raise TransportFailed(str(exc)) from None
        self._hello = (token or "").encode()
        self._max_page_bytes = max_page_bytes or (1 << 62)
        self._tls = tls
        self._ssl = tls.ssl_context() if tls is not None else None
        self._idle: list[ByteStream] = []
        self._closed = False

    async def open(self, timeout_s: float) -> None:
        self._keep(await self._connect(min(timeout_s, CONNECT_TIMEOUT_S)))

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for ep in idle:
            ep.abort()

    async def get(
        self,
        request: bytes,
        scope_digest: bytes,
        keys: Sequence[bytes],
        into: Sequence[memoryview],
        *,
        verify: bool,
        timeout_s: float,
    ) -> GetOutcome:
        return await self._call(
            lambda: get_op(
                request,
                scope_digest,
                keys,
                into,
                verify=verify,
                max_page_bytes=self._max_page_bytes,
            ),
            timeout_s,
        )

    async def put(
        self,
        begin: bytes,
        headers: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        timeout_s: float,
    ) -> tuple[PutStatus, ...]:
        return await self._call(lambda: put_op(begin, headers, payloads), timeout_s)

    async def lookup(self, request: bytes, asked: int, *, timeout_s: float) -> LookupHits:
        return await self._call(lambda: lookup_op(request, asked), timeout_s)

    async def _call(self, make: Callable[[], Op[T]], timeout_s: float) -> T:
        if self._closed:
            raise TransportFailed("the TCP transport is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s  # one deadline for the call, whatever it resends
        for _ in range(MAX_IDLE_CONNECTIONS + 1):  # kept connections the daemon closed, then a new one
            fresh = not self._idle
            if fresh:
                left = max(deadline - loop.time(), 0.001)
                ep = await self._connect(min(left, CONNECT_TIMEOUT_S))
            else:
                ep = self._idle.pop()
            before = ep.received
            try:
                result: T = await asyncio.wait_for(
                    drive_async(ep, make()), max(deadline - loop.time(), 0.001)
                )
            except RemoteError as remote:
                self._keep(ep)
                raise remote.error from None
            except EndpointClosed as exc:
                ep.abort()
                if not fresh and ep.received == before:
                    continue  # a kept connection the daemon closed before this call: again
                # a fresh connection, or one that ended part-way through the reply: a put may
                # have landed, so it is not sent again here (the caller's fallback decides)
                raise TransportFailed(f"transfer with {self.address} failed: {exc}") from None
            except TimeoutError:
                ep.abort()
                raise DeadlineExceeded("TCP call did not complete within its deadline") from None
            except BaseException:
                ep.abort()
                raise
            self._keep(ep)
            return result
        raise TransportFailed(f"no usable connection to {self.address}")

    def _keep(self, ep: ByteStream) -> None:
        if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(ep)
        else:
            ep.abort()

    async def _connect(self, timeout_s: float) -> ByteStream:
        try:
            if self._ssl is not None:
                name = self._tls.server_name if self._tls else ""
                ep: ByteStream = await asyncio.wait_for(
                    connect_tls(self._host, self._port, self._ssl, name), timeout_s
                )
            else:
                ep = await asyncio.wait_for(connect_tcp(self._host, self._port), timeout_s)
        except (OSError, TimeoutError, ssl.SSLError, Unavailable) as exc:
            raise TransportFailed(f"cannot connect to {self.address}: {exc!r}") from None
        try:
            await asyncio.wait_for(drive_async(ep, hello_op(self._hello)), timeout_s)
        except RemoteError as remote:
            ep.abort()
            raise remote.error from None
        except BaseException as exc:
            ep.abort()
            if isinstance(exc, (OSError, TimeoutError, Unavailable)):
                raise TransportFailed(f"no HELLO answer from {self.address}: {exc!r}") from None
            raise
        return ep
