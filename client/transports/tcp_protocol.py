"""The TCP data path's operations, sans I/O: each one a generator of the socket steps it needs.

The framing is the bulk paths' (client/transports/ucx_protocol.py: a PREAMBLE, its meta, then
payloads whose sizes both ends know), with two kinds of its own that make every call over TCP
one round trip:

Get:     client -> GET (meta: a serialized GetRequest with `scope`)
         server -> MANIFEST (meta: per key present or not, header, payload size), and at once
                   the payload of every present page, in order; or ERROR. A miss is a manifest
                   of absent entries: the same round trip. The daemon releases the read lease
                   itself when its send is done (nothing comes back from the client).
Put:     client -> PUT_PAGES (aux: page count; meta: the PutBegin, each page header and each
                   payload size, see `encode_put_pages`), then at once every payload in order
                   (several pages per frame: one send of many views)
         server -> DONE (meta: one PutStatus byte per page) or ERROR (nothing stored). The
                   daemon receives every announced payload whatever it answers (a page it
                   already holds is read and dropped), so the connection stays in step.
Lookup:  client -> LOOKUP (meta: a serialized LookupRequest: scope and the keys concatenated)
         server -> LOOKUP_HITS (aux: hit count; meta: one Tier byte per hit) or ERROR.

An operation is a generator yielding `Send` (write all of these buffers, in order) and `Recv`
(fill exactly this buffer) and returning its result; a driver runs it over a socket: blocking
in the caller's thread (client/transports/tcp_transport.py `drive`) or on an event loop
(`drive_async`). A typed error the daemon answered is raised as `RemoteError` (the connection
is still in step); `ProtocolError` means the peer broke the framing (drop the connection).
Each payload a get receives is checked here against its header (key, scope, size) before it is
received into the caller's buffer and, when asked, against its checksum after.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from client.contract.errors import Corrupt, InvalidArgument, StrataError
from client.contract.page import PageHeader
from client.contract.types import PutStatus, Tier
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_HELLO,
    KIND_MANIFEST,
    KIND_WELCOME,
    PREAMBLE,
    ManifestEntry,
    ProtocolError,
    decode_error,
    decode_manifest,
    decode_put,
    encode_manifest,
    encode_put,
    parse_preamble,
    preamble,
)

log = logging.getLogger(__name__)

KIND_PUT_PAGES = 9
KIND_LOOKUP = 10
KIND_LOOKUP_HITS = 11

_SIZE = struct.Struct("<Q")
_TIERS = {int(t): t for t in Tier}
MAX_REPLY_META_BYTES = 1 << 30
# Payloads are received in groups of about this much (half a socket buffer): the receiver
# checksums one group while the kernel takes in the next.
RECEIVE_GROUP_BYTES = 2 << 20
# A manifest entry of an absent page is all zero bytes: a manifest of nothing but those is a
# miss of every key, answered without decoding an entry.
_ABSENT_ENTRY_BYTES = len(encode_manifest([ManifestEntry(b"", 0)]))


class RemoteError(Exception):
    """A typed error the daemon answered; the connection is still in step and reusable."""

    def __init__(self, error: StrataError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class Send:
    """Write every byte of `parts`, in order."""

    parts: tuple[bytes | memoryview, ...]


@dataclass(frozen=True, slots=True)
class Recv:
    """Fill every byte of `into`."""

    into: memoryview


@dataclass(frozen=True, slots=True)
class RecvMany:
    """Fill every byte of each of `parts`, in order (a driver may scatter one receive over
    many of them)."""

    parts: tuple[memoryview, ...]


Step = Send | Recv | RecvMany


@dataclass(frozen=True, slots=True)
class GetOutcome:
    """One get's result: the header of each delivered page (None: a miss) and how many pages
    were dropped by verification (each also a miss)."""

    headers: tuple[PageHeader | None, ...]
    corrupt: int


@dataclass(frozen=True, slots=True)
class LookupHits:
    """The longest present prefix of a lookup's keys: one tier per hit."""

    tiers: tuple[Tier, ...]

    @property
    def hit_count(self) -> int:
        return len(self.tiers)


# ---- put meta ------------------------------------------------------------------------------


def encode_put_pages(begin: bytes, headers: Sequence[bytes], sizes: Sequence[int]) -> bytes:
    """A PUT_PAGES frame's meta: `encode_put(begin, headers)`, then each payload's size (u64)."""
    return encode_put(begin, headers) + b"".join(_SIZE.pack(n) for n in sizes)


