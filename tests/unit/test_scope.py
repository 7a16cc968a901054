"""Scope digests and page keys (DESIGN §3): golden vectors, field separation, codec properties.

The golden vectors below were computed once and pinned. If one of them fails, the key schema
changed: every cached page in every deployed store would silently become a miss. Do not update a
vector to make a test pass; bump KEY_SCHEMA_VERSION and add vectors for the new schema instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.contract.errors import InvalidArgument
from client.contract.scope import (
    DTYPES,
    KEY_BYTES,
    KEY_SCHEMA_VERSION,
    KVLayout,
    Scope,
    Shard,
    chain_key,
    pack_keys,
    page_keys,
    unpack_keys,
)

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
U32_MAX = 2**32 - 1

# ---- golden vectors ----------------------------------------------------------------------------

LLAMA = Scope(
    model_id="meta-llama/Llama-3.1-8B",
    weights_revision="sha256:0123abcd",
    tokenizer_fingerprint="tok:feedbeef",
    kv_dtype="bfloat16",
    layout=KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16),
)
LLAMA_ENCODING = (
    "5354524154412d53434f5045010004000000020000000200170000006d6574612d6c6c616d612f4c6c616d612d"
    "332e312d384203000f0000007368613235363a303132336162636404000c000000746f6b3a6665656462656566"
    "05000000000006000000000007000800000062666c6f6174313608001000000020000000080000008000000010"
    "000000090010000000000000000100000000000000010000000a0000000000"
)
LLAMA_DIGEST = "53ae35a998ec8669aebe4ab7357798d1"
LLAMA_TOKENS = list(range(40))  # two full pages of 16 and a tail of 8
LLAMA_KEYS = ["b18ff0a9789d3d5ba31fec515141a285", "01bab2b2d6343808e3f0e00779146017"]

QWEN_LORA = Scope(
    model_id="Qwen/Qwen2.5-7B",
    weights_revision="rev-2",
    tokenizer_fingerprint="tok-2",
    kv_dtype="float16",
    layout=KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, page_tokens=32),
    adapter_id="lora-sql",
    adapter_fingerprint="fp-9",
    shard=Shard(tp_rank=1, tp_size=2, pp_stage=1, pp_size=2),
    namespace="tenant-a",
)
QWEN_LORA_ENCODING = (
    "5354524154412d53434f50450100040000000200000002000f0000005177656e2f5177656e322e352d37420300"
    "050000007265762d32040005000000746f6b2d320500080000006c6f72612d73716c06000400000066702d3907"
    "0007000000666c6f617431360800100000001c0000000400000080000000200000000900100000000100000002"
    "00000001000000020000000a000800000074656e616e742d61"
)
QWEN_LORA_DIGEST = "7af1cde907abdd44effa984411184982"
QWEN_LORA_TOKENS = [0, 1, U32_MAX, 128000] * 16  # exactly two pages of 32
QWEN_LORA_KEYS = ["9774b3349d9534cdddb96cdc0812733f", "37f0254206d9545e8889f1d16a3b807f"]

UNICODE = Scope(
    model_id="模型/ünï",
    weights_revision="",
    tokenizer_fingerprint="",
    kv_dtype="float8_e4m3fn",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=1),
    namespace="salt ✓",
)
UNICODE_ENCODING = (
    "5354524154412d53434f50450100040000000200000002000c000000e6a8a1e59e8b2fc3bc6ec3af0300000000"
    "0004000000000005000000000006000000000007000d000000666c6f6174385f65346d33666e08001000000001"
    "000000010000000100000001000000090010000000000000000100000000000000010000000a00080000007361"
    "6c7420e29c93"
)
UNICODE_DIGEST = "9c7593d67e4d59e5e519ead94df62194"
UNICODE_TOKENS = [7, 0, U32_MAX]
UNICODE_KEYS = [
    "ed7992958f82ca8a9fbadd53ba23ee28",
    "01a6e7d9eb3ca247885aa73c1df213a2",
    "13dd44d5c3f84922f7f0c48f5c2494f9",
]

GOLDEN = [
    pytest.param(LLAMA, LLAMA_ENCODING, LLAMA_DIGEST, LLAMA_TOKENS, LLAMA_KEYS, id="llama"),
    pytest.param(
        QWEN_LORA,
        QWEN_LORA_ENCODING,
        QWEN_LORA_DIGEST,
        QWEN_LORA_TOKENS,
        QWEN_LORA_KEYS,
        id="qwen-lora-shard-namespace",
    ),
    pytest.param(
        UNICODE, UNICODE_ENCODING, UNICODE_DIGEST, UNICODE_TOKENS, UNICODE_KEYS, id="unicode"
    ),
]


def test_schema_version_is_pinned() -> None:
    # The golden vectors above are for schema 2 (BLAKE2b-128). Schema 1 (xxh3-128, not
    # collision-resistant) is refused. A new schema needs new vectors, not edited ones.
    assert KEY_SCHEMA_VERSION == 2
    assert KEY_BYTES == 16


@pytest.mark.parametrize(("scope", "encoding", "digest", "tokens", "keys"), GOLDEN)
def test_golden_encoding(
    scope: Scope, encoding: str, digest: str, tokens: list[int], keys: list[str]
) -> None:
    assert scope.encode().hex() == encoding


@pytest.mark.parametrize(("scope", "encoding", "digest", "tokens", "keys"), GOLDEN)
def test_golden_digest(
    scope: Scope, encoding: str, digest: str, tokens: list[int], keys: list[str]
) -> None:
    assert scope.digest.hex() == digest
    assert len(scope.digest) == KEY_BYTES


@pytest.mark.parametrize(("scope", "encoding", "digest", "tokens", "keys"), GOLDEN)
def test_golden_page_keys(
    scope: Scope, encoding: str, digest: str, tokens: list[int], keys: list[str]
) -> None:
    assert [k.hex() for k in page_keys(scope, tokens)] == keys


@pytest.mark.parametrize(("scope", "encoding", "digest", "tokens", "keys"), GOLDEN)
def test_golden_vectors_follow_the_spec(
    scope: Scope, encoding: str, digest: str, tokens: list[int], keys: list[str]
) -> None:
    """Recompute the vectors from DESIGN §3 directly, independent of page_keys' loop."""
    blake = hashlib.blake2b
    assert (
        blake(bytes.fromhex(encoding), digest_size=16, person=b"strata-scope-v2").hexdigest()
        == digest
    )
    page = scope.layout.page_tokens
    parent = bytes.fromhex(digest)
    expected = []
    for i in range(len(tokens) // page):
        chunk = tokens[i * page : (i + 1) * page]
        data = parent + struct.pack(f"<{page}I", *chunk)
        parent = blake(data, digest_size=16, person=b"strata-key-v2").digest()
        expected.append(parent.hex())
    assert expected == keys


def test_golden_chain_key() -> None:
    assert chain_key(bytes(16), [1, 2, 3]).hex() == "232836d029c484f3ad79ae4c37e6acfe"
    assert chain_key(bytes(16), []).hex() == "cc2a5cf50c08b8688f75e49f8a32d8fd"


# ---- field separation --------------------------------------------------------------------------


def _variants() -> dict[str, Scope]:
    base = LLAMA
    rep = dataclasses.replace
    lay = base.layout
    return {
        "base": base,
        "model_id": rep(base, model_id="meta-llama/Llama-3.1-8B-Instruct"),
        "weights_revision": rep(base, weights_revision="sha256:0123abce"),
        "tokenizer_fingerprint": rep(base, tokenizer_fingerprint="tok:feedbeee"),
        "adapter": rep(base, adapter_id="X", adapter_fingerprint="f"),
        "adapter_fingerprint": rep(base, adapter_id="X", adapter_fingerprint="g"),
        "kv_dtype": rep(base, kv_dtype="float16"),
        "num_layers": rep(base, layout=dataclasses.replace(lay, num_layers=31)),
        "num_kv_heads": rep(base, layout=dataclasses.replace(lay, num_kv_heads=4)),
        "head_dim": rep(base, layout=dataclasses.replace(lay, head_dim=64)),
        "page_tokens": rep(base, layout=dataclasses.replace(lay, page_tokens=32)),
        "tp_rank": rep(base, shard=Shard(tp_rank=1, tp_size=2)),
        "tp_size": rep(base, shard=Shard(tp_rank=0, tp_size=2)),
        "pp_stage": rep(base, shard=Shard(pp_stage=1, pp_size=2)),
        "pp_size": rep(base, shard=Shard(pp_stage=0, pp_size=2)),
        "namespace": rep(base, namespace="X"),
        "namespace_f": rep(base, namespace="f"),
        "namespace_Xf": rep(base, namespace="Xf"),
    }


def test_every_field_changes_the_digest() -> None:
    variants = _variants()
    digests = {name: s.digest for name, s in variants.items()}
    assert len(set(digests.values())) == len(digests), digests
    first_keys = {name: page_keys(s, [1] * s.layout.page_tokens)[0] for name, s in variants.items()}
    assert len(set(first_keys.values())) == len(first_keys)


def test_adapter_and_namespace_never_collide() -> None:
    # "lora X" must never equal "salt X" (DESIGN §3).
    lora = dataclasses.replace(LLAMA, adapter_id="X", adapter_fingerprint="X")
    salt = dataclasses.replace(LLAMA, namespace="X")
    both = dataclasses.replace(LLAMA, adapter_id="X", adapter_fingerprint="X", namespace="X")
    assert len({lora.digest, salt.digest, both.digest, LLAMA.digest}) == 4
    assert lora.encode() != salt.encode()


def test_model_id_vs_namespace_same_text() -> None:
    a = dataclasses.replace(LLAMA, model_id="X", namespace="")
    b = dataclasses.replace(LLAMA, model_id="Y", namespace="X")
    c = dataclasses.replace(LLAMA, model_id="Y", namespace="")
    assert len({a.digest, b.digest, c.digest}) == 3


_STRING_FIELDS = ["model_id", "weights_revision", "tokenizer_fingerprint"]


@settings(max_examples=200, deadline=None)
@given(
    pair=st.sampled_from(list(itertools.pairwise(_STRING_FIELDS))),
    head=st.text(min_size=1, max_size=8),
    moved=st.text(min_size=1, max_size=8),
    tail=st.text(max_size=8),
)
def test_moving_bytes_between_adjacent_fields_changes_digest(
    pair: tuple[str, str], head: str, moved: str, tail: str
) -> None:
    left, right = pair
    a = dataclasses.replace(LLAMA, **{left: head + moved, right: tail})
    b = dataclasses.replace(LLAMA, **{left: head, right: moved + tail})
    assert a.encode() != b.encode()
    assert a.digest != b.digest


@settings(max_examples=100, deadline=None)
@given(head=st.text(max_size=8), moved=st.text(min_size=1, max_size=8))
def test_moving_bytes_between_adapter_fingerprint_and_namespace(head: str, moved: str) -> None:
    a = dataclasses.replace(
        LLAMA, adapter_id="id", adapter_fingerprint="fp" + head + moved, namespace=""
    )
    b = dataclasses.replace(
        LLAMA, adapter_id="id", adapter_fingerprint="fp" + head, namespace=moved
    )
    assert a.digest != b.digest


# ---- encode / decode ---------------------------------------------------------------------------

_small = st.integers(min_value=1, max_value=(1 << 20) - 1)
layouts = st.builds(KVLayout, _small, _small, _small, _small)


@st.composite
def shards(draw: st.DrawFn) -> Shard:
    tp_size = draw(st.integers(1, 64))
    pp_size = draw(st.integers(1, 16))
    return Shard(
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        pp_stage=draw(st.integers(0, pp_size - 1)),
        pp_size=pp_size,
    )


@st.composite
def scopes(draw: st.DrawFn) -> Scope:
    has_adapter = draw(st.booleans())
    return Scope(
        model_id=draw(st.text(min_size=1, max_size=40)),
        weights_revision=draw(st.text(max_size=40)),
        tokenizer_fingerprint=draw(st.text(max_size=40)),
        kv_dtype=draw(st.sampled_from(sorted(DTYPES))),
        layout=draw(layouts),
        adapter_id=draw(st.text(min_size=1, max_size=20)) if has_adapter else "",
        adapter_fingerprint=draw(st.text(min_size=1, max_size=20)) if has_adapter else "",
        shard=draw(shards()),
        namespace=draw(st.text(max_size=40)),
    )


@settings(max_examples=300, deadline=None)
@given(scope=scopes())
def test_encode_decode_round_trip(scope: Scope) -> None:
    data = scope.encode()
    back = Scope.decode(data)
    assert back == scope
    assert back.digest == scope.digest
    assert back.encode() == data


@settings(max_examples=200, deadline=None)
@given(a=scopes(), b=scopes())
def test_distinct_scopes_have_distinct_encodings(a: Scope, b: Scope) -> None:
    assert (a == b) == (a.encode() == b.encode())
    assert (a == b) == (a.digest == b.digest)


def _fields(data: bytes) -> list[tuple[int, bytes]]:
    pos = len(b"STRATA-SCOPE")
    out = []
    while pos < len(data):
        tag, length = struct.unpack_from("<HI", data, pos)
        out.append((tag, data[pos + 6 : pos + 6 + length]))
        pos += 6 + length
    return out


def _assemble(fields: list[tuple[int, bytes]]) -> bytes:
    return b"STRATA-SCOPE" + b"".join(struct.pack("<HI", t, len(v)) + v for t, v in fields)


def test_field_helpers_reassemble_the_golden_encoding() -> None:
    data = QWEN_LORA.encode()
    assert _assemble(_fields(data)) == data
    assert [t for t, _ in _fields(data)] == list(range(1, 11))


@pytest.mark.parametrize("scope", [LLAMA, QWEN_LORA, UNICODE], ids=["llama", "qwen", "unicode"])
def test_decode_rejects_every_truncation(scope: Scope) -> None:
    data = scope.encode()
    for n in range(len(data)):
        with pytest.raises(InvalidArgument):
            Scope.decode(data[:n])


@pytest.mark.parametrize(
    "extra",
    [
        b"\x00",
        b"\x00" * 5,
        b"\x00" * 6,
        struct.pack("<HI", 11, 0),
        struct.pack("<HI", 11, 1) + b"x",
    ],
    ids=["one-byte", "five-bytes", "empty-tag-0", "unknown-tag", "unknown-tag-with-value"],
)
def test_decode_rejects_extra_bytes(extra: bytes) -> None:
    with pytest.raises(InvalidArgument):
        Scope.decode(LLAMA.encode() + extra)


def test_decode_rejects_duplicate_field() -> None:
    fields = _fields(QWEN_LORA.encode())
    with pytest.raises(InvalidArgument, match="duplicate"):
        Scope.decode(_assemble([*fields, fields[-1]]))
    # a duplicate that replaces a missing field is still a duplicate
    with pytest.raises(InvalidArgument):
        Scope.decode(_assemble([*fields[:-1], fields[1]]))


def test_decode_rejects_missing_field() -> None:
    fields = _fields(QWEN_LORA.encode())
    for i in range(len(fields)):
        with pytest.raises(InvalidArgument):
            Scope.decode(_assemble(fields[:i] + fields[i + 1 :]))


def test_decode_rejects_reordered_fields() -> None:
    fields = _fields(QWEN_LORA.encode())
    swapped = [fields[1], fields[0], *fields[2:]]
    with pytest.raises(InvalidArgument, match="canonical"):
        Scope.decode(_assemble(swapped))
    with pytest.raises(InvalidArgument, match="canonical"):
        Scope.decode(_assemble(list(reversed(fields))))


@pytest.mark.parametrize(
    ("tag", "value"),
    [
        (1, struct.pack("<I", 1)),  # schema 1 (xxh3 keys) is no longer accepted
        (1, struct.pack("<I", 3)),  # unsupported schema version
        (1, struct.pack("<H", 1)),  # schema field of the wrong width
        (2, b""),  # empty model id
        (2, b"\xff\xfe"),  # not UTF-8
        (2, b"\xc0\xaf"),  # overlong UTF-8, not canonical
        (5, b""),  # adapter id without its fingerprint
        (7, b"float64"),  # unknown dtype
        (8, struct.pack("<3I", 1, 1, 1)),  # layout too short
        (8, struct.pack("<5I", 1, 1, 1, 1, 1)),  # layout too long
        (8, struct.pack("<4I", 0, 1, 1, 1)),  # zero layers
        (9, struct.pack("<4I", 2, 2, 0, 1)),  # tp_rank >= tp_size
        (10, b"\x80"),  # not UTF-8
    ],
)
def test_decode_rejects_bad_field_values(tag: int, value: bytes) -> None:
    fields = dict(_fields(QWEN_LORA.encode()))
    fields[tag] = value
    with pytest.raises(InvalidArgument):
        Scope.decode(_assemble(sorted(fields.items())))


def test_decode_rejects_bad_magic() -> None:
    data = LLAMA.encode()
    with pytest.raises(InvalidArgument, match="magic"):
        Scope.decode(b"strata-scope" + data[12:])
    with pytest.raises(InvalidArgument):
        Scope.decode(b"")


def test_constructor_validation() -> None:
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, model_id="")
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, kv_dtype="float64")
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, adapter_id="X")
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, adapter_fingerprint="f")
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, key_schema_version=KEY_SCHEMA_VERSION + 1)
    with pytest.raises(InvalidArgument, match="key schema version 1 is not supported"):
        dataclasses.replace(LLAMA, key_schema_version=1)  # xxh3 keys: not collision-resistant
    with pytest.raises(InvalidArgument):
        KVLayout(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1)
    with pytest.raises(InvalidArgument):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=1 << 20)
    with pytest.raises(InvalidArgument):
        Shard(tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgument):
        Shard(pp_stage=-1)


