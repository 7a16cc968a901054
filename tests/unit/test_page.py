"""The page codec (DESIGN §4): a pinned header, round trips, corruption and validation.

The golden header below was computed once and pinned. If it fails, the on-disk page format
changed and every SSD tier written before would be unreadable: bump page VERSION instead.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from client.contract.errors import Corrupt, InvalidArgument
from client.contract.page import (
    HEADER_FIXED_BYTES,
    MAGIC,
    VERSION,
    PageHeader,
    decode_page,
    encode_page,
    header_bytes_for,
    make_header,
    make_headers,
    payload_checksum,
)
from client.contract.scope import DTYPES, KVLayout, Scope, chain_key, page_keys

pytestmark = pytest.mark.unit

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

TINY = Scope(
    model_id="tiny",
    weights_revision="w1",
    tokenizer_fingerprint="t1",
    kv_dtype="float16",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
)
TINY_PAYLOAD = bytes(i % 256 for i in range(256))
TINY_TOKENS = [1, 2, 3, 4]

GOLDEN_HEADER = (
    "534b5650010000007c000000f78f7acb8dbaf3c5f067a7bf4bd340225904c5c32a883ca908616dacd9e644ccf78f"
    "7acb8dbaf3c5f067a7bf4bd340220400000002000000020000000200000004000000040000000001000000000000"
    "712d953b43a4089401000000020000000300000004000000ae9ad6e3684548f0"
)
GOLDEN_DIGEST = "f78f7acb8dbaf3c5f067a7bf4bd34022"
GOLDEN_KEY = "5904c5c32a883ca908616dacd9e644cc"
GOLDEN_PAYLOAD_CHECKSUM = 0x9408A4433B952D71
GOLDEN_SECOND_KEY = "b6721d0780db922d16c2b3f655eb2d90"


def _tiny_header() -> PageHeader:
    return make_header(TINY, TINY.digest, TINY_TOKENS, TINY_PAYLOAD)


# ---- golden vector -----------------------------------------------------------------------------


def test_format_constants_are_pinned() -> None:
    assert MAGIC == b"SKVP"
    assert VERSION == 1
    assert HEADER_FIXED_BYTES == 100
    assert header_bytes_for(0) == 108
    assert header_bytes_for(16) == 172


def test_golden_header_bytes() -> None:
    header = _tiny_header()
    assert TINY.digest.hex() == GOLDEN_DIGEST
    assert header.key.hex() == GOLDEN_KEY
    assert header.payload_checksum == GOLDEN_PAYLOAD_CHECKSUM
    assert header.encode().hex() == GOLDEN_HEADER
    assert header.header_bytes == len(bytes.fromhex(GOLDEN_HEADER)) == 124
    assert header.total_bytes == 124 + 256


def test_golden_header_decodes_to_its_fields() -> None:
    header = PageHeader.decode(bytes.fromhex(GOLDEN_HEADER))
    assert header == PageHeader(
        scope_digest=bytes.fromhex(GOLDEN_DIGEST),
        key=bytes.fromhex(GOLDEN_KEY),
        parent=bytes.fromhex(GOLDEN_DIGEST),
        tokens=(1, 2, 3, 4),
        dtype="float16",
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
        payload_bytes=256,
        payload_checksum=GOLDEN_PAYLOAD_CHECKSUM,
    )


def test_golden_header_layout_matches_the_docstring() -> None:
    """Field offsets as documented in client/contract/page.py, read back independently of the codec."""
    data = bytes.fromhex(GOLDEN_HEADER)
    assert data[0:4] == b"SKVP"
    assert struct.unpack_from("<HHI", data, 4) == (1, 0, 124)
    assert data[12:28].hex() == GOLDEN_DIGEST
    assert data[28:44].hex() == GOLDEN_KEY
    assert data[44:60].hex() == GOLDEN_DIGEST
    assert struct.unpack_from("<IB3x", data, 60) == (4, DTYPES["float16"][0])
    assert struct.unpack_from("<4I", data, 68) == (2, 2, 4, 4)
    assert struct.unpack_from("<QQ", data, 84) == (256, GOLDEN_PAYLOAD_CHECKSUM)
    assert struct.unpack_from("<4I", data, 100) == (1, 2, 3, 4)
    assert struct.unpack_from("<Q", data, 116) == (xxhash.xxh3_64_intdigest(data[:116]),)
    assert xxhash.xxh3_64_intdigest(TINY_PAYLOAD) == GOLDEN_PAYLOAD_CHECKSUM


def test_golden_second_page_key() -> None:
    first = _tiny_header()
    second = make_header(TINY, first.key, [5, 6, 7, 8], TINY_PAYLOAD)
    assert second.key.hex() == GOLDEN_SECOND_KEY
    assert second.parent == first.key


# ---- round trips -------------------------------------------------------------------------------

_dim = st.integers(min_value=1, max_value=(1 << 20) - 1)
layouts = st.builds(KVLayout, _dim, _dim, _dim, _dim)
keys16 = st.binary(min_size=16, max_size=16)
token_lists = st.lists(st.integers(0, U32_MAX), max_size=64).map(tuple)


def headers(payload_bytes: st.SearchStrategy[int] | None = None) -> st.SearchStrategy[PageHeader]:
    return st.builds(
        PageHeader,
        scope_digest=keys16,
        key=keys16,
        parent=keys16,
        tokens=token_lists,
        dtype=st.sampled_from(sorted(DTYPES)),
        layout=layouts,
        payload_bytes=payload_bytes if payload_bytes is not None else st.integers(0, U64_MAX),
        payload_checksum=st.integers(0, U64_MAX),
    )


@settings(max_examples=300, deadline=None)
@given(header=headers())
def test_header_round_trip(header: PageHeader) -> None:
    data = header.encode()
    assert len(data) == header.header_bytes == header_bytes_for(len(header.tokens))
    assert PageHeader.decode(data) == header
    # decode reads the header at the start of a longer buffer too, from any buffer type
    assert PageHeader.decode(bytearray(data + b"payload")) == header
    assert PageHeader.decode(memoryview(data + b"payload")) == header


@st.composite
def pages(draw: st.DrawFn) -> tuple[PageHeader, bytes]:
    payload = draw(st.binary(max_size=512))
    header = draw(headers(payload_bytes=st.just(len(payload))))
    header = dataclasses.replace(header, payload_checksum=payload_checksum(payload))
    return header, payload


@settings(max_examples=300, deadline=None)
@given(page=pages())
def test_page_round_trip(page: tuple[PageHeader, bytes]) -> None:
    header, payload = page
    data = encode_page(header, payload)
    assert len(data) == header.total_bytes
    for buffer in (data, bytearray(data), memoryview(data)):
        back, body = decode_page(buffer)
        assert back == header
        assert isinstance(body, memoryview)
        assert bytes(body) == payload


def test_encode_page_accepts_typed_buffers() -> None:
    import array

    floats = array.array("f", [0.5] * 64)  # 256 bytes, itemsize 4
    header = make_header(TINY, TINY.digest, TINY_TOKENS, floats)
    data = encode_page(header, floats)
    _, body = decode_page(data)
    assert bytes(body) == floats.tobytes()
    assert header.payload_checksum == xxhash.xxh3_64_intdigest(floats.tobytes())


# ---- corruption --------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(page=pages(), data=st.data())
def test_any_single_byte_flip_is_detected(
    page: tuple[PageHeader, bytes], data: st.DataObject
) -> None:
    header, payload = page
    stored = bytearray(encode_page(header, payload))
    pos = data.draw(st.integers(0, len(stored) - 1), label="position")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    stored[pos] ^= mask
    with pytest.raises(Corrupt):
        decode_page(bytes(stored))


def test_every_byte_flip_of_the_golden_page_is_detected() -> None:
    stored = encode_page(_tiny_header(), TINY_PAYLOAD)
    for pos in range(len(stored)):
        for mask in (0x01, 0x80, 0xFF):
            flipped = bytearray(stored)
            flipped[pos] ^= mask
            with pytest.raises(Corrupt):
                decode_page(flipped)


def test_truncated_or_extended_pages_are_corrupt() -> None:
    stored = encode_page(_tiny_header(), TINY_PAYLOAD)
    for n in range(len(stored)):
        with pytest.raises(Corrupt):
            decode_page(stored[:n])
    with pytest.raises(Corrupt):
        decode_page(stored + b"\x00")


def test_verify_payload() -> None:
    header = _tiny_header()
    header.verify_payload(TINY_PAYLOAD)
    with pytest.raises(Corrupt, match="checksum"):
        header.verify_payload(bytes(256))
    with pytest.raises(Corrupt, match="255"):
        header.verify_payload(TINY_PAYLOAD[:255])


# ---- validate_for ------------------------------------------------------------------------------


def test_make_header_computes_key_and_checksum() -> None:
    tokens = list(range(100, 112))  # three pages of four
    payloads = [bytes([i]) * 256 for i in range(3)]
    keys = page_keys(TINY, tokens)
    parent = TINY.digest
    for i, key in enumerate(keys):
        chunk = tokens[4 * i : 4 * i + 4]
        header = make_header(TINY, parent, chunk, payloads[i])
        assert header.key == key == chain_key(parent, chunk)
        assert header.parent == parent
        assert header.scope_digest == TINY.digest
        assert header.tokens == tuple(chunk)
        assert header.dtype == "float16" and header.layout == TINY.layout
        assert header.payload_bytes == 256 == TINY.page_payload_bytes
        assert header.payload_checksum == xxhash.xxh3_64_intdigest(payloads[i])
        assert header.validate_for(TINY) is None
        parent = header.key


def test_make_headers_builds_what_make_header_builds_field_for_field() -> None:
    """The batch builder sets each field itself (no dataclass __init__): every field, the
    private ones included, equals the single builder's, and each header behaves the same
    (checksum pending until read, then the payload's; the same encodings)."""
    tokens = list(range(300, 316))
    payloads = [bytes([i + 1]) * 256 for i in range(4)]
    pages = [tokens[4 * i : 4 * i + 4] for i in range(4)]
    batch = make_headers(TINY, TINY.digest, pages, payloads)
    parent = TINY.digest
    # (`_deferred_raw`, the same-host encoding, the batch builder makes at once, the single one
    # on first use: compared as encodings below)
    names = [
        f.name
        for f in dataclasses.fields(PageHeader)
        if f.name not in ("payload_checksum", "_deferred_raw")
    ]
    for chunk, payload, got in zip(pages, payloads, batch, strict=True):
        want = make_header(TINY, parent, chunk, payload)
        assert type(got) is PageHeader
        assert {n: getattr(got, n) for n in names} == {n: getattr(want, n) for n in names}
        assert got.checksum_pending and want.checksum_pending
        assert got.encode_for_same_host() == want.encode_for_same_host()
        assert got.validate_for(TINY) is None
        assert got.payload_checksum == xxhash.xxh3_64_intdigest(payload) == want.payload_checksum
        assert not got.checksum_pending and got.encode() == want.encode() and got == want
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.key = bytes(16)  # type: ignore[misc]
        parent = got.key


def test_make_header_rejects_pages_that_do_not_fit() -> None:
    with pytest.raises(InvalidArgument, match="full pages"):
        make_header(TINY, TINY.digest, [1, 2, 3], TINY_PAYLOAD)
    with pytest.raises(InvalidArgument, match="255"):
        make_header(TINY, TINY.digest, TINY_TOKENS, TINY_PAYLOAD[:255])
    with pytest.raises(InvalidArgument):
        make_header(TINY, bytes(15), TINY_TOKENS, TINY_PAYLOAD)


OTHER_SCOPE = dataclasses.replace(TINY, namespace="tenant-b")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scope_digest": OTHER_SCOPE.digest}, "scope digest"),
        ({"layout": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4)}, "layout"),
        ({"layout": KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=2)}, "layout"),
        ({"dtype": "bfloat16"}, "layout"),
        ({"dtype": "float32"}, "layout"),
        ({"tokens": (1, 2, 3)}, "full pages"),
        ({"tokens": (1, 2, 3, 4, 5)}, "full pages"),
        ({"payload_bytes": 255}, "payload"),
        ({"payload_bytes": 512}, "payload"),
        ({"key": bytes(16)}, "chain_key"),
        ({"key": chain_key(TINY.digest, [1, 2, 3, 5])}, "chain_key"),
        ({"parent": bytes(16)}, "chain_key"),
        ({"tokens": (1, 2, 4, 3)}, "chain_key"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_validate_for_rejects(change: dict[str, object], match: str) -> None:
    good = _tiny_header()
    assert good.validate_for(TINY) is None
    bad = dataclasses.replace(good, **change)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=match):
        bad.validate_for(TINY)


