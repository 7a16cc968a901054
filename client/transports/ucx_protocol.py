"""Framing of the bulk data paths, UCX and TCP, shared by the SDK (client/transports/ucx_transport.py) and
the daemon (kvstore/ucx_server.py, kvstore/tcp_server.py). Pure: no ucxx here, so both ends and the tests can import it
freely. Over TCP the same preamble, HELLO, GET and ERROR frames follow one another on the byte
stream, with frames of the TCP path's own (client/transports/tcp_protocol.py: PUT_PAGES, LOOKUP);
both ends always know the size of the next one.

A UCX tag message must be received into a buffer of known size, so every exchange is a fixed
`PREAMBLE` message, then a `meta` message of `meta_bytes` (when > 0), then payload messages whose
sizes both ends already know. Messages on one endpoint arrive in the order they were sent.

Hello (the first exchange of every connection):
      client -> HELLO (meta: the client's bearer token, UTF-8; empty for none)
      server -> WELCOME, or ERROR (Unauthenticated) and the connection is closed. The connection
                is bound to the token's principal; each request is checked against it. An open
                daemon (no tokens) also serves a connection that starts without HELLO.
Get:  client -> GET (meta: a serialized GetRequest, with `scope`: the scope's canonical
                encoding, which a daemon with auth checks against the principal)
      server -> MANIFEST (meta: per key, present or not, header and payload size), then each
                present page's payload in order; or ERROR
Put:  client -> PUT (aux: page count; meta: the PutBegin and each page header)
      server -> WANT (meta: one byte per page, 1 = send its payload) or ERROR
      client -> each wanted payload in order
      server -> DONE (meta: one PutStatus byte per page) or ERROR (nothing stored)

Payloads go straight from the daemon's DRAM slot to the caller's buffer and back (no staging
copy in Python). Every payload that crosses the network is checksum-verified by its receiver.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from client.contract.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    PermissionDenied,
    StrataError,
    Unauthenticated,
    Unavailable,
)

SCHEME = "ucx://"
TCP_SCHEME = "tcp://"  # the TCP data path: the same framing over plain sockets
MAGIC = 0x5355  # "US"
VERSION = 1

# magic u16 | version u8 | kind u8 | aux u32 | meta_bytes u64
PREAMBLE = struct.Struct("<HBBIQ")

KIND_GET = 1
KIND_PUT = 2
KIND_MANIFEST = 3
KIND_WANT = 4
KIND_DONE = 5
KIND_ERROR = 6
KIND_HELLO = 7
KIND_WELCOME = 8

_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<BIQ")  # present u8 | header_bytes u32 | payload_bytes u64
_RETRY = struct.Struct("<I")  # an ERROR's meta: retry_after_ms u32, then the message (utf-8)

# Error codes of an ERROR frame (aux), one per typed error; unknown codes read as Unavailable.
_ERRORS: tuple[tuple[int, type[StrataError]], ...] = (
    (1, InvalidArgument),
    (2, CapacityExhausted),
    (3, LeaseExpired),
    (4, Corrupt),
    (5, DeadlineExceeded),  # before Unavailable: it is a subclass
    (6, Unavailable),
    (8, Unauthenticated),
    (9, PermissionDenied),
)
_INTERNAL = 7
_SETTLE_AFTER_ABORT_S = 5.0

DEFAULT_UCX_ENV = {
    "UCX_TLS": "tcp,self,sm",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
"""Set before ucxx is first imported, unless the environment already sets them. TCP, shared
memory and loopback work on every host, CPU-only included; 1 MiB TCP segments (UCX's default is
8 KiB) about triple page throughput over TCP. To use RDMA or CUDA transports, set UCX_TLS
yourself (e.g. `UCX_TLS=rc,cuda_copy,cuda_ipc,tcp,sm,self`)."""


class ProtocolError(Unavailable):
    """The peer broke the framing; the endpoint is no longer usable."""


def prepare_environment() -> None:
    """Apply DEFAULT_UCX_ENV where the environment leaves it unset (call before importing ucxx)."""
    for key, value in DEFAULT_UCX_ENV.items():
        os.environ.setdefault(key, value)


_HOST_LOCAL_TRANSPORTS = {"tcp", "sm", "self", "posix", "sysv", "cma", "knem", "xpmem", "mm"}


def fabric_configured() -> bool:
    """True when the environment's UCX_TLS names a transport beyond TCP and same-host memory (an
    RDMA or GPU fabric, or "all"): then UCX is worth preferring to the plain TCP data path."""
    tls = os.environ.get("UCX_TLS", "").strip()
    if tls.startswith("^"):  # everything but the transports listed
        return True
    names = {t.strip().lstrip("^").split(":")[0] for t in tls.split(",") if t.strip()}
    return bool(names - _HOST_LOCAL_TRANSPORTS)


def parse_address(address: str, fallback_host: str = "") -> tuple[str, int]:
    """ "ucx://host:port" or "tcp://host:port" -> (host, port). A wildcard host (0.0.0.0, ::)
    becomes `fallback_host`. Raises InvalidArgument for anything else."""
    scheme = next((s for s in (SCHEME, TCP_SCHEME) if address.startswith(s)), None)
    if scheme is None:
        raise InvalidArgument(f"not a bulk data address: {address!r}")
    host, sep, port = address[len(scheme) :].rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise InvalidArgument(f"not a bulk data address: {address!r}")
    if host in ("0.0.0.0", "::") and fallback_host:
        host = fallback_host
    return host, int(port)


def format_address(host: str, port: int, scheme: str = SCHEME) -> str:
    return f"{scheme}[{host}]:{port}" if ":" in host else f"{scheme}{host}:{port}"


def preamble(kind: int, aux: int = 0, meta_bytes: int = 0) -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION, kind, aux, meta_bytes)


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    aux: int
    meta_bytes: int


def parse_preamble(raw: bytes | bytearray, max_meta_bytes: int) -> Frame:
    """Decode a PREAMBLE; ProtocolError for a foreign magic/version or an oversized meta."""
    magic, version, kind, aux, meta_bytes = PREAMBLE.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a Strata UCX frame (magic {magic:#x}, version {version})")
    if meta_bytes > max_meta_bytes:
        raise ProtocolError(f"frame meta of {meta_bytes} bytes exceeds {max_meta_bytes}")
    return Frame(kind, aux, meta_bytes)


# ---- put request ---------------------------------------------------------------------------


def encode_put(begin: bytes, headers: Sequence[bytes]) -> bytes:
    """A PUT's meta: the serialized PutBegin, then each page header, each length-prefixed."""
    parts = [_U32.pack(len(begin)), begin]
    for header in headers:
        parts += [_U32.pack(len(header)), header]
    return b"".join(parts)


