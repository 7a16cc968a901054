"""Key-chain verification (kvstore/chain.py) and the SDK's chain prefixes (client/contract/types.py), pure."""

from __future__ import annotations

import pytest

from client import KVLayout, Scope, build_pages
from client.contract.scope import chain_key, page_keys
from client.contract.types import chain_prefixes_for, tokens_le
from kvstore.chain import ChainMemory, first_unverified, prefix_keys
from kvstore.errors import InvalidArgument
from kvstore.index import Index, PageEntry

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4)


def scope(namespace: str) -> Scope:
    return Scope("m", "w", "t", "float16", LAYOUT, namespace=namespace)


A, B = scope("a"), scope("b")
TOKENS = list(range(100, 124))  # six pages of four


def links(s: Scope, tokens: list[int]) -> list[tuple[bytes, bytes]]:
    keys = page_keys(s, tokens)
    return list(zip(keys, [s.digest, *keys[:-1]], strict=True))


def nothing(key: bytes) -> bytes | None:
    return None


def test_a_chain_from_the_scope_digest_verifies_and_a_forged_parent_does_not() -> None:
    assert first_unverified(A.digest, links(A, TOKENS), nothing) is None
    chain = links(A, TOKENS)
    # B's pages presented under A: the first follows B's digest, not A's
    assert first_unverified(A.digest, links(B, TOKENS), nothing) == 0
    # the tail of A's prompt alone: page 2 follows page 1, which nothing vouches for
    assert first_unverified(A.digest, chain[2:], nothing) == 0
    known = {chain[1][0]: A.digest}
    assert first_unverified(A.digest, chain[2:], known.get) is None
    # known, but under another scope: refused (the shadowing forgery)
    assert first_unverified(A.digest, chain[2:], {chain[1][0]: B.digest}.get) == 0
    # a break in the middle is found where it is
    broken = [*chain[:3], (chain[4][0], bytes(16)), *chain[5:]]
    assert first_unverified(A.digest, broken, nothing) == 3


def test_the_memory_is_bounded_and_forgets_the_least_recently_remembered() -> None:
    memory = ChainMemory(3)
    keys = [bytes([i]) * 16 for i in range(5)]
    for key in keys[:3]:
        memory.remember(key, A.digest)
    memory.remember(keys[0], A.digest)  # refreshed: now the most recent
    memory.remember(keys[3], B.digest)
    assert len(memory) == 3
    assert memory.scope_of(keys[1]) is None  # the least recent went
    assert memory.scope_of(keys[0]) == A.digest and memory.scope_of(keys[3]) == B.digest
    memory.remember_many(keys[:2], A.digest)
    assert len(memory) == 3
    with pytest.raises(InvalidArgument):
        ChainMemory(-1)


def test_a_key_that_leaves_the_index_is_remembered_with_its_scope() -> None:
    index = Index(chain_memory_keys=2)
    chain = links(A, TOKENS)
    for key, parent in chain[:3]:
        index.insert(PageEntry(key, parent, A.digest, b"h", 64, dram=len(index) * 64))
    assert index.scope_of(chain[0][0]) == A.digest
    for key, _ in chain[:3]:
        index.remove(key)
    assert len(index) == 0
    assert index.scope_of(chain[0][0]) is None  # bounded: only the last two stay
    assert index.scope_of(chain[1][0]) == A.digest and index.scope_of(chain[2][0]) == A.digest
    # so page 3 (whose parent, page 2, left the index) still verifies under A, not under B
    assert first_unverified(A.digest, chain[3:], index.scope_of) is None
    assert first_unverified(B.digest, [(chain[3][0], chain[2][0])], index.scope_of) == 0


def test_prefix_keys_are_the_chain_of_the_prefix_tokens() -> None:
    keys = page_keys(A, TOKENS)
    assert prefix_keys(A.digest, [tokens_le(TOKENS)], 4) == set(keys)
    two = prefix_keys(A.digest, [tokens_le(TOKENS[:8]), tokens_le(TOKENS[12:16])], 4)
    assert two == {keys[0], keys[1], chain_key(A.digest, TOKENS[12:16])}
    with pytest.raises(InvalidArgument, match="whole pages"):
        prefix_keys(A.digest, [tokens_le(TOKENS[:6])], 4)
    with pytest.raises(InvalidArgument, match="limit"):
        prefix_keys(A.digest, [bytes(16 * (1 << 20)) + bytes(16)], 4)
    # prefix keys are always keys of the digest they are chained from
    chain = links(A, TOKENS)
    vouched = prefix_keys(A.digest, [tokens_le(TOKENS[:16])], 4)

    def known(key: bytes) -> bytes | None:
        return A.digest if key in vouched else None

    assert first_unverified(A.digest, chain[4:], known) is None
    assert first_unverified(A.digest, chain[5:], known) == 0
    # the same tokens presented under B vouch for B's keys, never for A's
    under_b = prefix_keys(B.digest, [tokens_le(TOKENS[:16])], 4)
    assert first_unverified(B.digest, chain[4:], lambda k: B.digest if k in under_b else None) == 0


def test_a_cluster_node_gets_the_prefixes_of_the_chains_it_holds_pages_of_without_parents() -> None:
    payload = bytes(A.page_payload_bytes)
    prompt = build_pages(A, TOKENS, [payload] * 6)
    single = build_pages(A, list(range(900, 904)), [payload])
    pages = [*single, *prompt]  # a one-page prompt, then a six-page one
    # every page of the second prompt up to 4: nothing missing
    assert chain_prefixes_for(A, pages, [1, 2, 3, 4]) == []
    # pages 3 and 6 (prompt pages 2 and 5): the tokens of prompt pages 0..4
    assert chain_prefixes_for(A, pages, [0, 3, 6]) == [TOKENS[:20]]
    # the single page alone needs nothing: its parent is the digest
    assert chain_prefixes_for(A, pages, [0]) == []
    # a continuation: the call starts at page 2 of a prompt, with the tokens before it given
    tail = prompt[2:]
    assert chain_prefixes_for(A, tail, [1]) == []  # no root known: nothing to vouch from
    assert chain_prefixes_for(A, tail, [1], TOKENS[:8]) == [TOKENS[:12]]
    assert chain_prefixes_for(A, tail, [0], TOKENS[:8]) == [TOKENS[:8]]