def test_unencodable_text_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        dataclasses.replace(LLAMA, namespace="\ud800")


def test_scope_is_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA.model_id = "other"  # type: ignore[misc]
    copy = dataclasses.replace(LLAMA)
    assert copy == LLAMA and hash(copy) == hash(LLAMA) and copy is not LLAMA
    assert {LLAMA: 1}[copy] == 1


# ---- page keys ---------------------------------------------------------------------------------

token_ids = st.integers(min_value=0, max_value=U32_MAX)


@settings(max_examples=200, deadline=None)
@given(
    page=st.integers(1, 8),
    tokens=st.lists(token_ids, max_size=64),
    data=st.data(),
)
def test_page_keys_prefix_property(page: int, tokens: list[int], data: st.DataObject) -> None:
    scope = dataclasses.replace(LLAMA, layout=dataclasses.replace(LLAMA.layout, page_tokens=page))
    keys = page_keys(scope, tokens)
    assert len(keys) == len(tokens) // page
    assert all(len(k) == KEY_BYTES for k in keys)
    n = data.draw(st.integers(0, len(tokens)), label="prefix length")
    assert page_keys(scope, tokens[:n]) == keys[: n // page]


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(token_ids, min_size=4, max_size=40),
    tail=st.lists(token_ids, min_size=1, max_size=3),
)
def test_only_full_pages_are_keyed(tokens: list[int], tail: list[int]) -> None:
    scope = dataclasses.replace(LLAMA, layout=dataclasses.replace(LLAMA.layout, page_tokens=4))
    full = tokens[: len(tokens) // 4 * 4]
    assert page_keys(scope, full + tail) == page_keys(scope, full)
    assert page_keys(scope, tokens[:3]) == []


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(token_ids, min_size=8, max_size=8), pos=st.integers(0, 7))
def test_a_changed_token_changes_its_page_and_every_later_key(tokens: list[int], pos: int) -> None:
    scope = dataclasses.replace(LLAMA, layout=dataclasses.replace(LLAMA.layout, page_tokens=2))
    other = list(tokens)
    other[pos] = (other[pos] + 1) % (U32_MAX + 1)
    a, b = page_keys(scope, tokens), page_keys(scope, other)
    page = pos // 2
    assert a[:page] == b[:page]
    assert all(x != y for x, y in zip(a[page:], b[page:], strict=True))


