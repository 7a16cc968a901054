"""The chaos workload's pages: every payload is a function of its page key alone.

So any process can check any page it is served without having seen it put: `expected(key)` is
the only right answer, and a page served with other bytes (a stale writer's, a reused slot's, a
flipped bit's) is wrong whoever reads it. A prompt is named by an integer id; its tokens, and so
its keys, follow from the id and the scope, and each payload is a 64-byte BLAKE2b digest of the
key repeated to the page size (any mix of two pages' bytes differs from both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from client import KVLayout, Page, Scope, build_pages, page_keys

_BLOCK = 64
# page payload KiB -> layout (float16, 16 tokens a page)
LAYOUTS = {
    32: KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_tokens=16),
    1024: KVLayout(num_layers=32, num_kv_heads=8, head_dim=64, page_tokens=16),
}


def chaos_scope(namespace: str, page_kib: int = 32) -> Scope:
    """The scope of one chaos phase (a namespace per phase keeps phases' pages apart) for
    pages of `page_kib` KiB (32 or 1024)."""
    layout = LAYOUTS[page_kib]
    return Scope(
        model_id="chaos/model", weights_revision="r1", tokenizer_fingerprint="t1",
        kv_dtype="float16", layout=layout, namespace=namespace,
    )


def expected(key: bytes, size: int) -> bytes:
    """The one payload page `key` may ever be served with."""
    block = hashlib.blake2b(key, digest_size=_BLOCK).digest()
    reps, rest = divmod(size, _BLOCK)
    return block * reps + block[:rest]


def digest(payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a payload (what a client records for a page it was acknowledged for)."""
    return xxhash.xxh3_64_intdigest(payload)


def is_intact(key: bytes, buffer: bytes | bytearray | memoryview) -> bool:
    """True when `buffer` holds exactly page `key`'s payload."""
    view = memoryview(buffer)
    return view == expected(key, len(view))


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the workload: `pages` chained pages, named by `prompt_id`."""

    prompt_id: int
    keys: tuple[bytes, ...]

    def build(self, scope: Scope) -> list[Page]:
        """The prompt's pages with their key-derived payloads."""
        size = scope.page_payload_bytes
        return build_pages(
            scope, tokens_of(scope, self.prompt_id, len(self.keys)),
            [expected(k, size) for k in self.keys],
        )


def tokens_of(scope: Scope, prompt_id: int, pages: int) -> list[int]:
    """Token ids of prompt `prompt_id`: distinct first tokens, so distinct prompts share no key."""
    n = pages * scope.layout.page_tokens
    return [(prompt_id * 2_654_435_761 + t * 40_503) % 4_000_000_000 for t in range(n)]


def prompt(scope: Scope, prompt_id: int, pages: int) -> Prompt:
    return Prompt(prompt_id, tuple(page_keys(scope, tokens_of(scope, prompt_id, pages))))


def classify(
    keys: Sequence[bytes], hits: Sequence[bool], buffers: Sequence[bytes | bytearray]
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Split a get's keys into (intact, missing, wrong) by what each buffer holds."""
    intact: list[bytes] = []
    missing: list[bytes] = []
    wrong: list[bytes] = []
    for key, hit, buf in zip(keys, hits, buffers, strict=True):
        if not hit:
            missing.append(key)
        elif is_intact(key, buf):
            intact.append(key)
        else:
            wrong.append(key)
    return intact, missing, wrong