def decode_put(meta: bytes | bytearray | memoryview, page_count: int) -> tuple[bytes, list[bytes]]:
    """(serialized PutBegin, page headers) of a PUT's meta; InvalidArgument if malformed."""
    view = memoryview(meta)
    blobs: list[bytes] = []
    pos = 0
    for _ in range(page_count + 1):
        if pos + _U32.size > len(view):
            raise InvalidArgument("truncated UCX put request")
        (n,) = _U32.unpack_from(view, pos)
        pos += _U32.size
        if pos + n > len(view):
            raise InvalidArgument("truncated UCX put request")
        blobs.append(bytes(view[pos : pos + n]))
        pos += n
    if pos != len(view):
        raise InvalidArgument("trailing bytes in a UCX put request")
    return blobs[0], blobs[1:]


# ---- get manifest --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One key of a get: absent (header b"") or present with its header and payload size."""

    header: bytes
    payload_bytes: int

    @property
    def present(self) -> bool:
        return bool(self.header)


def encode_manifest(entries: Sequence[ManifestEntry]) -> bytes:
    parts: list[bytes] = []
    for e in entries:
        parts += [_ENTRY.pack(1 if e.present else 0, len(e.header), e.payload_bytes), e.header]
    return b"".join(parts)


def decode_manifest(meta: bytes | bytearray, count: int) -> list[ManifestEntry]:
    """The `count` entries of a MANIFEST; ProtocolError if it does not hold exactly that."""
    view = memoryview(meta)
    out: list[ManifestEntry] = []
    pos = 0
    for _ in range(count):
        if pos + _ENTRY.size > len(view):
            raise ProtocolError("truncated UCX get manifest")
        present, header_bytes, payload_bytes = _ENTRY.unpack_from(view, pos)
        pos += _ENTRY.size
        if pos + header_bytes > len(view) or (not present and (header_bytes or payload_bytes)):
            raise ProtocolError("malformed UCX get manifest")
        out.append(ManifestEntry(bytes(view[pos : pos + header_bytes]), payload_bytes))
        pos += header_bytes
    if pos != len(view):
        raise ProtocolError("trailing bytes in a UCX get manifest")
    return out


# ---- errors --------------------------------------------------------------------------------


def encode_error(exc: BaseException) -> tuple[int, bytes]:
    """(aux code, meta) of an ERROR frame for `exc` (a non-Strata error is INTERNAL)."""
    code = next((c for c, cls in _ERRORS if type(exc) is cls), 0)
    if not code:
        code = next((c for c, cls in _ERRORS if isinstance(exc, cls)), _INTERNAL)
    retry_ms = int(exc.retry_after_s * 1000) if isinstance(exc, CapacityExhausted) else 0
    text = str(exc) if isinstance(exc, StrataError) else f"internal error: {exc}"
    return code, _RETRY.pack(retry_ms) + text.encode()


def decode_error(code: int, meta: bytes | bytearray) -> StrataError:
    """The typed error an ERROR frame carries."""
    retry_ms = _RETRY.unpack_from(meta, 0)[0] if len(meta) >= _RETRY.size else 0
    text = bytes(meta[_RETRY.size :]).decode(errors="replace")
    cls = next((c for k, c in _ERRORS if k == code), None)
    if cls is CapacityExhausted:
        return CapacityExhausted(text, retry_after_s=retry_ms / 1000)
    if cls is None:
        return StrataError(text) if code == _INTERNAL else Unavailable(text)
    return cls(text)


# ---- transfers -----------------------------------------------------------------------------


async def settle(ops: Sequence[Awaitable[object]], timeout_s: float, ep: Any) -> None:
    """Run the payload transfers `ops` (posted in order) together. On a failure or after
    `timeout_s`, abort the endpoint `ep` and wait until none of them can still touch its buffer,
    then raise (the failure, or DeadlineExceeded)."""
    tasks = [asyncio.ensure_future(op) for op in ops]
    if not tasks:
        return
    done, pending = await asyncio.wait(
        tasks, timeout=max(timeout_s, 0.001), return_when=asyncio.FIRST_EXCEPTION
    )
    error = next((t.exception() for t in done if t.exception() is not None), None)
    if error is None and not pending:
        return
    ep.abort()  # cancels whatever is still posted on it
    if pending:
        await asyncio.wait(pending, timeout=_SETTLE_AFTER_ABORT_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warnings
        else:
            task.cancel()
    if error is not None:
        raise error
    raise DeadlineExceeded(f"UCX transfer not done after {timeout_s:.3f} s")