def split_put_pages(
    meta: bytes | bytearray, page_count: int, max_page_bytes: int
) -> tuple[memoryview, list[int]]:
    """(the `encode_put` part, payload sizes) of a PUT_PAGES meta. ProtocolError when the
    sizes cannot be read or one exceeds `max_page_bytes`: the payloads that follow cannot be
    told apart, the connection must end."""
    tail = page_count * _SIZE.size
    if len(meta) < tail:
        raise ProtocolError("truncated TCP put: the payload sizes are missing")
    view = memoryview(meta)
    head = len(meta) - tail
    sizes = [_SIZE.unpack_from(view, head + i * _SIZE.size)[0] for i in range(page_count)]
    if any(n > max_page_bytes for n in sizes):
        raise ProtocolError(f"a TCP put announces a payload over {max_page_bytes} bytes")
    return view[:head], sizes


def decode_put_pages(
    meta: bytes | bytearray, page_count: int, max_page_bytes: int
) -> tuple[bytes, list[bytes], list[int]]:
    """(PutBegin, headers, payload sizes) of a PUT_PAGES meta: ProtocolError as
    `split_put_pages` says, InvalidArgument for a malformed begin/header part."""
    head, sizes = split_put_pages(meta, page_count, max_page_bytes)
    begin, headers = decode_put(head, page_count)
    return begin, headers, sizes


def encode_tiers(tiers: Sequence[Tier | int]) -> bytes:
    return bytes(int(t) for t in tiers)


def decode_tiers(meta: bytes | bytearray, hits: int, asked: int) -> tuple[Tier, ...]:
    if hits > asked or len(meta) != hits:
        raise ProtocolError(f"lookup of {asked} keys answered {hits} hits, {len(meta)} tiers")
    if not hits:
        return ()
    try:
        if meta.count(meta[0]) == hits:  # a chain usually sits in one tier: no per-page step
            return (_TIERS[meta[0]],) * hits
        return tuple(map(_TIERS.__getitem__, meta))
    except KeyError as exc:
        raise ProtocolError(f"unknown tier {exc.args[0]} in a lookup answer") from None


# ---- operations ----------------------------------------------------------------------------


def _frame(
    max_meta: int = MAX_REPLY_META_BYTES,
) -> Generator[Step, None, tuple[int, int, bytearray]]:
    """Receive one frame (kind, aux, meta); an ERROR frame raises its RemoteError."""
    head = bytearray(PREAMBLE.size)
    yield Recv(memoryview(head))
    frame = parse_preamble(head, max_meta)
    meta = bytearray(frame.meta_bytes)
    if frame.meta_bytes:
        yield Recv(memoryview(meta))
    if frame.kind == KIND_ERROR:
        raise RemoteError(decode_error(frame.aux, meta))
    return frame.kind, frame.aux, meta


def hello_op(token: bytes) -> Generator[Step, None, None]:
    """HELLO with `token` (b"": none); WELCOME expected. A refusal raises RemoteError."""
    yield Send((preamble(KIND_HELLO, 0, len(token)), token) if token else (preamble(KIND_HELLO),))
    kind, _, _ = yield from _frame()
    if kind != KIND_WELCOME:
        raise ProtocolError(f"HELLO answered with frame {kind}")


