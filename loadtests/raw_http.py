"""A minimal HTTP/1.1 client over one kept-alive asyncio connection, for latency benchmarks.

`strata bench router` measures the router with two clients: httpx (what the OpenAI Python SDK
sends requests with) and this one, which leaves out an HTTP client library's own per-request
work (its request and connection objects, a pure-Python parser) so the router's share of the
time is seen. It still pays what any client pays: the JSON body encoded per request, the request
written to a socket, the status line, headers and body read and parsed (Content-Length or
chunked), on loopback.

Only what the benchmark needs: POST with a JSON body, a whole response or a streamed one read
chunk by chunk. No redirects, no TLS, no proxies; a response that is not HTTP/1.1 is an error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024


class RawHttpError(RuntimeError):
    """The server answered something this client does not read, or closed the connection."""


@dataclass(frozen=True, slots=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    first_event_s: float | None = None  # perf_counter at the first `data: {` of a stream
    chunks: int = 0

    def json(self) -> object:
        return json.loads(self.body)


@dataclass
class RawHttp:
    """One connection to `host:port`; `open()` before use, `close()` after. Not for concurrent
    requests (one at a time, as HTTP/1.1 without pipelining)."""

    host: str
    port: int
    timeout_s: float = 120.0
    _reader: asyncio.StreamReader | None = field(default=None, repr=False)
    _writer: asyncio.StreamWriter | None = field(default=None, repr=False)

    @classmethod
    def for_url(cls, base_url: str, timeout_s: float = 120.0) -> RawHttp:
        """From `http://host:port` (what `RouterCluster.base_url` is)."""
        rest = base_url.removeprefix("http://").rstrip("/")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not an http://host:port URL: {base_url!r}")
        return cls(host, int(port), timeout_s)

    async def open(self) -> RawHttp:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
            self._reader = self._writer = None

    async def post_json(
        self, path: str, body: object, *, on_chunk: Callable[[bytes], None] | None = None
    ) -> RawResponse:
        """POST `body` as JSON; the whole response (a chunked one is joined). `on_chunk` sees
        each chunk of a chunked body as it arrives."""
        return await asyncio.wait_for(self._post(path, body, on_chunk), self.timeout_s)

    async def _post(
        self, path: str, body: object, on_chunk: Callable[[bytes], None] | None
    ) -> RawResponse:
        reader, writer = self._reader, self._writer
        if reader is None or writer is None:
            raise RawHttpError("not open")
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        writer.write(head + payload)
        try:
            raw_head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise RawHttpError(f"no response head: {exc}") from None
        if len(raw_head) > MAX_HEAD_BYTES:
            raise RawHttpError("response head too large")
        lines = raw_head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if version != "HTTP/1.1":
            raise RawHttpError(f"not an HTTP/1.1 response: {lines[0]!r}")
        status = int(rest.split(" ", 1)[0])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
            return RawResponse(status, headers, data)
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise RawHttpError("a response without content-length or chunked encoding")
        parts: list[bytes] = []
        first: float | None = None
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the (empty) trailer
                break
            chunk = (await reader.readexactly(size + 2))[:-2]
            if first is None and b"data: {" in chunk:
                first = time.perf_counter()
            parts.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
        return RawResponse(status, headers, b"".join(parts), first, len(parts))