def test_validate_for_another_scope() -> None:
    header = _tiny_header()
    with pytest.raises(InvalidArgument, match="scope digest"):
        header.validate_for(OTHER_SCOPE)


@pytest.mark.parametrize("field", ["scope_digest", "key", "parent"])
def test_encode_rejects_keys_of_the_wrong_size(field: str) -> None:
    header = dataclasses.replace(_tiny_header(), **{field: b"short"})
    with pytest.raises(InvalidArgument):
        header.encode()


def test_quick_check_agrees_with_decode_and_validate() -> None:
    """The daemon's byte-level fast path accepts exactly the headers the full path accepts."""
    from client.contract.page import quick_check

    scope = Scope("m", "w", "t", "float16", KVLayout(2, 2, 8, 4))
    other = Scope("m", "w", "t", "float16", KVLayout(2, 2, 8, 4), namespace="other")
    payload = bytes(range(256)) * (scope.page_payload_bytes // 256)
    header = make_header(scope, scope.digest, [1, 2, 3, 4], payload)
    raw = header.encode()
    assert quick_check(raw, scope) == (header.key, header.parent)
    assert quick_check(raw, other) is None  # another scope's page
    for i in range(len(raw)):  # any flipped byte: the fast path refuses, as decode+validate do
        flipped = bytearray(raw)
        flipped[i] ^= 0x01
        assert quick_check(bytes(flipped), scope) is None
    assert quick_check(raw[:-1], scope) is None
