"""The page codec (DESIGN §4): a versioned header in front of a page-first KV payload.

Header, little-endian, `HEADER_FIXED_BYTES + 4 * token_count + 8` bytes:

    magic "SKVP" | version u16 | reserved u16 | header_bytes u32
    scope digest 16 | key 16 | parent key 16
    token_count u32 | dtype code u8 | 3 reserved
    num_layers u32 | num_kv_heads u32 | head_dim u32 | page_tokens u32
    payload_bytes u64 | payload xxh3-64 u64
    token ids u32 x token_count
    header xxh3-64 u64 (over every header byte before it)

The header has its own checksum as well as the payload's, so a flipped byte anywhere in a stored
page is detected. A reader also checks that the key really is `chain_key(parent, tokens)` and that
the scope digest is the one it asked for: a hash collision yields a miss, never wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from client.contract.errors import Corrupt, InvalidArgument
from client.contract.scope import (
    DTYPE_BY_CODE,
    KEY_BYTES,
    KVLayout,
    Scope,
    chain_key,
    dtype_code,
    key_digest,
)

MAGIC = b"SKVP"
VERSION = 1
_FIXED = struct.Struct("<4sHHI16s16s16sIB3xIIIIQQ")
HEADER_FIXED_BYTES = _FIXED.size
_TAIL = struct.Struct("<Q")

Buffer = bytes | bytearray | memoryview


def header_bytes_for(token_count: int) -> int:
    """Encoded header size for a page of `token_count` tokens."""
    return HEADER_FIXED_BYTES + 4 * token_count + _TAIL.size


def payload_checksum(payload: Buffer) -> int:
    """xxh3-64 of a payload (any contiguous buffer)."""
    return int(xxhash.xxh3_64_intdigest(payload))


@dataclass(frozen=True, slots=True)
class PageHeader:
    """Decoded page header. Immutable; `encode()` gives its exact wire bytes."""

    scope_digest: bytes
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    dtype: str
    layout: KVLayout
    payload_bytes: int
    payload_checksum: int
    # the encoded bytes, when known (decoded or built here); never part of equality
    _raw: bytes = field(default=b"", init=False, compare=False, repr=False)
    # the digest of the scope this (immutable) header last passed `validate_for` against
    _valid_for: bytes = field(default=b"", init=False, compare=False, repr=False)

    @property
    def header_bytes(self) -> int:
        return header_bytes_for(len(self.tokens))

    @property
    def total_bytes(self) -> int:
        """Header plus payload: the bytes of the page as stored on SSD."""
        return self.header_bytes + self.payload_bytes

    def encode(self) -> bytes:
        """The exact header bytes; raises InvalidArgument on a digest or key of the wrong size."""
        if self._raw:
            return self._raw
        for name in ("scope_digest", "key", "parent"):
            if len(getattr(self, name)) != KEY_BYTES:
                raise InvalidArgument(f"PageHeader.{name} must be {KEY_BYTES} bytes")
        lay = self.layout
        body = _FIXED.pack(
            MAGIC,
            VERSION,
            0,
            header_bytes_for(len(self.tokens)),
            self.scope_digest,
            self.key,
            self.parent,
            len(self.tokens),
            dtype_code(self.dtype),
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.page_tokens,
            self.payload_bytes,
            self.payload_checksum,
        ) + struct.pack(f"<{len(self.tokens)}I", *self.tokens)
        return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, data: Buffer) -> PageHeader:
        """Parse and verify a header at the start of `data`; raises Corrupt on any mismatch."""
        view = memoryview(data).cast("B")
        if len(view) < HEADER_FIXED_BYTES + _TAIL.size:
            raise Corrupt(f"page header truncated: {len(view)} bytes")
        (
            magic,
            version,
            _reserved,
            header_bytes,
            scope_digest,
            key,
            parent,
            token_count,
            code,
            layers,
            heads,
            head_dim,
            page_tokens,
            payload_bytes,
            checksum,
        ) = _FIXED.unpack_from(view, 0)
        if magic != MAGIC:
            raise Corrupt(f"bad page magic {bytes(magic)!r}")
        if version != VERSION:
            raise Corrupt(f"unsupported page version {version}")
        if _reserved or any(view[65:68]):
            # reserved bytes are zero: a header that validates is byte-identical to the one
            # make_header builds (and to what quick_check accepts)
            raise Corrupt("page header reserved bytes are not zero")
        if header_bytes != header_bytes_for(token_count) or header_bytes > len(view):
            raise Corrupt(f"page header length {header_bytes} does not fit {token_count} tokens")
        body_end = header_bytes - _TAIL.size
        (want,) = _TAIL.unpack_from(view, body_end)
        if xxhash.xxh3_64_intdigest(view[:body_end]) != want:
            raise Corrupt("page header checksum mismatch")
        dtype = DTYPE_BY_CODE.get(code)
        if dtype is None:
            raise Corrupt(f"unknown dtype code {code}")
        layout = _layout(layers, heads, head_dim, page_tokens)
        tokens = _tokens_struct(token_count).unpack_from(view, HEADER_FIXED_BYTES)
        raw = (
            bytes(view[:header_bytes])
            if isinstance(data, memoryview) or len(view) != header_bytes
            else data
        )
        header = cls(
            scope_digest=bytes(scope_digest),
            key=bytes(key),
            parent=bytes(parent),
            tokens=tokens,
            dtype=dtype,
            layout=layout,
            payload_bytes=payload_bytes,
            payload_checksum=checksum,
        )
        object.__setattr__(header, "_raw", bytes(raw))
        return header

    def verify_payload(self, payload: Buffer) -> None:
        """Raise Corrupt unless `payload` has this header's length and checksum."""
        n = memoryview(payload).nbytes
        if n != self.payload_bytes:
            raise Corrupt(f"payload is {n} bytes, header says {self.payload_bytes}")
        if payload_checksum(payload) != self.payload_checksum:
            raise Corrupt("payload checksum mismatch")

    def validate_for(self, scope: Scope) -> None:
        """Raise InvalidArgument unless this header is a well-formed full page of `scope`.

        Checks the scope digest, dtype and layout, the token count (only full pages are keyed),
        the payload size, and that `key == chain_key(parent, tokens)`. A header is immutable and
        a scope digest covers its layout and dtype, so a repeated check for the same scope is free.
        """
        if self._valid_for and self._valid_for == scope.digest:
            return
        if self.scope_digest != scope.digest:
            raise InvalidArgument("page scope digest does not match the request's scope")
        if self.dtype != scope.kv_dtype or self.layout != scope.layout:
            raise InvalidArgument(
                f"page layout {self.layout}/{self.dtype} does not match scope "
                f"{scope.layout}/{scope.kv_dtype}"
            )
        if len(self.tokens) != scope.layout.page_tokens:
            raise InvalidArgument(
                f"page has {len(self.tokens)} tokens; only full pages of "
                f"{scope.layout.page_tokens} are stored"
            )
        if self.payload_bytes != scope.page_payload_bytes:
            raise InvalidArgument(
                f"payload is {self.payload_bytes} bytes; scope layout needs {scope.page_payload_bytes}"
            )
        if len(self.key) != KEY_BYTES or self._chain_key() != self.key:
            raise InvalidArgument("page key is not chain_key(parent, tokens)")
        object.__setattr__(self, "_valid_for", scope.digest)

    def _chain_key(self) -> bytes:
        raw = self._raw
        if raw and len(self.parent) == KEY_BYTES:  # the token bytes are already little-endian u32
            return key_digest(
                self.parent + raw[HEADER_FIXED_BYTES : HEADER_FIXED_BYTES + 4 * len(self.tokens)]
            )
        return chain_key(self.parent, self.tokens)


