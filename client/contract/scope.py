"""Scopes and page keys: the contract every component shares (DESIGN §3).

A `Scope` names everything that makes two KV pages interchangeable: model, weights, tokenizer,
adapter, KV dtype and layout, shard and tenant namespace. Its digest is BLAKE2b truncated to 128
bits over a canonical, field-tagged, length-prefixed encoding, so no two fields can ever collide.

Page key i is `BLAKE2b-128(k_{i-1} ‖ tokens of page i as little-endian uint32)`, with `k_-1` the
scope digest. Both hashes are collision-resistant (key schema 2): a chosen-input adversary cannot
build two token lists with one key, nor a scope whose digest is another tenant's. Schema 1 used
xxh3-128, which is fast but not collision-resistant; its keys are refused. The two hashes are
domain-separated by BLAKE2b's personalization, so a scope encoding and a page's key input can
never be confused. Nothing here is seeded per process: keys are stable across processes, hosts
and restarts, and golden-vector tests pin them (tests/unit/test_scope.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from client.contract.errors import InvalidArgument

KEY_BYTES = 16
KEY_SCHEMA_VERSION = 2
_SCOPE_PERSON = b"strata-scope-v2"
_KEY_PERSON = b"strata-key-v2"

# KV dtypes a page may hold, with their element size in bytes. The code is what page headers carry.
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "int8": (6, 1),
}
DTYPE_BY_CODE: dict[int, str] = {code: name for name, (code, _) in DTYPES.items()}

_MAX_TOKEN_ID = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one page: `[num_layers][K,V][page_tokens][num_kv_heads][head_dim]`, page-first."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 1 << 20:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, got {value!r}")

    def payload_bytes(self, dtype: str) -> int:
        """Bytes of one full page's payload in `dtype`."""
        return (
            self.num_layers
            * 2
            * self.page_tokens
            * self.num_kv_heads
            * self.head_dim
            * dtype_size(dtype)
        )


def dtype_size(dtype: str) -> int:
    """Element size of a KV dtype; raises InvalidArgument for an unknown one."""
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise InvalidArgument(f"unknown KV dtype {dtype!r}; known: {sorted(DTYPES)}") from None


def dtype_code(dtype: str) -> int:
    """The one-byte code a page header uses for `dtype`."""
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise InvalidArgument(f"unknown KV dtype {dtype!r}; known: {sorted(DTYPES)}") from None


# Field tags of the canonical encoding. Never reuse or renumber a tag; add new ones at the end.
_TAG_SCHEMA = 1
_TAG_MODEL = 2
_TAG_WEIGHTS = 3
_TAG_TOKENIZER = 4
_TAG_ADAPTER_ID = 5
_TAG_ADAPTER_FP = 6
_TAG_DTYPE = 7
_TAG_LAYOUT = 8
_TAG_SHARD = 9
_TAG_NAMESPACE = 10

_SCOPE_MAGIC = b"STRATA-SCOPE"


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of the model's KV this process holds (tensor- and pipeline-parallel)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_stage < self.pp_size):
            raise InvalidArgument(f"invalid shard {self}")


