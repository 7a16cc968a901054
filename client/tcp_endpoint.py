"""A TCP socket as a bulk-path endpoint: the TCP data path speaks the UCX framing
(client/ucx_protocol.py) over plain sockets, through the same transport and server code.

`SocketEndpoint` gives a non-blocking socket the three operations the bulk code uses on a ucxx
endpoint, on the process's bulk loop (client/ucx_runtime.py): `send(buffer)`, `recv(buffer)`
(fills the whole buffer, straight from the kernel, no copy in between) and `abort()`. A UCX
endpoint keeps messages in the order they were posted; so does this one: sends, and receives,
complete one after another in the order they were started, however many are in flight.

`TlsEndpoint` is the same three operations over a TLS connection (asyncio streams): the bytes are
encrypted, so each send and receive costs a copy through the TLS layer. Both are `ByteStream`s:
the framing arrives as a byte stream, not as messages.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import ssl
from typing import Any

from client.errors import Unavailable

_SOCKET_BUFFER_BYTES = 4 << 20  # a few 1 MiB pages in flight per direction
_TLS_STEP_BYTES = 1 << 20  # a TLS send is copied into the TLS layer a step at a time
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
    """A bulk-path endpoint over a byte stream (TCP, plain or TLS)."""

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
    """One TLS connection (asyncio streams), used from one event loop. `abort()` may come from
    any thread. `peer_certificate`: the peer's certificate as `ssl` decodes it ({} if none)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._loop = loop
        self._reader = reader
        self._writer = writer
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self._closed = False
        cert = writer.get_extra_info("peercert")
        self.peer_certificate: dict[str, Any] = cert if isinstance(cert, dict) else {}

    async def send(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        async with self._send_lock:
            try:
                for start in range(0, max(view.nbytes, 1), _TLS_STEP_BYTES):
                    self._check()
                    # a copy: the TLS layer may keep what it is given past this call
                    self._writer.write(bytes(view[start : start + _TLS_STEP_BYTES]))
                    await self._writer.drain()
            except (OSError, ssl.SSLError) as exc:
                self.abort()
                raise EndpointClosed(f"TLS send failed: {exc}") from None

    async def recv(self, into: Any) -> None:
        view = memoryview(into).cast("B")
        async with self._recv_lock:
            try:
                got, size = 0, view.nbytes
                while got < size:
                    self._check()
                    chunk = await self._reader.read(size - got)
                    if not chunk:
                        self.abort()
                        raise EndpointClosed("the peer closed the TLS connection")
                    view[got : got + len(chunk)] = chunk
                    got += len(chunk)
            except (OSError, ssl.SSLError) as exc:
                self.abort()
                raise EndpointClosed(f"TLS receive failed: {exc}") from None

    def abort(self) -> None:
        """End the connection at once (no TLS close alert). Idempotent, any thread."""
        if self._closed:
            return
        self._closed = True
        transport = self._writer.transport
        if self._loop.is_running() and not _on_loop(self._loop):
            self._loop.call_soon_threadsafe(transport.abort)
        else:
            transport.abort()

    def _check(self) -> None:
        if self._closed:
            raise EndpointClosed("the TLS connection is closed")


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def accept_tls(sock: socket.socket, context: ssl.SSLContext) -> TlsEndpoint:
    """The server side of a TLS connection on the accepted socket `sock` (handshake done, the
    client's certificate verified when `context` asks for one); raises OSError / ssl.SSLError /
    TimeoutError when the handshake fails."""
    loop = asyncio.get_running_loop()
    tune_socket(sock)
    reader = asyncio.StreamReader(limit=_TLS_STEP_BYTES)
    protocol = asyncio.StreamReaderProtocol(reader)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, sock, ssl=context, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S
    )
    return TlsEndpoint(reader, asyncio.StreamWriter(transport, protocol, reader, loop), loop)


async def connect_tls(
    host: str, port: int, context: ssl.SSLContext, server_name: str = ""
) -> TlsEndpoint:
    """Connect to host:port over TLS, checking the certificate against `server_name` (default
    `host`); raises OSError / ssl.SSLError."""
    reader, writer = await asyncio.open_connection(
        host,
        port,
        ssl=context,
        server_hostname=server_name or host,
        ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S,
        limit=_TLS_STEP_BYTES,
    )
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return TlsEndpoint(reader, writer, asyncio.get_running_loop())


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
