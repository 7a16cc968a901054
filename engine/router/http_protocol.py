"""The router's HTTP/1.1 protocol: uvicorn's httptools protocol with each response's head held
until its first body bytes, so the two leave the server in one write.

uvicorn writes a response's status line and headers to the socket as soon as the app sends
`http.response.start`, and its body with the next message: two writes, two segments on the wire,
and for the client two reads, two wake-ups of its event loop and, in an HTTP library such as
httpx (h11), two turns of its parser, for a response whose every byte was ready at once (the
router answers with the headers and the first token, or the whole body, back to back).
`HeadHoldingTransport` keeps a write that starts a response (`HTTP/1.1 `…) and joins it to the
next write; when no write follows in the same loop turn the head goes out on its own at the end
of that turn (a `call_soon`), so nothing is delayed past the turn that produced it. Closing the
transport writes what is held first. Order is kept: every write goes through the one buffer.

`protocol_class()` is what `strata router` gives uvicorn as its `http` protocol: this one where
httptools is installed (the router extra installs it), else None (uvicorn's own choice).
"""

from __future__ import annotations

import asyncio
from typing import Any

_HEAD = b"HTTP/1.1 "


class HeadHoldingTransport:
    """A transport that holds a response head for the next write (see the module doc)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self.joined = 0  # heads that left with their body's first bytes

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.joined += 1
            self._transport.write(held + bytes(data))
            return
        if data[: len(_HEAD)] == _HEAD and not self._transport.is_closing():
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Write what is held, if anything."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class() -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol over `HeadHoldingTransport`; None without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HeadHoldingHttpTools(HttpToolsProtocol):
        """uvicorn's httptools protocol writing through a `HeadHoldingTransport`."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            held = HeadHoldingTransport(transport, asyncio.get_running_loop())
            super().connection_made(held)  # type: ignore[arg-type]

    return HeadHoldingHttpTools