_LAYOUTS: dict[tuple[int, int, int, int], KVLayout] = {}
_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def _tokens_struct(count: int) -> struct.Struct:
    found = _TOKEN_STRUCTS.get(count)
    if found is None:
        found = struct.Struct(f"<{count}I")
        if len(_TOKEN_STRUCTS) < 1024:
            _TOKEN_STRUCTS[count] = found
    return found


def _layout(layers: int, heads: int, head_dim: int, page_tokens: int) -> KVLayout:
    """Decoded layouts are few: validate each once and share the frozen value."""
    key = (layers, heads, head_dim, page_tokens)
    layout = _LAYOUTS.get(key)
    if layout is None:
        try:
            layout = KVLayout(layers, heads, head_dim, page_tokens)
        except InvalidArgument as exc:
            raise Corrupt(f"bad layout in page header: {exc}") from None
        if len(_LAYOUTS) < 4096:
            _LAYOUTS[key] = layout
    return layout


_EXPECTED: dict[bytes, tuple[bytes, bytes, int]] = {}


def _expected_bytes(scope: Scope) -> tuple[bytes, bytes, int]:
    """(bytes 0:28, bytes 60:92, header length) of every full-page header of `scope`."""
    found = _EXPECTED.get(scope.digest)
    if found is None:
        lay = scope.layout
        count = lay.page_tokens
        size = header_bytes_for(count)
        head = struct.pack("<4sHHI16s", MAGIC, VERSION, 0, size, scope.digest)
        middle = struct.pack(
            "<IB3xIIIIQ",
            count,
            dtype_code(scope.kv_dtype),
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.page_tokens,
            scope.page_payload_bytes,
        )
        found = (head, middle, size)
        if len(_EXPECTED) < 4096:
            _EXPECTED[scope.digest] = found
    return found


