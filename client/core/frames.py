"""The gRPC data-path messages, built and read by hand: the Put stream's requests and the Get
stream's reassembly into the caller's buffers (with its verification).

Pure: no I/O. The bulk messages (PutRequest and GetResponse carrying a PageChunk) are encoded
and decoded here by hand, so that payload bytes are copied once into the outgoing message and
read in place from the incoming one (the generated classes copy them once more each way, and
accept no memoryview). The bytes are exactly what SerializeToString writes (fields in number
order, proto3 defaults omitted), and the decoders accept any encoding of these messages:
whatever they do not expect (unknown or repeated fields, other wire types) sends the message to
the generated parser instead, so a third-party peer built from store.proto works unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from client.contract.scope import Scope
from client.contract.types import IoClass, Limits, Page, Tier
from client.core.requests import io_class_value, tier_value
from kvstore_pb import store_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20
# Room left in a message for everything but the chunk data (a page header is a few KiB at most).
_CHUNK_OVERHEAD_BYTES = 64 << 10
PUT_METHOD = "/strata.store.v1.Store/Put"
GET_METHOD = "/strata.store.v1.Store/Get"


def chunk_bytes_for(limits: Limits, max_message_bytes: int) -> int:
    """Payload bytes per PageChunk: the node's chunk size, kept inside one message."""
    chunk = limits.chunk_bytes or DEFAULT_CHUNK_BYTES
    cap = max_message_bytes - _CHUNK_OVERHEAD_BYTES
    if limits.max_message_bytes:
        cap = min(cap, limits.max_message_bytes - _CHUNK_OVERHEAD_BYTES)
    return max(1, min(chunk, cap))


# Tags: field number << 3 | wire type (0 varint, 2 length-delimited).
TAG_PUT_CHUNK = 0x12  # PutRequest.chunk = 2
TAG_GET_CHUNK = 0x0A  # GetResponse.chunk = 1
TAG_GET_MISSING = 0x10  # GetResponse.missing = 2
_TAG_INDEX = 0x08  # PageChunk.index = 1
_TAG_HEADER = 0x12  # PageChunk.header = 2
_TAG_OFFSET = 0x18  # PageChunk.offset = 3
_TAG_DATA = 0x22  # PageChunk.data = 4
_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))
_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_message_prefix(tag: int, index: int, header: bytes, offset: int, size: int) -> bytes:
    """The bytes of a message whose field `tag` is PageChunk{index, header, offset, data},
    up to the data itself: followed by the `size` data bytes it is the whole message."""
    parts: list[bytes] = []
    if index:
        parts += (_SMALL_VARINTS[_TAG_INDEX], varint(index))
    if header:
        parts += (_SMALL_VARINTS[_TAG_HEADER], varint(len(header)), header)
    if offset:
        parts += (_SMALL_VARINTS[_TAG_OFFSET], varint(offset))
    if size:
        parts += (_SMALL_VARINTS[_TAG_DATA], varint(size))
    inner = sum(map(len, parts)) + size
    return b"".join((_SMALL_VARINTS[tag], varint(inner), *parts))


def chunk_message(
    tag: int, index: int, header: bytes, offset: int, data: bytes | memoryview
) -> bytes:
    """A whole message whose field `tag` is a PageChunk: one copy of `data`."""
    size = memoryview(data).nbytes
    prefix = chunk_message_prefix(tag, index, header, offset, size)
    return b"".join((prefix, data)) if size else prefix


class ChunkView:
    """A decoded PageChunk whose `data` is a view into the received message (no copy)."""

    __slots__ = ("data", "header", "index", "offset")

    def __init__(self, index: int, header: bytes, offset: int, data: memoryview) -> None:
        self.index = index
        self.header = header
        self.offset = offset
        self.data = data


