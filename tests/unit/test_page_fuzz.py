"""Fuzzing the page codec with hypothesis: random bytes, mutated valid pages, and headers whose
fields an adversary rewrote and re-checksummed (xxh3 is not keyed: anyone can recompute it).

Properties:
- `PageHeader.decode` and `decode_page` raise nothing but `Corrupt`; `validate_for` nothing but
  `InvalidArgument`; `quick_check` never raises;
- a header validates for a scope only if its bytes are exactly those of the valid header of the
  same (parent, tokens, payload checksum): the one `make_header` builds;
- `quick_check` (what the daemon runs on every put) accepts exactly what decode + validate
  accept.

The example counts keep this file to a few seconds; `STRATA_FUZZ_EXAMPLES=N` raises them for a
longer campaign (`strata fuzz` runs the coverage-guided one).
"""

from __future__ import annotations

import contextlib
import os
import struct

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.contract.errors import Corrupt, InvalidArgument
from client.contract.page import (
    HEADER_FIXED_BYTES,
    PageHeader,
    decode_page,
    encode_page,
    header_bytes_for,
    make_header,
    quick_check,
)
from client.contract.scope import KVLayout, Scope, chain_key

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("STRATA_FUZZ_EXAMPLES"),
    suppress_health_check=list(HealthCheck),
)

SCOPE = Scope(
    model_id="fuzz",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=4),
)
OTHER = Scope(
    model_id="fuzz",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=4),
    namespace="tenant-b",
)
PAYLOAD_BYTES = SCOPE.page_payload_bytes
_TAIL = 8
HEADER_BYTES = header_bytes_for(SCOPE.layout.page_tokens)


def reseal(raw: bytes) -> bytes:
    """`raw` with its header checksum recomputed (what an adversary can always do)."""
    size = len(raw)
    body = raw[: size - _TAIL]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def valid_page(draw: st.DrawFn) -> tuple[PageHeader, bytes]:
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4))
    parent = draw(st.one_of(st.just(SCOPE.digest), st.binary(min_size=16, max_size=16)))
    payload = draw(st.binary(min_size=PAYLOAD_BYTES, max_size=PAYLOAD_BYTES))
    return make_header(SCOPE, parent, tokens, payload), payload


@st.composite
def valid_pages(draw: st.DrawFn) -> tuple[PageHeader, bytes]:
    return valid_page(draw)


def canonical(header: PageHeader) -> bytes:
    """The bytes of the valid header with `header`'s parent, tokens and payload checksum."""
    return PageHeader(
        scope_digest=SCOPE.digest,
        key=chain_key(header.parent, header.tokens),
        parent=header.parent,
        tokens=header.tokens,
        dtype=SCOPE.kv_dtype,
        layout=SCOPE.layout,
        payload_bytes=PAYLOAD_BYTES,
        payload_checksum=header.payload_checksum,
    ).encode()


def judge(raw: bytes) -> bool:
    """Decode and validate `raw` (a header, maybe followed by more bytes) as an adversary's page:
    only the codec's typed errors, and acceptance only of a byte-exact valid header. Returns
    whether it was accepted."""
    accepted = False
    try:
        header = PageHeader.decode(raw)
    except Corrupt:
        header = None
    if header is not None:
        try:
            header.validate_for(SCOPE)
            accepted = True
        except InvalidArgument:
            pass
        if accepted:
            assert raw[: header.header_bytes] == canonical(header) == header.encode()
            with pytest.raises(InvalidArgument):
                PageHeader.decode(raw).validate_for(OTHER)  # never another namespace's page
    quick = quick_check(bytes(raw[:HEADER_BYTES]), SCOPE)
    assert (quick is not None) == accepted, (raw.hex(), quick)
    if quick is not None and header is not None:
        assert quick == (header.key, header.parent)
    with contextlib.suppress(Corrupt):
        decode_page(raw)
    return accepted


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_never_crash_and_never_validate(raw: bytes) -> None:
    assert not judge(raw)


@FUZZ
@given(
    valid_pages(),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    st.booleans(),
)
def test_mutated_pages_validate_only_when_unchanged(
    page: tuple[PageHeader, bytes], edits: list[tuple[int, int]], sealed: bool
) -> None:
    header, payload = page
    original = header.encode()
    raw = bytearray(original)
    for position, value in edits:
        raw[position % len(raw)] = value
    mutated = reseal(bytes(raw)) if sealed else bytes(raw)
    accepted = judge(mutated)
    if accepted:  # only a header equal to a valid one for its own (parent, tokens) passes
        again = PageHeader.decode(mutated)
        assert mutated == canonical(again)
    if mutated == original:
        assert accepted
    # and the whole page: header mutations never pass the payload check silently
    try:
        h, body = decode_page(mutated + payload)
        assert bytes(body) == payload and h.payload_checksum == header.payload_checksum
    except Corrupt:
        pass


@FUZZ
@given(valid_pages(), st.integers(0, 600), st.binary(max_size=64), st.booleans())
def test_truncated_extended_and_spliced_pages(
    page: tuple[PageHeader, bytes], cut: int, extra: bytes, sealed: bool
) -> None:
    header, payload = page
    whole = encode_page(header, payload)
    spliced = whole[: cut % (len(whole) + 1)] + extra
    judge(reseal(spliced) if sealed and len(spliced) > _TAIL else spliced)
    try:
        h, body = decode_page(spliced)
    except Corrupt:
        return
    # a page that still decodes whole is the original page (the payload checksum holds)
    assert h.encode() == header.encode() and bytes(body)[: len(payload)] == payload


# Field rewrites an adversary would try, each re-checksummed: (offset, struct format).
FIELDS = {
    "version": (4, "<H"),
    "reserved": (6, "<H"),
    "header_bytes": (8, "<I"),
    "token_count": (60, "<I"),
    "dtype": (64, "<B"),
    "padding": (65, "<B"),
    "num_layers": (68, "<I"),
    "num_kv_heads": (72, "<I"),
    "head_dim": (76, "<I"),
    "page_tokens": (80, "<I"),
    "payload_bytes": (84, "<Q"),
}


@FUZZ
@given(valid_pages(), st.sampled_from(sorted(FIELDS)), st.integers(0, 2**64 - 1))
def test_rewritten_fields_never_validate(
    page: tuple[PageHeader, bytes], name: str, value: int
) -> None:
    header, _ = page
    offset, fmt = FIELDS[name]
    size = struct.calcsize(fmt)
    raw = bytearray(header.encode())
    old = raw[offset : offset + size]
    raw[offset : offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    if raw[offset : offset + size] == old:
        return
    assert not judge(reseal(bytes(raw))), name


@FUZZ
@given(
    valid_pages(),
    st.sampled_from(["scope_digest", "key", "parent", "tokens"]),
    st.binary(min_size=16, max_size=16),
    st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4),
)
def test_forged_keys_parents_tokens_and_scopes_never_validate(
    page: tuple[PageHeader, bytes], name: str, blob: bytes, tokens: list[int]
) -> None:
    header, _ = page
    raw = bytearray(header.encode())
    if name == "tokens":
        new = struct.pack("<4I", *tokens)
        at = HEADER_FIXED_BYTES
    else:
        new = blob
        at = {"scope_digest": 12, "key": 28, "parent": 44}[name]
    if raw[at : at + len(new)] == new:
        return
    raw[at : at + len(new)] = new
    forged = reseal(bytes(raw))
    accepted = judge(forged)
    # changing the parent alone keeps a header that is valid for *its* parent only if the key
    # was recomputed: it was not, so nothing here may pass
    assert not accepted, name
