"""Hypothesis strategies for every request message of the store's gRPC API (store.proto).

Each strategy draws a `Call` (tests/fuzz/rpc_calls.py): valid-ish and hostile field values —
scope digests and keys of the wrong length, packed keys past the daemon's limit, huge counts,
unknown and negative enum values, huge sizes and lease ids, truncated and mutated scope
encodings, page headers with a byte flipped (with and without the header checksum recomputed:
xxh3 is not keyed), a forged key, a foreign scope digest, a short or corrupted payload, Put
streams with chunks out of order, repeated, missing their header or their PutBegin, streams that
half-close early or end abruptly — and, now and then, the serialized bytes themselves truncated,
bit-flipped or replaced (what protobuf must refuse to parse).

`World` is what the fuzzer knows of the daemon: its own scope (and a second one of another
layout), and keys of pages it stored before the first case. It never knows the keys or the
scope of the legitimate tenant whose pages must stay intact.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from fuzz.rpc_calls import Call
from hypothesis import strategies as st

from client.contract.page import PageHeader, make_header
from client.contract.scope import KEY_BYTES, KVLayout, Scope
from kvstore_pb import store_pb2 as pb

FUZZ_SCOPE = Scope(
    model_id="fuzz/model",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=16),
    namespace="fuzz",
)
OTHER_SCOPE = dataclasses.replace(
    FUZZ_SCOPE, layout=KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_tokens=16)
)
# A scope of a namespace the fuzzer's token does not hold (that of the legitimate tenant, but
# not its scope: the fuzzer never learns that one). With auth on, every call naming it must be
# refused; on an open daemon it is just another scope.
FOREIGN_SCOPE = dataclasses.replace(FUZZ_SCOPE, namespace="legit")


@dataclass(frozen=True, slots=True)
class World:
    scope: Scope
    other: Scope
    known_keys: tuple[bytes, ...]  # pages of `scope` stored before fuzzing (a chain)
    max_keys: int  # the daemon's limits.max_keys_per_call
    foreign: Scope = FOREIGN_SCOPE

    def __repr__(self) -> str:  # hypothesis prints it with every failure: keep it short
        return f"World({self.scope.namespace!r}, {len(self.known_keys)} known keys)"

    @property
    def scopes(self) -> dict[bytes, Scope]:
        return {s.digest: s for s in (self.scope, self.other, self.foreign)}


def payload_of(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# ---- scalars ----------------------------------------------------------------------------------

U32_EDGES = (0, 1, 2**31 - 1, 2**31, 2**32 - 1)
U64_EDGES = (0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


def u32() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 64), st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))


def u64() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 64), st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))


def enum_value() -> st.SearchStrategy[int]:
    """A proto3 enum value: the known ones, just past them, or any int32 (enums are open)."""
    return st.one_of(st.integers(0, 4), st.sampled_from((-1, 99, 2**31 - 1, -(2**31))))


def digest(world: World) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(world.scope.digest),
        st.just(world.other.digest),
        st.just(world.foreign.digest),
        st.binary(min_size=0, max_size=40),
        st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),
    )


def key(world: World) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(world.known_keys), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)
    )


def packed_keys(world: World) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.lists(key(world), max_size=8).map(b"".join),
        st.integers(0, len(world.known_keys)).map(lambda n: b"".join(world.known_keys[:n])),
        st.binary(max_size=90),  # lengths that are not whole keys
        st.just(bytes(KEY_BYTES) * (world.max_keys + 1)),  # one key past the limit
    )


def scope_bytes(world: World) -> st.SearchStrategy[bytes]:
    good = world.scope.encode()
    return st.one_of(
        st.just(good),
        st.just(world.other.encode()),
        st.just(world.foreign.encode()),
        st.integers(0, len(good) - 1).map(lambda n: good[:n]),  # truncated
        st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
            lambda t: good[: t[0]] + bytes([good[t[0]] ^ t[1]]) + good[t[0] + 1 :]
        ),
        st.binary(max_size=64),
    )


def chain_prefix() -> st.SearchStrategy[bytes]:
    """PutBegin / ReserveRequest.chain_prefix: token ids, little-endian uint32 (or not)."""
    return st.one_of(st.just(b""), st.just(b""), st.binary(max_size=200))


def message(cls: type[Any], **fields: object) -> Any:
    """`cls(**fields)`, leaving out fields this build's store.proto does not have (fields are
    only ever added: the strategies keep working across versions)."""
    known = cls.DESCRIPTOR.fields_by_name
    present = {name: value for name, value in fields.items() if name in known}
    try:
        return cls(**present)
    except (TypeError, ValueError):  # a field whose type differs in this build: left out
        out = cls()
        for name, value in present.items():
            try:
                out.MergeFrom(cls(**{name: value}))
            except (TypeError, ValueError):
                continue
        return out


# ---- pages ------------------------------------------------------------------------------------


def reseal(raw: bytes) -> bytes:
    """`raw` with its header checksum recomputed (anyone can)."""
    if len(raw) <= 8:
        return raw
    return raw[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw[:-8]))


HEADER_EDITS = (
    "valid", "valid", "valid", "flip", "flip-reseal", "flip-reseal", "truncate", "extend",
    "forged-key", "foreign-scope", "tokens-swapped", "huge-payload", "random", "empty",
)  # fmt: skip
PAYLOAD_EDITS = ("good", "good", "good", "flip", "short", "long", "empty")


@st.composite
def page(draw: st.DrawFn, world: World, clean: bool = False) -> tuple[bytes, bytes]:
    """(raw header, payload) of one page, valid or not (`clean`: a valid page of the world's
    scope, following its scope digest or a known page)."""
    others = (world.other, world.foreign)
    scope = world.scope if clean else draw(st.sampled_from((world.scope,) * 4 + others))
    n_tokens = scope.layout.page_tokens
    tokens = draw(
        st.one_of(
            st.lists(st.integers(0, 2**32 - 1), min_size=n_tokens, max_size=n_tokens),
            st.integers(0, 2**32 - 1).map(lambda t: [t] * n_tokens),
        )
    )
    parent = draw(
        st.one_of(
            st.just(scope.digest),
            st.sampled_from(world.known_keys),
            *(() if clean else (st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),)),
        )
    )
    payload = payload_of(draw(st.integers(0, 2**32)), scope.page_payload_bytes)
    header = make_header(scope, parent, tokens, payload)
    raw = header.encode()
    if clean:
        return raw, payload
    edit = draw(st.sampled_from(HEADER_EDITS))
    at = draw(st.integers(0, len(raw) - 1))
    bit = 1 << draw(st.integers(0, 7))
    flipped = raw[:at] + bytes([raw[at] ^ bit]) + raw[at + 1 :]
    if edit == "flip":
        raw = flipped
    elif edit == "flip-reseal":
        raw = reseal(flipped)
    elif edit == "truncate":
        raw = raw[:at]
    elif edit == "extend":
        raw = raw + draw(st.binary(min_size=1, max_size=32))
    elif edit == "forged-key":
        raw = _with(header, key=draw(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)))
    elif edit == "foreign-scope":
        other = world.other if scope is world.scope else world.scope
        raw = _with(header, scope_digest=other.digest)
    elif edit == "tokens-swapped":  # the same key, other tokens: a forged collision
        raw = _with(header, tokens=tuple(reversed(header.tokens)))
        if tuple(reversed(header.tokens)) == header.tokens:
            raw = _with(header, tokens=(header.tokens[0] ^ 1, *header.tokens[1:]))
    elif edit == "huge-payload":
        raw = _with(header, payload_bytes=draw(st.sampled_from((2**31, 2**40, 2**64 - 1))))
    elif edit == "random":
        raw = draw(st.binary(min_size=0, max_size=len(raw) + 8))
    elif edit == "empty":
        raw = b""
    p_edit = draw(st.sampled_from(PAYLOAD_EDITS))
    if p_edit == "flip":
        i = draw(st.integers(0, len(payload) - 1))
        payload = payload[:i] + bytes([payload[i] ^ 0x80]) + payload[i + 1 :]
    elif p_edit == "short":
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    elif p_edit == "long":
        payload = payload + b"\0" * draw(st.integers(1, 600))
    elif p_edit == "empty":
        payload = b""
    return raw, payload


def _with(header: PageHeader, **changes: object) -> bytes:
    """`header` with fields changed, re-encoded with a correct header checksum."""
    return dataclasses.replace(header, **changes).encode()  # type: ignore[arg-type]


# ---- the bytes on the wire -------------------------------------------------------------------


@st.composite
def mangled(draw: st.DrawFn, message: bytes) -> bytes:
    """`message` as it is, mostly; else truncated, bit-flipped, extended or replaced."""
    how = draw(st.integers(0, 11))
    if how <= 7 or not message:
        return message if how <= 7 else draw(st.binary(min_size=1, max_size=64))
    at = draw(st.integers(0, len(message) - 1))
    if how == 8:
        return message[:at]
    if how == 9:
        return (
            message[:at] + bytes([message[at] ^ (1 << draw(st.integers(0, 7)))]) + message[at + 1 :]
        )
    if how == 10:
        return message + draw(st.binary(min_size=1, max_size=16))
    return draw(st.binary(min_size=0, max_size=len(message) + 16))


def _unary(method: str, message: st.SearchStrategy[bytes]) -> st.SearchStrategy[Call]:
    return message.flatmap(mangled).map(lambda raw: Call(method, (raw,)))


STREAM_EDITS = (
    "none", "none", "none", "none", "drop", "duplicate", "swap", "reindex", "reoffset",
    "no-begin", "two-begins", "header-again", "no-header",
)  # fmt: skip


@st.composite
def put_call(draw: st.DrawFn, world: World) -> Call:
    """A Put stream: hostile throughout, or (half the time) well-formed but for at most one
    flaw (a bad page among good ones, a stream edit, a mangled message, an abrupt end), which
    reaches the checks behind the first refusal, and stores pages."""
    clean = draw(st.booleans())
    if clean:
        flaw = draw(st.sampled_from(("none", "none", "page", "stream", "bytes", "abort")))
        pages = draw(st.lists(page(world, clean=True), min_size=1, max_size=4))
        if flaw == "page":
            pages.insert(draw(st.integers(0, len(pages))), draw(page(world)))
        begin = message(pb.PutBegin, scope=world.scope.encode(), page_count=len(pages))
    else:
        flaw = "any"
        pages = draw(st.lists(page(world), max_size=4))
        begin = message(
            pb.PutBegin,
            scope=draw(scope_bytes(world)),
            io_class=draw(enum_value()),
            page_count=draw(st.one_of(st.just(len(pages)), st.just(len(pages)), u32())),
            tier=draw(enum_value()),
            chain_prefix=draw(chain_prefix()),
        )
    chunk_bytes = draw(st.sampled_from((64, 200, 512, 1 << 16)))
    chunks: list[pb.PageChunk] = []
    for index, (header, payload) in enumerate(pages):
        for off in range(0, max(len(payload), 1), chunk_bytes):
            chunks.append(
                pb.PageChunk(
                    index=index,
                    header=header if off == 0 else b"",
                    offset=off,
                    data=payload[off : off + chunk_bytes],
                )
            )
    messages = [pb.PutRequest(begin=begin)] + [pb.PutRequest(chunk=c) for c in chunks]
    edit = draw(st.sampled_from(STREAM_EDITS)) if flaw in ("any", "stream") else "none"
    at = draw(st.integers(0, max(len(messages) - 1, 0)))
    if edit == "drop" and len(messages) > 1:
        del messages[max(at, 1)]
    elif edit == "duplicate":
        messages.insert(at, messages[at])
    elif edit == "swap" and len(messages) > 2:
        i = max(at, 1)
        j = min(i + 1, len(messages) - 1)
        messages[i], messages[j] = messages[j], messages[i]
    elif edit in ("reindex", "reoffset", "header-again", "no-header") and chunks:
        j = draw(st.integers(0, len(chunks) - 1))
        c, i = chunks[j], j + 1  # messages[0] is the PutBegin
        bad = pb.PageChunk()
        bad.CopyFrom(c)
        if edit == "reindex":
            bad.index = draw(u32())
        elif edit == "reoffset":
            bad.offset = draw(u64())
        elif edit == "header-again":
            bad.header = pages[min(c.index, len(pages) - 1)][0] or b"\1"
        else:
            bad.header = b""
        messages[i] = pb.PutRequest(chunk=bad)
    elif edit == "no-begin":
        messages = messages[1:]
    elif edit == "two-begins":
        messages.insert(min(at + 1, len(messages)), pb.PutRequest(begin=begin))
    raw = [m.SerializeToString() for m in messages]
    if flaw in ("any", "bytes"):
        raw = [draw(mangled(m)) for m in raw]
    abort_after = -1
    if flaw in ("any", "abort"):
        abort_after = draw(st.one_of(st.just(-1), st.just(-1), st.integers(0, len(raw))))
    return Call("Put", tuple(raw), abort_after, note=edit)


def headers(world: World) -> st.SearchStrategy[list[bytes]]:
    return st.one_of(
        st.lists(page(world).map(lambda p: p[0]), max_size=5),
        st.just([b"\0"] * (world.max_keys + 1)),
    )


def calls(world: World) -> st.SearchStrategy[Call]:
    """A call of any method of the Store service."""

    def read(cls: type[Any], **more: st.SearchStrategy[object]) -> st.SearchStrategy[bytes]:
        """Hostile reads, or (half the time) a well-formed scope and digest with hostile keys
        and fields, which get past the scope checks to the lookup itself."""
        build = lambda **f: message(cls, **f).SerializeToString()  # noqa: E731
        hostile = st.builds(
            build, scope_digest=digest(world), scope=st.one_of(st.just(b""), scope_bytes(world)),
            keys=packed_keys(world), **more,
        )  # fmt: skip
        s = world.scope
        sound = st.builds(
            build, scope_digest=st.just(s.digest), scope=st.just(s.encode()),
            keys=packed_keys(world), **more,
        )  # fmt: skip
        return st.one_of(hostile, sound)

    lookup = read(pb.LookupRequest)
    get = read(pb.GetRequest, io_class=enum_value())
    acquire = read(pb.AcquireRequest, io_class=enum_value(), lease_ms=u32())
    reserve = st.builds(
        lambda **f: message(pb.ReserveRequest, **f).SerializeToString(),
        scope=scope_bytes(world), headers=headers(world), io_class=enum_value(),
        lease_ms=u32(), client_pid=u32(), chain_prefix=chain_prefix(),
    )  # fmt: skip
    lease = st.one_of(st.integers(0, 200), u64())
    commit = lease.map(lambda n: pb.CommitRequest(lease_id=n).SerializeToString())
    release = lease.map(lambda n: pb.ReleaseRequest(lease_id=n).SerializeToString())
    renew = st.builds(
        lambda n, ms: pb.RenewRequest(lease_id=n, lease_ms=ms).SerializeToString(), lease, u32()
    )
    maybe_scope = st.one_of(st.just(b""), scope_bytes(world))
    delete = st.one_of(
        st.builds(
            lambda k, s: message(pb.DeleteRequest, keys=k, scope=s).SerializeToString(),
            packed_keys(world), maybe_scope,
        ),
        st.builds(
            lambda d, s: message(pb.DeleteRequest, scope_digest=d, scope=s).SerializeToString(),
            digest(world), maybe_scope,
        ),
        st.just(b""),
    )  # fmt: skip
    watch = st.builds(
        lambda d, s: message(pb.WatchRequest, scope_digest=d, scope=s).SerializeToString(),
        st.one_of(st.just(b""), digest(world)), maybe_scope,
    )  # fmt: skip
    empty = st.one_of(st.just(b""), st.binary(max_size=24))
    return st.one_of(
        put_call(world),
        put_call(world),
        _unary("Lookup", lookup),
        _unary("Get", get),
        _unary("Acquire", acquire),
        _unary("Reserve", reserve),
        _unary("Commit", commit),
        _unary("Release", release),
        _unary("Renew", renew),
        _unary("Delete", delete),
        _unary("Watch", watch),
        _unary("Stats", empty),
        _unary("NodeInfo", empty),
    )


def seed_calls(world: World, pages: Sequence[tuple[bytes, bytes]]) -> list[Call]:
    """Well-formed calls of every method (the atheris target's seed corpus)."""
    s, k = world.scope, world.known_keys
    put = [pb.PutRequest(begin=pb.PutBegin(scope=s.encode(), page_count=len(pages)))]
    for i, (header, payload) in enumerate(pages):
        put.append(pb.PutRequest(chunk=pb.PageChunk(index=i, header=header, data=payload)))
    keys = b"".join(k[:3])
    return [
        Call("Put", tuple(m.SerializeToString() for m in put)),
        Call("Lookup", (pb.LookupRequest(scope_digest=s.digest, keys=keys).SerializeToString(),)),
        Call("Get", (pb.GetRequest(scope_digest=s.digest, keys=keys).SerializeToString(),)),
        Call("Acquire", (pb.AcquireRequest(scope_digest=s.digest, keys=keys).SerializeToString(),)),
        Call(
            "Reserve",
            (
                pb.ReserveRequest(
                    scope=s.encode(), headers=[h for h, _ in pages]
                ).SerializeToString(),
            ),
        ),
        Call("Commit", (pb.CommitRequest(lease_id=1).SerializeToString(),)),
        Call("Release", (pb.ReleaseRequest(lease_id=1).SerializeToString(),)),
        Call("Renew", (pb.RenewRequest(lease_id=1, lease_ms=100).SerializeToString(),)),
        Call("Delete", (pb.DeleteRequest(keys=k[-1]).SerializeToString(),)),
        Call("Watch", (pb.WatchRequest(scope_digest=s.digest).SerializeToString(),)),
        Call("Stats", (b"",)),
        Call("NodeInfo", (b"",)),
    ]


def fresh_pages(scope: Scope, count: int, seed: int) -> list[tuple[bytes, bytes]]:
    """`count` valid one-page prompts of `scope` (raw header, payload)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        tokens = [rng.randrange(2**32) for _ in range(scope.layout.page_tokens)]
        payload = rng.randbytes(scope.page_payload_bytes)
        out.append((make_header(scope, scope.digest, tokens, payload).encode(), payload))
    return out