@dataclass(frozen=True, slots=True)
class Scope:
    """Everything that makes two KV pages interchangeable. Frozen; hashable; digest is cached.

    `adapter_id` / `adapter_fingerprint` are empty strings when no adapter (LoRA) is applied.
    `namespace` isolates tenants (or a per-request cache salt) from one another.
    """

    model_id: str
    weights_revision: str
    tokenizer_fingerprint: str
    kv_dtype: str
    layout: KVLayout
    adapter_id: str = ""
    adapter_fingerprint: str = ""
    shard: Shard = field(default_factory=Shard)
    namespace: str = ""
    key_schema_version: int = KEY_SCHEMA_VERSION
    _digest: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("Scope.model_id must not be empty")
        dtype_size(self.kv_dtype)
        if self.key_schema_version != KEY_SCHEMA_VERSION:
            raise InvalidArgument(
                f"key schema version {self.key_schema_version} is not supported "
                f"(this build speaks {KEY_SCHEMA_VERSION})"
            )
        if bool(self.adapter_id) != bool(self.adapter_fingerprint):
            raise InvalidArgument("an adapter needs both adapter_id and adapter_fingerprint")
        object.__setattr__(self, "_digest", scope_digest(self.encode()))

    def encode(self) -> bytes:
        """The canonical encoding: magic, then (tag u16, length u32, value) per field, in tag order."""
        lay = self.layout
        sh = self.shard
        fields: list[tuple[int, bytes]] = [
            (_TAG_SCHEMA, struct.pack("<I", self.key_schema_version)),
            (_TAG_MODEL, _utf8(self.model_id, "model_id")),
            (_TAG_WEIGHTS, _utf8(self.weights_revision, "weights_revision")),
            (_TAG_TOKENIZER, _utf8(self.tokenizer_fingerprint, "tokenizer_fingerprint")),
            (_TAG_ADAPTER_ID, _utf8(self.adapter_id, "adapter_id")),
            (_TAG_ADAPTER_FP, _utf8(self.adapter_fingerprint, "adapter_fingerprint")),
            (_TAG_DTYPE, _utf8(self.kv_dtype, "kv_dtype")),
            (
                _TAG_LAYOUT,
                struct.pack("<4I", lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_tokens),
            ),
            (_TAG_SHARD, struct.pack("<4I", sh.tp_rank, sh.tp_size, sh.pp_stage, sh.pp_size)),
            (_TAG_NAMESPACE, _utf8(self.namespace, "namespace")),
        ]
        parts = [_SCOPE_MAGIC]
        for tag, value in fields:
            parts.append(struct.pack("<HI", tag, len(value)))
            parts.append(value)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> Scope:
        """Inverse of `encode`; raises InvalidArgument on anything malformed or unknown."""
        if not data.startswith(_SCOPE_MAGIC):
            raise InvalidArgument("scope encoding: bad magic")
        pos = len(_SCOPE_MAGIC)
        values: dict[int, bytes] = {}
        while pos < len(data):
            if pos + 6 > len(data):
                raise InvalidArgument("scope encoding: truncated field header")
            tag, length = struct.unpack_from("<HI", data, pos)
            pos += 6
            if pos + length > len(data):
                raise InvalidArgument("scope encoding: truncated field value")
            if tag in values:
                raise InvalidArgument(f"scope encoding: duplicate tag {tag}")
            values[tag] = data[pos : pos + length]
            pos += length
        expected = set(range(_TAG_SCHEMA, _TAG_NAMESPACE + 1))
        if set(values) != expected:
            raise InvalidArgument(f"scope encoding: tags {sorted(values)} != {sorted(expected)}")
        try:
            (schema,) = struct.unpack("<I", values[_TAG_SCHEMA])
            layout = KVLayout(*struct.unpack("<4I", values[_TAG_LAYOUT]))
            shard = Shard(*struct.unpack("<4I", values[_TAG_SHARD]))
            scope = cls(
                model_id=values[_TAG_MODEL].decode(),
                weights_revision=values[_TAG_WEIGHTS].decode(),
                tokenizer_fingerprint=values[_TAG_TOKENIZER].decode(),
                adapter_id=values[_TAG_ADAPTER_ID].decode(),
                adapter_fingerprint=values[_TAG_ADAPTER_FP].decode(),
                kv_dtype=values[_TAG_DTYPE].decode(),
                layout=layout,
                shard=shard,
                namespace=values[_TAG_NAMESPACE].decode(),
                key_schema_version=schema,
            )
        except (struct.error, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"scope encoding: {exc}") from None
        if scope.encode() != data:
            raise InvalidArgument("scope encoding is not canonical")
        return scope

    @property
    def digest(self) -> bytes:
        """16-byte BLAKE2b-128 digest of the canonical encoding (personalized `strata-scope-v2`)."""
        return self._digest

    @property
    def page_payload_bytes(self) -> int:
        """Payload bytes of one full page in this scope."""
        return self.layout.payload_bytes(self.kv_dtype)


# A namespace "<base>#<anything>" is a sub-namespace of <base> (the router's cache_salt pages live
# under "<tenant namespace>#<salt digest>"): a store principal's rights and a [[quota]] of
# <base> cover it (kvstore/auth.py, kvstore/quota.py); its pages stay apart from <base>'s.
SUB_NAMESPACE_SEPARATOR = "#"


def base_namespace(namespace: str) -> str:
    """The namespace `namespace` is a sub-namespace of: what precedes its first "#", else
    `namespace` itself. Pure."""
    return namespace.partition(SUB_NAMESPACE_SEPARATOR)[0]


def _utf8(text: str, name: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidArgument(f"Scope.{name} must be a str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"Scope.{name} is not encodable as UTF-8: {exc.reason}") from None


def _tokens_le(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next(
            (t for t in tokens if not (isinstance(t, int) and 0 <= t <= _MAX_TOKEN_ID)), None
        )
        raise InvalidArgument(f"token ids must be uint32, got {bad!r}") from None


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, as keys hash them; raises InvalidArgument otherwise."""
    return _tokens_le(tokens)


def scope_digest(encoding: bytes) -> bytes:
    """BLAKE2b-128 of a scope's canonical encoding, personalized apart from page keys."""
    return hashlib.blake2b(encoding, digest_size=KEY_BYTES, person=_SCOPE_PERSON).digest()


def key_digest(parent_and_tokens: bytes) -> bytes:
    """BLAKE2b-128 of `parent key ‖ little-endian uint32 token ids`: a page key (schema 2)."""
    return hashlib.blake2b(parent_and_tokens, digest_size=KEY_BYTES, person=_KEY_PERSON).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page whose predecessor key (or scope digest, for the first page) is `parent`."""
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    return key_digest(parent + _tokens_le(tokens))


def page_keys(scope: Scope, token_ids: Sequence[int]) -> list[bytes]:
    """Keys of every *full* page of `token_ids` under `scope`; a partial tail page gets no key."""
    page = scope.layout.page_tokens
    keys: list[bytes] = []
    parent = scope.digest
    for start in range(0, len(token_ids) - page + 1, page):
        parent = chain_key(parent, token_ids[start : start + page])
        keys.append(parent)
    return keys


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Concatenate 16-byte keys for the wire; raises InvalidArgument on a key of the wrong size."""
    if set(map(len, keys)) - {KEY_BYTES}:
        bad = next(len(k) for k in keys if len(k) != KEY_BYTES)
        raise InvalidArgument(f"page keys are {KEY_BYTES} bytes, got one of {bad}")
    return b"".join(keys)


def unpack_keys(packed: bytes) -> list[bytes]:
    """Split a packed key field; raises InvalidArgument when its length is not a multiple of 16."""
    if len(packed) % KEY_BYTES:
        raise InvalidArgument(f"packed keys length {len(packed)} is not a multiple of {KEY_BYTES}")
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]