def get_op(
    request: bytes,
    scope_digest: bytes,
    keys: Sequence[bytes],
    into: Sequence[memoryview],
    *,
    verify: bool,
    max_page_bytes: int,
) -> Generator[Step, None, GetOutcome]:
    """Get the pages of the serialized GetRequest `request` (for `keys`) into `into`: one round
    trip. A page whose header is not the one asked for (key, scope, size) or (with `verify`)
    whose payload fails its checksum is a miss counted in `corrupt`; its buffer is then
    unspecified."""
    yield Send((preamble(KIND_GET, 0, len(request)) + request,))  # one buffer: a plain send
    kind, aux, meta = yield from _frame()
    if kind != KIND_MANIFEST or aux != len(keys):
        raise ProtocolError(f"expected a manifest of {len(keys)} pages, got frame {kind}/{aux}")
    if len(meta) == len(keys) * _ABSENT_ENTRY_BYTES and not meta.strip(b"\0"):
        return GetOutcome((None,) * len(keys), 0)  # every entry absent: nothing follows
    entries = decode_manifest(meta, len(keys))
    headers: list[PageHeader | None] = [None] * len(keys)
    corrupt = 0
    targets: list[tuple[int, memoryview]] = []  # (page, where its payload goes; -1: dropped)
    scratch: memoryview | None = None  # one buffer for every dropped payload, again and again
    for i, entry in enumerate(entries):
        if not entry.present:
            continue
        if entry.payload_bytes > max_page_bytes:
            raise ProtocolError(f"page {i}: {entry.payload_bytes} bytes exceeds the page limit")
        header = accept_entry(entry, keys[i], scope_digest, into[i])
        if header is None:
            corrupt += 1
            if entry.payload_bytes:  # received and dropped, to stay in step
                if scratch is None or scratch.nbytes < entry.payload_bytes:
                    scratch = memoryview(bytearray(entry.payload_bytes))
                targets.append((-1, scratch[: entry.payload_bytes]))
            continue
        if entry.payload_bytes:
            targets.append((i, into[i][: entry.payload_bytes]))
        headers[i] = header
    for group in receive_groups(targets):
        # straight into the buffers; each group's checksums are computed while the kernel
        # already receives the next group
        yield RecvMany(tuple(view for _, view in group))
        if not verify:
            continue
        for i, view in group:
            header = headers[i] if i >= 0 else None
            if header is None:
                continue
            try:
                header.verify_payload(view)
            except Corrupt as exc:
                log.debug("tcp get: page %d dropped: %s", i, exc)
                headers[i] = None
                corrupt += 1
    return GetOutcome(tuple(headers), corrupt)


def receive_groups(targets: Sequence[tuple[int, memoryview]]) -> list[list[tuple[int, memoryview]]]:
    """`targets` cut into consecutive groups of about RECEIVE_GROUP_BYTES (whole pages), so a
    receiver can check one group's pages while the next one is arriving."""
    groups: list[list[tuple[int, memoryview]]] = []
    size = RECEIVE_GROUP_BYTES
    for target in targets:
        if size >= RECEIVE_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(target)
        size += target[1].nbytes
    return groups


def accept_entry(
    entry: ManifestEntry, key: bytes, scope_digest: bytes, into: memoryview
) -> PageHeader | None:
    """The header of a manifest entry if it is the page asked for and fits its buffer."""
    try:
        header = PageHeader.decode(entry.header)
    except Corrupt as exc:
        log.debug("bulk get: undecodable header: %s", exc)
        return None
    if header.key != key or header.scope_digest != scope_digest:
        log.debug("bulk get: header names another key or scope")
        return None
    if header.payload_bytes != entry.payload_bytes or header.payload_bytes > into.nbytes:
        log.debug("bulk get: payload of %d bytes does not fit", entry.payload_bytes)
        return None
    return header


def put_op(
    begin: bytes, headers: Sequence[bytes], payloads: Sequence[memoryview]
) -> Generator[Step, None, tuple[PutStatus, ...]]:
    """Put pages in one round trip: the frame and every payload in one send, then DONE."""
    count = len(headers)
    if len(payloads) != count:
        raise InvalidArgument(f"{count} headers for {len(payloads)} payloads")
    meta = encode_put_pages(begin, headers, [p.nbytes for p in payloads])
    yield Send((preamble(KIND_PUT_PAGES, count, len(meta)), meta, *payloads))
    kind, aux, statuses = yield from _frame()
    if kind != KIND_DONE or aux != count or len(statuses) != count:
        raise ProtocolError(f"expected {count} put statuses, got frame {kind}/{aux}")
    try:
        return tuple(PutStatus(s) for s in statuses)
    except ValueError:
        raise ProtocolError("unknown put status in a TCP reply") from None


def lookup_op(request: bytes, asked: int) -> Generator[Step, None, LookupHits]:
    """Look up the serialized LookupRequest `request` (of `asked` keys): one round trip."""
    yield Send((preamble(KIND_LOOKUP, 0, len(request)) + request,))
    kind, hits, meta = yield from _frame()
    if kind != KIND_LOOKUP_HITS:
        raise ProtocolError(f"expected lookup hits, got frame {kind}")
    return LookupHits(decode_tiers(meta, hits, asked))