def test_page_keys_accept_any_sequence() -> None:
    keys = page_keys(LLAMA, LLAMA_TOKENS)
    assert page_keys(LLAMA, tuple(LLAMA_TOKENS)) == keys
    assert page_keys(LLAMA, range(40)) == keys


def test_keys_are_stable_across_processes() -> None:
    """No process-random seed: another interpreter with another hash seed gets the same keys."""
    program = (
        "import json\n"
        "from client.contract.scope import KVLayout, Scope, Shard, page_keys\n"
        "s = Scope(model_id='Qwen/Qwen2.5-7B', weights_revision='rev-2', "
        "tokenizer_fingerprint='tok-2', kv_dtype='float16', layout=KVLayout(28, 4, 128, 32), "
        "adapter_id='lora-sql', adapter_fingerprint='fp-9', shard=Shard(1, 2, 1, 2), "
        "namespace='tenant-a')\n"
        "toks = [0, 1, 2**32 - 1, 128000] * 16\n"
        "print(json.dumps([s.digest.hex()] + [k.hex() for k in page_keys(s, toks)]))\n"
    )
    expected = [QWEN_LORA_DIGEST, *QWEN_LORA_KEYS]
    assert [QWEN_LORA.digest.hex()] + [k.hex() for k in page_keys(QWEN_LORA, QWEN_LORA_TOKENS)] == (
        expected
    )
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", program],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(out.stdout) == expected, f"PYTHONHASHSEED={seed}"


