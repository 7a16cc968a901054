"""The page codec (DESIGN §4): a versioned header in front of a page-first KV payload.

Header, little-endian, `HEADER_FIXED_BYTES + 4 * token_count + 8` bytes:

    magic "SKVP" | version u16 | flags u16 | header_bytes u32
    scope digest 16 | key 16 | parent key 16
    token_count u32 | dtype code u8 | 3 reserved
    num_layers u32 | num_kv_heads u32 | head_dim u32 | page_tokens u32
    payload_bytes u64 | payload xxh3-64 u64
    token ids u32 x token_count
    header xxh3-64 u64 (over every header byte before it)

The header has its own checksum as well as the payload's, so a flipped byte anywhere in a stored
page is detected. A reader also checks that the key really is `chain_key(parent, tokens)` and that
the scope digest is the one it asked for: a hash collision yields a miss, never wrong KV.

Flags: bit 0 (`FLAG_CHECKSUM_DEFERRED`) says the payload checksum is left to the daemon (the field
is then zero). Only a same-host put sends such a header: its payload is copied into the daemon's
DRAM by the writer itself, so the daemon computes the checksum off the writer's path (before the
page leaves DRAM for SSD or the network) and stores the header with it (`seal_header`). Every
other flag bit is zero.

Headers built here (`make_header`, and so `build_pages`) compute the payload checksum on first
use: reading `payload_checksum`, `encode()`, comparing or hashing the header computes it (from the
payload the header was built for), so a remote put pays for it inside the put, as it always did,
and a same-host put never does (`encode_for_same_host`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    pack_tokens,
)

MAGIC = b"SKVP"
VERSION = 1
FLAG_CHECKSUM_DEFERRED = 1  # the payload checksum is left to the daemon (same-host puts only)
_FIXED = struct.Struct("<4sHHI16s16s16sIB3xIIIIQQ")
HEADER_FIXED_BYTES = _FIXED.size
_TAIL = struct.Struct("<Q")
_CHECKSUM_AT = HEADER_FIXED_BYTES - 8  # where the payload checksum field starts

Buffer = bytes | bytearray | memoryview


def header_bytes_for(token_count: int) -> int:
    """Encoded header size for a page of `token_count` tokens."""
    return HEADER_FIXED_BYTES + 4 * token_count + _TAIL.size


def payload_checksum(payload: Buffer) -> int:
    """xxh3-64 of a payload (any contiguous buffer)."""
    return int(xxhash.xxh3_64_intdigest(payload))


@dataclass(frozen=True, slots=True, eq=False)
class PageHeader:
    """Decoded page header. Immutable; `encode()` gives its exact wire bytes.

    Two headers are equal when they describe the same page (scope, key, parent, tokens, KV
    format, size) with the same payload checksum — or when one of them left its checksum to the
    daemon (`checksum_deferred`: it knows none, so it does not tell the two apart)."""

    scope_digest: bytes
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    dtype: str
    layout: KVLayout
    payload_bytes: int
    payload_checksum: int
    # True: the payload checksum was left to the daemon and is not known (`payload_checksum` 0)
    checksum_deferred: bool = False
    # the encoded bytes, when known (decoded or built here); never part of equality
    _raw: bytes = field(default=b"", init=False, compare=False, repr=False)
    # the digest of the scope this (immutable) header last passed `validate_for` against
    _valid_for: bytes = field(default=b"", init=False, compare=False, repr=False)
    # the payload whose checksum is still to be computed (headers built by `make_header`)
    _payload: Buffer | None = field(default=None, init=False, compare=False, repr=False)
    # the token ids as little-endian u32, when known
    _token_bytes: bytes = field(default=b"", init=False, compare=False, repr=False)
    # the same-host form (checksum left to the daemon) of a pending header, when built
    _deferred_raw: bytes = field(default=b"", init=False, compare=False, repr=False)

    if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt attribute stays an error

        def __getattr__(self, name: str) -> int:
            """Reached only for a field that is not set: the payload checksum of a header built
            by `make_header` before anything needed it. Computed now, once."""
            if name != "payload_checksum":
                raise AttributeError(name)
            payload = object.__getattribute__(self, "_payload")
            if payload is None:
                raise AttributeError(name)
            value = payload_checksum(payload)
            object.__setattr__(self, "payload_checksum", value)
            object.__setattr__(self, "_payload", None)
            return value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PageHeader):
            return NotImplemented
        if (
            self.key != other.key
            or self.parent != other.parent
            or self.scope_digest != other.scope_digest
            or self.tokens != other.tokens
            or self.dtype != other.dtype
            or self.layout != other.layout
            or self.payload_bytes != other.payload_bytes
        ):
            return False
        if self.checksum_deferred or other.checksum_deferred:
            return True
        return self.payload_checksum == other.payload_checksum

    def __hash__(self) -> int:
        return hash((self.key, self.parent, self.scope_digest, self.payload_bytes))

    @property
    def checksum_pending(self) -> bool:
        """True while this header's payload checksum has not been computed yet (a header built
        by `make_header` that nothing has encoded, compared or asked for its checksum)."""
        return self._payload is not None

    @property
    def header_bytes(self) -> int:
        return header_bytes_for(len(self.tokens))

    @property
    def total_bytes(self) -> int:
        """Header plus payload: the bytes of the page as stored on SSD."""
        return self.header_bytes + self.payload_bytes

    def encode(self) -> bytes:
        """The exact header bytes (computing the payload checksum if it is still pending);
        raises InvalidArgument on a digest or key of the wrong size."""
        if self._raw:
            return self._raw
        if self.checksum_deferred:
            raw = self._pack(0, FLAG_CHECKSUM_DEFERRED)
        else:
            raw = self._pack(self.payload_checksum, 0)
        object.__setattr__(self, "_raw", raw)
        return raw

    def encode_for_same_host(self) -> bytes:
        """The header bytes a same-host put sends: while the payload checksum is still pending,
        with it left to the daemon (`FLAG_CHECKSUM_DEFERRED`: nothing hashes the payload here);
        otherwise `encode()`."""
        if self._payload is None or self._raw:
            return self.encode()
        return self._deferred_raw or self._pack(0, FLAG_CHECKSUM_DEFERRED)

    def _pack(self, checksum: int, flags: int) -> bytes:
        for name in ("scope_digest", "key", "parent"):
            if len(getattr(self, name)) != KEY_BYTES:
                raise InvalidArgument(f"PageHeader.{name} must be {KEY_BYTES} bytes")
        lay = self.layout
        count = len(self.tokens)
        tokens = self._token_bytes or _tokens_struct(count).pack(*self.tokens)
        body = (
            _FIXED.pack(
                MAGIC,
                VERSION,
                flags,
                header_bytes_for(count),
                self.scope_digest,
                self.key,
                self.parent,
                count,
                dtype_code(self.dtype),
                lay.num_layers,
                lay.num_kv_heads,
                lay.head_dim,
                lay.page_tokens,
                self.payload_bytes,
                checksum,
            )
            + tokens
        )
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
            flags,
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
        if flags & ~FLAG_CHECKSUM_DEFERRED or any(view[65:68]):
            # unknown flags and reserved bytes are zero: a header that validates is
            # byte-identical to the one make_header builds (and to what quick_check accepts)
            raise Corrupt("page header reserved bytes are not zero")
        deferred = bool(flags & FLAG_CHECKSUM_DEFERRED)
        if deferred and checksum:
            raise Corrupt("page header leaves its payload checksum to the daemon but holds one")
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
            checksum_deferred=deferred,
        )
        object.__setattr__(header, "_raw", bytes(raw))
        return header

    def verify_payload(self, payload: Buffer) -> None:
        """Raise Corrupt unless `payload` has this header's length and checksum (a header whose
        checksum was left to the daemon and never computed verifies nothing: Corrupt)."""
        n = memoryview(payload).nbytes
        if n != self.payload_bytes:
            raise Corrupt(f"payload is {n} bytes, header says {self.payload_bytes}")
        if self.checksum_deferred:
            raise Corrupt("the page's payload checksum was never computed")
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
        if self._token_bytes and len(self.parent) == KEY_BYTES:
            return key_digest(self.parent + self._token_bytes)
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


_EXPECTED: dict[bytes, tuple[bytes, bytes, bytes, int]] = {}


def _expected_bytes(scope: Scope) -> tuple[bytes, bytes, bytes, int]:
    """(bytes 0:28, the same with the checksum left to the daemon, bytes 60:92, header length)
    of every full-page header of `scope`."""
    found = _EXPECTED.get(scope.digest)
    if found is None:
        lay = scope.layout
        count = lay.page_tokens
        size = header_bytes_for(count)
        head = struct.pack("<4sHHI16s", MAGIC, VERSION, 0, size, scope.digest)
        deferred = struct.pack(
            "<4sHHI16s", MAGIC, VERSION, FLAG_CHECKSUM_DEFERRED, size, scope.digest
        )
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
        found = (head, deferred, middle, size)
        if len(_EXPECTED) < 4096:
            _EXPECTED[scope.digest] = found
    return found


_NO_CHECKSUM = bytes(8)


def quick_check(raw: bytes, scope: Scope) -> tuple[bytes, bytes] | None:
    """(key, parent) of `raw` if it is, byte for byte, a valid full-page header of `scope` (header
    checksum, scope digest, dtype, layout, token count, payload size, key = chain_key(parent,
    tokens)); None otherwise — then `PageHeader.decode` + `validate_for` say precisely why.

    A header whose payload checksum is left to the daemon (`FLAG_CHECKSUM_DEFERRED`, checksum
    field zero) passes too: `checksum_deferred(raw)` tells them apart. The same checks as decoding
    and validating, without building objects: the daemon runs it on every page it is asked to
    store.
    """
    head, deferred, middle, size = _expected_bytes(scope)
    if len(raw) != size or raw[60:92] != middle:
        return None
    first = raw[:28]
    if first != head and (
        first != deferred or raw[_CHECKSUM_AT:HEADER_FIXED_BYTES] != _NO_CHECKSUM
    ):
        return None
    body = size - _TAIL.size
    if xxhash.xxh3_64_intdigest(raw[:body]) != int.from_bytes(raw[body:], "little"):
        return None
    key, parent = raw[28:44], raw[44:60]
    if key_digest(parent + raw[HEADER_FIXED_BYTES:body]) != key:
        return None
    return key, parent


def checksum_deferred(raw: bytes) -> bool:
    """Whether header bytes that passed `quick_check` leave the payload checksum to the daemon."""
    return raw[6] == FLAG_CHECKSUM_DEFERRED


def checked_payload_checksum(raw: bytes) -> int:
    """The payload checksum field of header bytes that passed `quick_check` (0 when deferred)."""
    return int.from_bytes(raw[_CHECKSUM_AT:HEADER_FIXED_BYTES], "little")


def seal_header(raw: bytes, checksum: int) -> bytes:
    """Header bytes that passed `quick_check` (or decode), with the payload checksum `checksum`
    filled in and the deferred flag cleared: the header the daemon stores for a same-host put
    once it has checksummed the payload. The header checksum is recomputed; every other byte is
    kept."""
    body_end = len(raw) - _TAIL.size
    body = b"".join(
        (
            raw[:6],
            b"\0\0",
            raw[8:_CHECKSUM_AT],
            checksum.to_bytes(8, "little"),
            raw[HEADER_FIXED_BYTES:body_end],
        )
    )
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def make_header(scope: Scope, parent: bytes, tokens: Sequence[int], payload: Buffer) -> PageHeader:
    """Build the header of the page that follows `parent` (the scope digest for the first page).

    Computes the key; the payload checksum is computed on first use (see the module docstring),
    from `payload`, which the header keeps until then. Raises InvalidArgument if the page does
    not fit the scope's layout.
    """
    header = _pending_header(
        scope, parent, pack_tokens(tokens), tuple(tokens), memoryview(payload).nbytes, payload
    )
    header.validate_for(scope)
    return header


def _set_fields(
    header: PageHeader,
    scope_digest: bytes,
    key: bytes,
    parent: bytes,
    tokens: tuple[int, ...],
    dtype: str,
    layout: KVLayout,
    payload_bytes: int,
    payload: Buffer,
    token_bytes: bytes,
    deferred_raw: bytes,
) -> None:
    """Set the fields of a new, pending PageHeader (from `object.__new__`): what the frozen
    dataclass's __init__ sets, without the defaults it would set first and `make_headers` then
    replace; `payload_checksum` stays unset (computed by __getattr__ when first read) and
    `_valid_for` is the scope's digest (built to fit: validate_for holds)."""
    put = object.__setattr__
    put(header, "scope_digest", scope_digest)
    put(header, "key", key)
    put(header, "parent", parent)
    put(header, "tokens", tokens)
    put(header, "dtype", dtype)
    put(header, "layout", layout)
    put(header, "payload_bytes", payload_bytes)
    put(header, "checksum_deferred", False)
    put(header, "_raw", b"")
    put(header, "_valid_for", scope_digest)
    put(header, "_payload", payload)
    put(header, "_token_bytes", token_bytes)
    put(header, "_deferred_raw", deferred_raw)


