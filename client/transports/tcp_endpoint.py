"""A TCP socket as a bulk-path endpoint on an event loop: what the asyncio driver of the TCP data
path (client/transports/tcp_transport.py `AsyncTcpTransport`) runs its operations over.

`SocketEndpoint` gives a non-blocking socket the three operations the bulk code uses on a ucxx
endpoint, on the caller's event loop: `send(buffer)`, `recv(buffer)`
(fills the whole buffer, straight from the kernel, no copy in between) and `abort()`. A UCX
endpoint keeps messages in the order they were posted; so does this one: sends, and receives,
complete one after another in the order they were started, however many are in flight.

`TlsEndpoint` is the same three operations over a TLS connection on such a socket: the bytes
are encrypted, so each send and receive passes through the TLS layer (memory buffers, then the
caller's buffer). Both are `ByteStream`s: the framing arrives as a byte stream, not as messages.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import ssl
from typing import Any, cast

from client.contract.errors import Unavailable

_SOCKET_BUFFER_BYTES = 4 << 20  # a few 1 MiB pages in flight per direction
_TLS_STEP_BYTES = 1 << 20  # TLS sends are encrypted, and receives read off the socket, in steps
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class EndpointClosed(Unavailable):
    """The peer closed the connection, or it was aborted."""


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on the small framing messages, roomy kernel buffers."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # capped by the kernel's limits: keep its size
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


class ByteStream(abc.ABC):
    """A bulk-path endpoint over a byte stream (TCP, plain or TLS). `received` counts the bytes
    `recv` has delivered so far, so a caller can tell a connection that ended before any reply
    (safe to send the call again) from one that ended part-way through it."""

    received: int = 0

    @abc.abstractmethod
    async def send(self, data: Any) -> None:
        """Send all of `data` (bytes-like); EndpointClosed when the connection is gone."""

    @abc.abstractmethod
    async def recv(self, into: Any) -> None:
        """Fill all of `into` (writable bytes-like); EndpointClosed when the connection is gone."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End the connection; idempotent, from any thread."""


class SocketEndpoint(ByteStream):
    """One connected TCP socket, used from one event loop. `abort()` may come from any thread."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        tune_socket(sock)
        self._sock = sock
        self._loop = loop
        self._send_lock = asyncio.Lock()  # FIFO: operations finish in the order they began
        self._recv_lock = asyncio.Lock()
        self._busy = 0  # operations in flight on the socket (touched on the loop only)
        self._closed = False
        self._released = False

    async def send(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        async with self._send_lock:
            self._busy += 1
            try:
                self._check()
                await self._loop.sock_sendall(self._sock, view)
            except OSError as exc:
                self.abort()
                raise EndpointClosed(f"TCP send failed: {exc}") from None
            finally:
                self._done()

    async def recv(self, into: Any) -> None:
        view = memoryview(into).cast("B")
        async with self._recv_lock:
            self._busy += 1
            try:
                got, size = 0, view.nbytes
                while got < size:
                    self._check()
                    n = await self._loop.sock_recv_into(self._sock, view[got:])
                    if n == 0:
                        self.abort()
                        raise EndpointClosed("the peer closed the TCP connection")
                    got += n
                    self.received += n
            except OSError as exc:
                self.abort()
                raise EndpointClosed(f"TCP receive failed: {exc}") from None
            finally:
                self._done()

    async def recv_some(self, into: Any) -> int:
        """Receive what is there, up to the size of `into` (at least one byte, waiting for it);
        0 when the peer closed the connection."""
        view = memoryview(into).cast("B")
        async with self._recv_lock:
            self._busy += 1
            try:
                self._check()
                return await self._loop.sock_recv_into(self._sock, view)
            except OSError as exc:
                self.abort()
                raise EndpointClosed(f"TCP receive failed: {exc}") from None
            finally:
                self._done()

    def abort(self) -> None:
        """End the connection: operations in flight fail (the shutdown wakes them), later ones
        raise EndpointClosed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if not self._busy:  # else the last operation in flight closes it, on the loop
            self._release()

    def _check(self) -> None:
        if self._closed:
            raise EndpointClosed("the TCP connection is closed")

    def _done(self) -> None:
        self._busy -= 1
        if self._closed and not self._busy:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._sock.close()