# ---- pack / unpack -----------------------------------------------------------------------------


@given(keys=st.lists(st.binary(min_size=16, max_size=16), max_size=20))
def test_pack_unpack_round_trip(keys: list[bytes]) -> None:
    packed = pack_keys(keys)
    assert len(packed) == 16 * len(keys)
    assert unpack_keys(packed) == keys


@pytest.mark.parametrize("size", [0, 1, 15, 17, 32])
def test_pack_rejects_wrong_key_size(size: int) -> None:
    with pytest.raises(InvalidArgument, match="16"):
        pack_keys([bytes(16), bytes(size)])


@pytest.mark.parametrize("size", [1, 15, 17, 33])
def test_unpack_rejects_ragged_length(size: int) -> None:
    with pytest.raises(InvalidArgument, match=str(size)):
        unpack_keys(bytes(size))


def test_pack_unpack_empty() -> None:
    assert pack_keys([]) == b""
    assert unpack_keys(b"") == []


# ---- token ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, U32_MAX + 1, 2**64, -(2**40)])
def test_invalid_token_ids_are_rejected(bad: int) -> None:
    tokens = list(LLAMA_TOKENS[:16])
    tokens[5] = bad
    with pytest.raises(InvalidArgument, match=str(bad)):
        page_keys(LLAMA, tokens)
    with pytest.raises(InvalidArgument):
        chain_key(LLAMA.digest, tokens)


def test_boundary_token_ids_are_accepted() -> None:
    keys = page_keys(UNICODE, [0, U32_MAX])
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.mark.parametrize("size", [0, 15, 17, 32])
def test_chain_key_rejects_wrong_parent_size(size: int) -> None:
    with pytest.raises(InvalidArgument, match="parent"):
        chain_key(bytes(size), [1])
