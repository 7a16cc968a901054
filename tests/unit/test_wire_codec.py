"""The hand-built protobuf of the bulk data path (client/transports/_wire.py), pinned to the generated classes.

Put and Get move page data as PutRequest/GetResponse messages encoded and decoded by hand, so
payload bytes are copied once. These tests hold that encoding to exactly what the classes
generated from store.proto write and read: byte-identical output, the same decoded fields, and
every encoding the fast decoder does not expect left to the generated parser.
"""

from __future__ import annotations

import pytest

from client import KVLayout, Page, Scope, build_pages
from client.contract.types import IoClass, Tier
from client.transports._wire import (
    GET_METHOD,
    PUT_METHOD,
    TAG_GET_CHUNK,
    TAG_PUT_CHUNK,
    ChunkView,
    GetAssembler,
    chunk_message,
    chunk_message_prefix,
    decode_chunk_message,
    put_messages,
    varint,
)
from kvstore.service import _put_request
from kvstore_pb import store_pb2 as pb

pytestmark = pytest.mark.unit

SCOPE = Scope(
    model_id="tiny",
    weights_revision="w1",
    tokenizer_fingerprint="tok1",
    kv_dtype="float16",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
)
PAGE_BYTES = SCOPE.page_payload_bytes  # 256

CHUNKS = [
    (0, b"", 0, b""),
    (0, b"", 0, b"x"),
    (1, b"h" * 100, 0, bytes(range(256))),
    (127, b"", 128, b"\x00" * 127),
    (128, b"hdr", 1 << 20, b"y" * 300),
    (300, b"h" * 200, (1 << 40) + 5, b"z" * 70_000),
    ((1 << 32) - 1, b"", (1 << 64) - 1, b"last"),
]


def generated_put(index: int, header: bytes, offset: int, data: bytes) -> bytes:
    chunk = pb.PageChunk(index=index, header=header, offset=offset, data=data)
    return pb.PutRequest(chunk=chunk).SerializeToString()


def generated_get(index: int, header: bytes, offset: int, data: bytes) -> bytes:
    chunk = pb.PageChunk(index=index, header=header, offset=offset, data=data)
    return pb.GetResponse(chunk=chunk).SerializeToString()


def pages_of(count: int) -> list[Page]:
    tokens = list(range(100, 100 + 4 * count))
    payloads = [bytes((i * 7 + j) % 251 for j in range(PAGE_BYTES)) for i in range(count)]
    return build_pages(SCOPE, tokens, payloads)


@pytest.mark.parametrize("value", [1, 127, 128, 300, 16_383, 16_384, 1 << 32, (1 << 64) - 1])
def test_varint_is_the_protobuf_encoding(value: int) -> None:
    assert b"\x18" + varint(value) == pb.PageChunk(offset=value).SerializeToString()
    assert varint(0) == b"\x00"


@pytest.mark.parametrize(("index", "header", "offset", "data"), CHUNKS)
def test_chunk_messages_are_byte_identical_to_the_generated_ones(
    index: int, header: bytes, offset: int, data: bytes
) -> None:
    assert chunk_message(TAG_PUT_CHUNK, index, header, offset, data) == generated_put(
        index, header, offset, data
    )
    assert chunk_message(TAG_GET_CHUNK, index, header, offset, memoryview(data)) == generated_get(
        index, header, offset, data
    )
    prefix = chunk_message_prefix(TAG_GET_CHUNK, index, header, offset, len(data))
    assert prefix + data == generated_get(index, header, offset, data)


@pytest.mark.parametrize(("index", "header", "offset", "data"), CHUNKS)
def test_decoding_matches_the_generated_parser_without_copying_data(
    index: int, header: bytes, offset: int, data: bytes
) -> None:
    for tag, raw in ((TAG_PUT_CHUNK, generated_put(index, header, offset, data)),
                     (TAG_GET_CHUNK, generated_get(index, header, offset, data))):  # fmt: skip
        view = decode_chunk_message(raw, tag)
        assert view is not None
        assert (view.index, view.header, view.offset, bytes(view.data)) == (
            index, header, offset, data,
        )  # fmt: skip
        assert isinstance(view.data, memoryview) and view.data.obj is raw


def test_fields_in_any_order_decode_the_same() -> None:
    inner = (
        b"\x22\x03abc" + b"\x18\x05" + b"\x12\x02hh" + b"\x08\x07"
    )  # data, offset, header, index
    raw = bytes((TAG_GET_CHUNK, len(inner))) + inner
    view = decode_chunk_message(raw, TAG_GET_CHUNK)
    parsed = pb.GetResponse.FromString(raw).chunk
    assert view is not None
    assert (view.index, view.header, view.offset, bytes(view.data)) == (
        parsed.index, parsed.header, parsed.offset, parsed.data,
    ) == (7, b"hh", 5, b"abc")  # fmt: skip


def _wrap(tag: int, inner: bytes) -> bytes:
    return bytes((tag,)) + varint(len(inner)) + inner


ODD = {
    "begin": pb.PutRequest(begin=pb.PutBegin(page_count=3)).SerializeToString(),
    "unknown field": _wrap(TAG_PUT_CHUNK, b"\x08\x01\x28\x09\x22\x01x"),
    "field repeated (last wins)": _wrap(TAG_PUT_CHUNK, b"\x08\x01\x08\x02\x22\x01x"),
    "index as length-delimited": _wrap(TAG_PUT_CHUNK, b"\x0a\x01x"),
    "index above uint32": _wrap(TAG_PUT_CHUNK, b"\x08" + varint(1 << 33)),
    "offset above uint64": _wrap(TAG_PUT_CHUNK, b"\x18" + varint(1 << 65)),
    "two-byte tag": _wrap(TAG_PUT_CHUNK, b"\x80\x01\x01"),
    "chunk field repeated (merged)": _wrap(TAG_PUT_CHUNK, b"\x08\x01")
    + _wrap(TAG_PUT_CHUNK, b"\x22\x01x"),
    "unknown outer field": _wrap(TAG_PUT_CHUNK, b"\x22\x01x") + b"\x18\x01",
    "empty message": b"",
}