def make_headers(
    scope: Scope, parent: bytes, token_pages: Sequence[Sequence[int]], payloads: Sequence[Buffer]
) -> list[PageHeader]:
    """`make_header` for consecutive pages: page i has `token_pages[i]` and `payloads[i]`, the
    first follows `parent`. Checks the sizes once per batch; each key is hashed once. Raises
    InvalidArgument (nothing built) for a page that does not fit the scope's layout."""
    if len(token_pages) != len(payloads):
        raise InvalidArgument(f"{len(token_pages)} token pages for {len(payloads)} payloads")
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    lay = scope.layout
    size = scope.page_payload_bytes
    count = lay.page_tokens
    for i, (tokens, payload) in enumerate(zip(token_pages, payloads, strict=True)):
        if len(tokens) != count:
            raise InvalidArgument(
                f"page {i} has {len(tokens)} tokens; only full pages of {count} are stored"
            )
        n = memoryview(payload).nbytes
        if n != size:
            raise InvalidArgument(f"payload is {n} bytes; scope layout needs {size}")
    digest, dtype = scope.digest, scope.kv_dtype
    _, deferred, middle, _ = _expected_bytes(scope)
    pack = _tokens_struct(count).pack
    join, checksum, tail = b"".join, xxhash.xxh3_64_intdigest, _TAIL.pack
    new, cls = object.__new__, PageHeader
    out: list[PageHeader] = []
    for tokens, payload in zip(token_pages, payloads, strict=True):
        try:
            packed = pack(*tokens)
        except struct.error:
            packed = pack_tokens(tokens)  # raises InvalidArgument naming the bad id
        key = key_digest(parent + packed)
        # its same-host form, from the scope's fixed bytes (what `_pack` gives, without it)
        body = join((deferred, key, parent, middle, _NO_CHECKSUM, packed))
        header = new(cls)
        _set_fields(
            header, digest, key, parent, tuple(tokens), dtype, lay, size, payload, packed,
            body + tail(checksum(body)),
        )  # fmt: skip
        out.append(header)
        parent = key
    return out


def _pending_header(
    scope: Scope,
    parent: bytes,
    packed: bytes,
    tokens: tuple[int, ...],
    size: int,
    payload: Buffer,
) -> PageHeader:
    """A header whose payload checksum is computed from `payload` on first use."""
    header = PageHeader(
        scope_digest=scope.digest,
        key=key_digest(parent + packed) if len(parent) == KEY_BYTES else chain_key(parent, tokens),
        parent=parent,
        tokens=tokens,
        dtype=scope.kv_dtype,
        layout=scope.layout,
        payload_bytes=size,
        payload_checksum=0,
    )
    object.__setattr__(header, "_token_bytes", packed)
    object.__setattr__(header, "_payload", payload)
    object.__delattr__(header, "payload_checksum")  # computed by __getattr__ when first read
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