class _Unexpected(Exception):
    """An encoding the fast decoder leaves to the generated parser."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    raise _Unexpected


def _decode_chunk(buf: memoryview, pos: int, end: int) -> ChunkView:
    index = offset = 0
    header = b""
    data = buf[pos:pos]
    seen = 0
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag & 0x80 or (seen >> tag) & 1:  # a long tag, or a field repeated
            raise _Unexpected
        seen |= 1 << tag
        if tag == _TAG_INDEX:
            index, pos = _read_varint(buf, pos, end)
            if index > _UINT32_MAX:
                raise _Unexpected
        elif tag == _TAG_OFFSET:
            offset, pos = _read_varint(buf, pos, end)
            if offset > _UINT64_MAX:
                raise _Unexpected
        elif tag in (_TAG_HEADER, _TAG_DATA):
            size, pos = _read_varint(buf, pos, end)
            if size > end - pos:
                raise _Unexpected
            if tag == _TAG_HEADER:
                header = buf[pos : pos + size].tobytes()
            else:
                data = buf[pos : pos + size]
            pos += size
        else:
            raise _Unexpected
    if pos != end:
        raise _Unexpected
    return ChunkView(index, header, offset, data)


def decode_chunk_message(raw: bytes, tag: int) -> ChunkView | None:
    """The PageChunk of a message made of only field `tag`, encoded as `chunk_message` does
    (fields in any order, each at most once); None for anything else (parse it generically)."""
    buf = memoryview(raw)
    end = len(buf)
    if end < 2 or buf[0] != tag:
        return None
    try:
        size, pos = _read_varint(buf, 1, end)
        if pos + size != end:
            return None
        return _decode_chunk(buf, pos, end)
    except _Unexpected:
        return None


def _put_begin_message(
    scope: Scope,
    page_count: int,
    io_class: IoClass,
    tier: Tier | None,
    chain_prefix: Sequence[bytes] = (),
) -> bytes:
    return pb.PutRequest(
        begin=pb.PutBegin(
            scope=scope.encode(),
            io_class=io_class_value(io_class),
            page_count=page_count,
            tier=tier_value(tier),
            chain_prefix=chain_prefix,
        )
    ).SerializeToString()


def put_messages(
    scope: Scope,
    pages: Sequence[Page],
    payloads: Sequence[memoryview],
    *,
    io_class: IoClass,
    tier: Tier | None,
    chunk_bytes: int,
    chain_prefix: Sequence[bytes] = (),
) -> Iterator[bytes]:
    """The serialized PutRequests of one Put stream: a PutBegin (carrying `chain_prefix`, see
    PutBegin in store.proto), then each page's chunks.

    The first chunk of page i carries its header; the chunks' data cover the payload exactly,
    at increasing offsets, at most `chunk_bytes` each; an empty payload still sends one chunk.
    Each message is built with one copy of its data (no protobuf object in between). Send them
    with the identity serializer `raw_bytes`.
    """
    yield _put_begin_message(scope, len(pages), io_class, tier, chain_prefix)
    for index, (page, view) in enumerate(zip(pages, payloads, strict=True)):
        header = page.header.encode()
        size = view.nbytes
        if size == 0:
            yield chunk_message(TAG_PUT_CHUNK, index, header, 0, b"")
            continue
        for offset in range(0, size, chunk_bytes):
            end = min(offset + chunk_bytes, size)
            part = view if offset == 0 and end == size else view[offset:end]
            yield chunk_message(TAG_PUT_CHUNK, index, header if offset == 0 else b"", offset, part)


def put_requests(
    scope: Scope,
    pages: Sequence[Page],
    payloads: Sequence[memoryview],
    *,
    io_class: IoClass,
    tier: Tier | None,
    chunk_bytes: int,
) -> Iterator[pb.PutRequest]:
    """`put_messages` as generated PutRequest objects (for stubs built from store.proto)."""
    for raw in put_messages(
        scope, pages, payloads, io_class=io_class, tier=tier, chunk_bytes=chunk_bytes
    ):
        yield pb.PutRequest.FromString(raw)