@pytest.mark.parametrize("name", list(ODD))
def test_other_encodings_go_to_the_generated_parser(name: str) -> None:
    raw = ODD[name]
    assert decode_chunk_message(raw, TAG_PUT_CHUNK) is None
    decoded = _put_request(raw)  # what the daemon's Put receives
    assert isinstance(decoded, pb.PutRequest)
    assert decoded == pb.PutRequest.FromString(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x05\x08\x01",  # length past the end
        b"\x12\x02\x22\x05ab",  # data length past the end
        b"\x12\x01\xff",  # varint cut short
    ],
)
def test_truncated_messages_are_not_decoded(raw: bytes) -> None:
    assert decode_chunk_message(raw, TAG_PUT_CHUNK) is None


def test_put_messages_are_what_the_generated_classes_would_send() -> None:
    pages = pages_of(3)
    views = [memoryview(p.payload) for p in pages]
    got = list(
        put_messages(SCOPE, pages, views, io_class=IoClass.CRITICAL, tier=Tier.SSD, chunk_bytes=100)
    )
    begin = pb.PutBegin(
        scope=SCOPE.encode(), io_class=pb.IO_CLASS_CRITICAL, page_count=3, tier=pb.TIER_SSD
    )
    want = [pb.PutRequest(begin=begin).SerializeToString()]
    for i, page in enumerate(pages):
        data = bytes(page.payload)
        for off in range(0, len(data), 100):
            header = page.header.encode() if off == 0 else b""
            want.append(generated_put(i, header, off, data[off : off + 100]))
    assert got == want


def test_an_empty_payload_still_sends_one_chunk() -> None:
    page = pages_of(1)[0]
    empty = Page(page.header, b"")
    msgs = list(
        put_messages(SCOPE, [empty], [memoryview(b"")], io_class=IoClass.NORMAL, tier=None,
                     chunk_bytes=100)
    )  # fmt: skip
    assert msgs[1:] == [generated_put(0, page.header.encode(), 0, b"")]


def _assemble(messages: list[bytes], raw: bool) -> tuple[tuple[object, ...], int, list[bytes]]:
    pages = pages_of(3)
    keys = [p.header.key for p in pages]
    into = [memoryview(bytearray(PAGE_BYTES)) for _ in keys]
    asm = GetAssembler(SCOPE, keys, into, verify=True)
    for m in messages:
        if raw:
            asm.feed_message(m)
        else:
            asm.feed(pb.GetResponse.FromString(m))
    headers = asm.finish()
    return headers, asm.corrupt, [bytes(b) for b in into]


def test_feed_message_agrees_with_feed() -> None:
    pages = pages_of(3)
    p0, p2 = pages[0], pages[2]
    d0, d2 = bytes(p0.payload), bytes(p2.payload)
    flipped = bytes([d2[0] ^ 1]) + d2[1:]
    streams = {
        "whole pages and a miss": [
            generated_get(0, p0.header.encode(), 0, d0),
            pb.GetResponse(missing=1).SerializeToString(),
            generated_get(2, p2.header.encode(), 0, d2),
        ],
        "chunks": [
            generated_get(0, p0.header.encode(), 0, d0[:100]),
            generated_get(0, b"", 100, d0[100:]),
            generated_get(0, b"", 256, b""),  # an empty trailing chunk changes nothing
            generated_get(2, p2.header.encode(), 0, d2[:1]),
            generated_get(2, b"", 1, d2[1:]),
        ],
        "corrupt payload": [generated_get(2, p2.header.encode(), 0, flipped)],
        "misses": [pb.GetResponse(missing=i).SerializeToString() for i in range(3)],
        "data past the end": [
            generated_get(0, p0.header.encode(), 0, d0),
            generated_get(0, b"", 256, b"x"),
        ],
        "incomplete": [generated_get(0, p0.header.encode(), 0, d0[:200])],
    }
    for name, stream in streams.items():
        assert _assemble(stream, raw=True) == _assemble(stream, raw=False), name
    headers, corrupt, data = _assemble(streams["whole pages and a miss"], raw=True)
    assert headers == (p0.header, None, p2.header) and corrupt == 0
    assert data[0] == d0 and data[2] == d2
    assert _assemble(streams["corrupt payload"], raw=True)[1] == 1


def test_feed_message_reports_contract_breaks() -> None:
    pages = pages_of(1)
    into = [memoryview(bytearray(PAGE_BYTES))]
    asm = GetAssembler(SCOPE, [pages[0].header.key], into, verify=True)
    with pytest.raises(Exception, match="index 300"):
        asm.feed_message(pb.GetResponse(missing=300).SerializeToString())
    with pytest.raises(Exception, match="empty GetResponse"):
        asm.feed_message(b"")
    with pytest.raises(Exception, match="undecodable"):
        asm.feed_message(b"\x0a\x05\x08")


def test_chunk_view_has_the_page_chunk_fields() -> None:
    view = ChunkView(1, b"h", 2, memoryview(b"d"))
    assert (view.index, view.header, view.offset, bytes(view.data)) == (1, b"h", 2, b"d")


def test_method_paths_name_the_proto_methods() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Store"].methods_by_name
    for path, name in ((PUT_METHOD, "Put"), (GET_METHOD, "Get")):
        assert path == "/" + methods[name].full_name.replace(f".{name}", f"/{name}")