def quick_check(raw: bytes, scope: Scope) -> tuple[bytes, bytes] | None:
    """(key, parent) of `raw` if it is, byte for byte, a valid full-page header of `scope` (header
    checksum, scope digest, dtype, layout, token count, payload size, key = chain_key(parent,
    tokens)); None otherwise — then `PageHeader.decode` + `validate_for` say precisely why.

    The same checks as decoding and validating, without building objects: the daemon runs it on
    every page it is asked to store.
    """
    head, middle, size = _expected_bytes(scope)
    if len(raw) != size or raw[:28] != head or raw[60:92] != middle:
        return None
    body = size - _TAIL.size
    if xxhash.xxh3_64_intdigest(raw[:body]) != int.from_bytes(raw[body:], "little"):
        return None
    key, parent = raw[28:44], raw[44:60]
    if key_digest(parent + raw[HEADER_FIXED_BYTES:body]) != key:
        return None
    return key, parent


def checked_payload_checksum(raw: bytes) -> int:
    """The payload checksum field of header bytes that passed `quick_check`."""
    return int.from_bytes(raw[HEADER_FIXED_BYTES - 8 : HEADER_FIXED_BYTES], "little")


def make_header(scope: Scope, parent: bytes, tokens: Sequence[int], payload: Buffer) -> PageHeader:
    """Build the header of the page that follows `parent` (the scope digest for the first page).

    Computes the key and the payload checksum; raises InvalidArgument if the page does not fit
    the scope's layout.
    """
    header = PageHeader(
        scope_digest=scope.digest,
        key=chain_key(parent, tokens),
        parent=parent,
        tokens=tuple(tokens),
        dtype=scope.kv_dtype,
        layout=scope.layout,
        payload_bytes=memoryview(payload).nbytes,
        payload_checksum=payload_checksum(payload),
    )
    header.validate_for(scope)
    object.__setattr__(header, "_raw", header.encode())
    return header


def encode_page(header: PageHeader, payload: Buffer) -> bytes:
    """Header bytes followed by the payload: the stored form of a page."""
    return header.encode() + bytes(memoryview(payload).cast("B"))


def decode_page(data: Buffer) -> tuple[PageHeader, memoryview]:
    """Split and verify a stored page; raises Corrupt if the header or payload fails."""
    header = PageHeader.decode(data)
    view = memoryview(data).cast("B")
    payload = view[header.header_bytes :]
    header.verify_payload(payload)
    return header, payload
