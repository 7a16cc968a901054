"""A TCP socket as a bulk-path endpoint: the TCP data path speaks the UCX framing
(client/ucx_protocol.py) over plain sockets, through the same transport and server code.

`SocketEndpoint` gives a non-blocking socket the three operations the bulk code uses on a ucxx
endpoint, on the process's bulk loop (client/ucx_runtime.py): `send(buffer)`, `recv(buffer)`
(fills the whole buffer, straight from the kernel, no copy in between) and `abort()`. A UCX
endpoint keeps messages in the order they were posted; so does this one: sends, and receives,
complete one after another in the order they were started, however many are in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from client.errors import Unavailable

_SOCKET_BUFFER_BYTES = 4 << 20  # a few 1 MiB pages in flight per direction


class EndpointClosed(Unavailable):
    """The peer closed the connection, or it was aborted."""


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on the small framing messages, roomy kernel buffers."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # capped by the kernel's limits: keep its size
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


class SocketEndpoint:
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