class TlsEndpoint(ByteStream):
    """A TLS connection over a `SocketEndpoint`, on its event loop: the TLS state machine is an
    `ssl.SSLObject` over memory buffers, so encrypted bytes go straight between the socket and
    those buffers and each payload is decrypted straight into the caller's buffer (no stream
    buffer in between). Sends, and receives, complete in the order they were started.
    `abort()` may come from any thread. `peer_certificate`: the peer's certificate as `ssl`
    decodes it ({} if none)."""

    def __init__(
        self,
        raw: SocketEndpoint,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self._raw = raw
        self._tls = tls
        self._in = incoming
        self._out = outgoing
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self._buffer = bytearray(_TLS_STEP_BYTES)  # encrypted bytes as they come off the socket
        self.peer_certificate: dict[str, Any] = {}

    async def handshake(self, timeout_s: float) -> None:
        """Run the TLS handshake (certificates checked as the context says); raises
        ssl.SSLError, EndpointClosed or TimeoutError."""

        async def shake() -> None:
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    await self._fill()
            await self._flush()

        await asyncio.wait_for(shake(), timeout_s)
        cert = self._tls.getpeercert()
        self.peer_certificate = cert if isinstance(cert, dict) else {}

    async def send(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        async with self._send_lock:
            try:
                for start in range(0, view.nbytes, _TLS_STEP_BYTES):
                    self._tls.write(view[start : start + _TLS_STEP_BYTES])
                    await self._flush()
            except ssl.SSLError as exc:
                self.abort()
                raise EndpointClosed(f"TLS send failed: {exc}") from None

    async def recv(self, into: Any) -> None:
        view = memoryview(into).cast("B")
        async with self._recv_lock:
            got, size = 0, view.nbytes
            while got < size:
                try:
                    # with a buffer, read() returns the count (typeshed says bytes)
                    n = cast(int, self._tls.read(size - got, view[got:]))
                except ssl.SSLWantReadError:
                    if self._out.pending:  # the peer's TLS asked for an answer (a key update)
                        await self._flush()
                    await self._fill()
                    continue
                except ssl.SSLError as exc:  # close_notify, an alert, a bad record
                    self.abort()
                    raise EndpointClosed(f"TLS receive failed: {exc}") from None
                if n == 0:
                    self.abort()
                    raise EndpointClosed("the peer closed the TLS connection")
                got += n
                self.received += n

    def abort(self) -> None:
        """End the connection at once (no TLS close alert). Idempotent, any thread."""
        self._raw.abort()

    async def _flush(self) -> None:
        """Send what the TLS layer has encrypted (in the order it did: the socket's own send
        lock queues these in order)."""
        data = self._out.read()
        if data:
            await self._raw.send(data)

    async def _fill(self) -> None:
        n = await self._raw.recv_some(self._buffer)
        if n == 0:
            self.abort()
            raise EndpointClosed("the peer closed the TLS connection")
        self._in.write(memoryview(self._buffer)[:n])


async def connect_tls(
    host: str, port: int, context: ssl.SSLContext, server_name: str = ""
) -> TlsEndpoint:
    """Connect to host:port over TLS, checking the certificate against `server_name` (default
    `host`); raises OSError, ssl.SSLError, EndpointClosed or TimeoutError."""
    raw = await connect_tcp(host, port)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name or host)
    ep = TlsEndpoint(raw, tls, incoming, outgoing)
    try:
        await ep.handshake(TLS_HANDSHAKE_TIMEOUT_S)
    except BaseException:
        ep.abort()
        raise
    return ep


async def connect_tcp(host: str, port: int) -> SocketEndpoint:
    """Connect to host:port on the running loop; raises OSError."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return SocketEndpoint(sock, loop)
    raise error or OSError(f"no address for {host}:{port}")
