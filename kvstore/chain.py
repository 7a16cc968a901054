"""Key-chain verification on put: no client plants a page under a key it could not have computed.

A page's key is `chain_key(parent, tokens)` (client/contract/scope.py), and the chain of a scope starts at
its digest. The header checks the daemon already runs on every put (`client.contract.page.quick_check`,
`PageHeader.validate_for`) establish the first half: the key is the hash of the header's parent
and token ids. This module establishes the second: the parent is a key of *the same scope*. A
page is accepted when its parent is

1. the scope digest (the first page of a prompt),
2. a key earlier in the same put,
3. a key the index holds under the same scope digest, or
4. a key of the same scope in the bounded memory of keys verified earlier (`ChainMemory`): keys
   that passed this check on an earlier put, and keys that left the index (evicted, deleted). A
   parent that was evicted before its child is published — or whose own put is still being
   written by another reservation — does not make the child unpublishable.

A node may hold none of a put's ancestors: a cluster places each page on its own nodes, so a
page's parent is often on another node. Such a put carries *chain prefixes*: each the token ids
of a prompt's full pages from its first on, from which the node computes the ancestors' keys
itself (`prefix_keys`; hashed only when some parent is otherwise unknown). Any token ids chained
from the scope digest give keys of that scope, so a prefix can vouch for nothing it should not.

By induction every accepted key hashes a chain that starts at its scope's digest, so (BLAKE2b
being collision resistant) a client holding namespace B cannot publish, under B, the key of the
next page of a namespace-A prompt (which would shadow A's own put with ALREADY_PRESENT).

The memory holds `capacity` keys, least recently remembered first out (about 140 bytes a key in
CPython, by tracemalloc: the default 65536 keys take about 9 MiB). A page whose parent was
forgotten (65536 other keys left or were verified since) verifies only with a chain prefix: the
engine's publisher always sends one (the prompt's tokens before its first page).

Pure; no I/O. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from client.contract.scope import key_digest
from kvstore.errors import InvalidArgument

__all__ = [
    "DEFAULT_MEMORY_KEYS",
    "MAX_PREFIX_BYTES",
    "ChainMemory",
    "ChainRejected",
    "first_unverified",
    "prefix_keys",
]

DEFAULT_MEMORY_KEYS = 65536
MAX_PREFIX_BYTES = 4 << 20  # a chain prefix of up to 1Mi tokens (about 40 ms of hashing)


class ChainRejected(InvalidArgument):
    """A page's parent is not a key of its scope (INVALID_ARGUMENT "chain does not verify")."""

    def __init__(self, index: int, key: bytes, parent: bytes) -> None:
        super().__init__(
            f"chain does not verify: page {index} (key {key.hex()}) follows {parent.hex()}, "
            "which is neither the scope digest nor a key stored or verified under this scope"
        )
        self.index = index
        self.key = key
        self.parent = parent


class ChainMemory:
    """A bounded memory of verified keys: key -> the scope digest it was verified under.

    `remember` puts a key at the most recent end; once `capacity` keys are held, the least
    recently remembered goes. Mutates only in `remember` / `remember_many`.
    """

    def __init__(self, capacity: int = DEFAULT_MEMORY_KEYS) -> None:
        if capacity < 0:
            raise InvalidArgument(f"chain memory capacity must be >= 0, not {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def scope_of(self, key: bytes) -> bytes | None:
        """The scope digest `key` was verified under, or None when it is not remembered."""
        return self._keys.get(key)

    def remember(self, key: bytes, scope_digest: bytes) -> None:
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
        keys[key] = scope_digest
        if len(keys) > self.capacity:
            keys.popitem(last=False)

    def remember_many(self, keys: Sequence[bytes], scope_digest: bytes) -> None:
        for key in keys:
            self.remember(key, scope_digest)


def first_unverified(
    scope_digest: bytes,
    links: Sequence[tuple[bytes, bytes]],
    scope_of: Callable[[bytes], bytes | None],
) -> int | None:
    """The index of the first `(key, parent)` in `links` whose parent is not a key of
    `scope_digest` (see the module doc), or None when every link verifies.

    `scope_of(key)` answers for a key outside the put: the scope digest the daemon knows it under
    (the index, then the memory), or None. Keys earlier in `links` count as known, whether or not
    they are new; each parent is looked up at most once. Pure.
    """
    earlier: set[bytes] = set()
    for i, (key, parent) in enumerate(links):
        if parent != scope_digest and parent not in earlier and scope_of(parent) != scope_digest:
            return i
        earlier.add(key)
    return None


def prefix_keys(scope_digest: bytes, prefixes: Sequence[bytes], page_tokens: int) -> set[bytes]:
    """The keys of the full pages whose token ids (little-endian uint32) each of `prefixes`
    holds, chained from `scope_digest`. Raises InvalidArgument for a prefix that is not whole
    pages, or prefixes of more than `MAX_PREFIX_BYTES` in all. Pure."""
    page_bytes = 4 * page_tokens
    total = sum(len(p) for p in prefixes)
    if total > MAX_PREFIX_BYTES:
        raise InvalidArgument(f"chain prefixes of {total} bytes; the limit is {MAX_PREFIX_BYTES}")
    keys: set[bytes] = set()
    for prefix in prefixes:
        if len(prefix) % page_bytes:
            raise InvalidArgument(
                f"chain prefix of {len(prefix)} bytes is not whole pages of {page_tokens} tokens"
            )
        parent = scope_digest
        for start in range(0, len(prefix), page_bytes):
            parent = key_digest(parent + prefix[start : start + page_bytes])
            keys.add(parent)
    return keys
