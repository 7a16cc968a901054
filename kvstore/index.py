"""The page index: where each page lives, who pins it, and in what order it should leave a tier.

An entry records its residency as fields, one per tier (DESIGN §5): a GPU slab offset, a DRAM
segment offset, an SSD flag. A page is never nowhere: clearing its last tier is refused, the
caller removes it instead. Leased (pinned) pages never move or go.

Eviction is prefix-aware. For each tier the index keeps, for every entry, how many of its children
(entries whose `parent` is its key) are resident in that tier. An entry with none is a *leaf* of
the tier. Unpinned entries of a tier sit in one of three recency lists, in this eviction order:

1. probation leaves (hit fewer than twice), least recently used first;
2. protected leaves (hit twice or more), least recently used first;
3. inner entries (a child is resident in the tier), least recently used first — so a tier full
   of chains can still be emptied.

"Used in the tier" means: arrived in the tier (insert or `set_residency`), was hit (`touch`), or
had its last lease released (`unpin`); each of these puts the entry at the most-recent end. An
entry that changes list without being used (it became a leaf because its last child left the
tier, or stopped being one because a child arrived) keeps its stamp when that still orders it
first or last in its new list, and is otherwise placed first: the common case is a chain shrinking
from its tail, whose parent is the next page worth dropping.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

from client.contract.page import HEADER_FIXED_BYTES
from kvstore.chain import DEFAULT_MEMORY_KEYS, ChainMemory
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, Tier

__all__ = ["PROTECTED_HITS", "Index", "PageEntry"]

PROTECTED_HITS = 2  # hits at which a leaf moves from probation to protected

# Enum member lookups cost ~75 ns each on Python 3.11; the hot paths below use these names.
_GPU, _DRAM, _SSD = Tier.GPU, Tier.DRAM, Tier.SSD
_TIERS = (_GPU, _DRAM, _SSD)
_PROBATION, _PROTECTED, _INNER = 0, 1, 2
_SEGMENT_NAMES = ("probation", "protected", "inner")


@dataclass(slots=True)
class PageEntry:
    """One page's index record. `header` is the encoded page header, returned to readers as is.

    The entry returned by `Index.get` is the live record: read it, but change it only through
    `Index` methods (`check_integrity` catches direct edits of residency, hits or leases).
    """

    key: bytes
    parent: bytes
    scope_digest: bytes
    header: bytes
    payload_bytes: int
    gpu: int | None = None
    dram: int | None = None
    ssd: bool = False
    leases: int = 0
    hits: int = 0
    last_access: int = 0

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Tiers holding the page, fastest first."""
        if self.gpu is None:
            if self.dram is None:
                return _ONLY_SSD if self.ssd else ()
            return _DRAM_SSD if self.ssd else _ONLY_DRAM
        out: tuple[Tier, ...] = (_GPU,)
        if self.dram is not None:
            out += (_DRAM,)
        if self.ssd:
            out += (_SSD,)
        return out

    @property
    def fastest(self) -> Tier | None:
        """The fastest tier holding the page (None only for an entry not yet inserted)."""
        if self.gpu is not None:
            return _GPU
        if self.dram is not None:
            return _DRAM
        return _SSD if self.ssd else None


_ONLY_DRAM, _ONLY_SSD, _DRAM_SSD = (_DRAM,), (_SSD,), (_DRAM, _SSD)
_GPU_CODE, _DRAM_CODE, _SSD_CODE = int(_GPU), int(_DRAM), int(_SSD)
_PACKED_KEY = struct.Struct(f"{KEY_BYTES}s")


def _resident(entry: PageEntry, tier: Tier) -> bool:
    if tier is _GPU:
        return entry.gpu is not None
    if tier is _DRAM:
        return entry.dram is not None
    return entry.ssd


class Index:
    """Pages by key, with per-tier residency counts and per-tier eviction order."""

    def __init__(self, *, chain_memory_keys: int = DEFAULT_MEMORY_KEYS) -> None:
        self._entries: dict[bytes, PageEntry] = {}
        # keys verified under a scope (kvstore/chain.py): every key that leaves the index goes
        # here, so a child published after its parent left still verifies
        self.chain = ChainMemory(chain_memory_keys)
        self._children: dict[bytes, set[bytes]] = {}  # parent key -> present children's keys
        self._kids_in: dict[bytes, list[int]] = {}  # key -> children resident per tier
        self._scopes: dict[bytes, dict[bytes, None]] = {}
        self._pages = dict.fromkeys(_TIERS, 0)
        self._bytes = dict.fromkeys(_TIERS, 0)
        # per scope digest: payload bytes resident per tier (GPU, DRAM, SSD); and the namespace
        # each digest belongs to, as the store learns it from puts (kvstore/quota.py)
        self._digest_bytes: dict[bytes, list[int]] = {}
        self._digest_ns: dict[bytes, str] = {}
        self._ns_digests: dict[str, set[bytes]] = {}
        # per namespace: payload bytes resident per tier, the sum over its digests (kept as they
        # change: a namespace of many scopes, a tenant's cache salts, costs no more per put)
        self._ns_bytes: dict[str, list[int]] = {}
        # tier -> scope digest -> its keys resident in the tier, least recently used first
        # (pinned ones included): a namespace's own eviction order (`scope_candidates`)
        self._scope_lru: dict[Tier, dict[bytes, OrderedDict[bytes, None]]] = {t: {} for t in _TIERS}
        # tier -> (probation, protected, inner); values are the entry's stamp in that tier.
        self._order: dict[Tier, tuple[OrderedDict[bytes, int], ...]] = {
            t: (OrderedDict(), OrderedDict(), OrderedDict()) for t in _TIERS
        }
        self._tick = 0
        self._version = 0  # bumped on every change of an order list; iterators restart on it

    # ---- reads (none of these mutate) -------------------------------------------------------

    def get(self, key: bytes) -> PageEntry | None:
        """The live entry for `key`, or None."""
        return self._entries.get(key)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """Every key in the index (a snapshot). Read-only."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def pages_in(self, tier: Tier) -> int:
        """Number of pages resident in `tier`."""
        return self._pages[tier]

    def bytes_in(self, tier: Tier) -> int:
        """Payload bytes of the pages resident in `tier` (headers not counted)."""
        return self._bytes[tier]

    def children_in(self, key: bytes, tier: Tier) -> int:
        """How many children of `key` are resident in `tier`; raises InvalidArgument if absent."""
        return self._kids_in[self._entry(key).key][tier - 1]

    def scope_of(self, key: bytes) -> bytes | None:
        """The scope digest `key` is known under: its entry's, else the chain memory's, else
        None. Read-only."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry.scope_digest
        return self.chain.scope_of(key)

    def name_scope(self, scope_digest: bytes, namespace: str) -> None:
        """Record that `scope_digest` is a scope of `namespace` (a put of it says so): its pages,
        already present or to come, count toward that namespace. Forgotten when the scope's last
        page goes. Mutates (no entry)."""
        if self._digest_ns.get(scope_digest) == namespace:
            return
        old = self._digest_ns.get(scope_digest)
        held = self._digest_bytes.get(scope_digest, (0, 0, 0))
        if old is not None:  # a digest names one scope: only a collision could get here
            self._ns_digests[old].discard(scope_digest)
            self._ns_add(old, held, -1)
        self._digest_ns[scope_digest] = namespace
        self._ns_digests.setdefault(namespace, set()).add(scope_digest)
        self._ns_add(namespace, held, 1)

    def _ns_add(self, namespace: str, held: Sequence[int], sign: int) -> None:
        totals = self._ns_bytes.setdefault(namespace, [0, 0, 0])
        for i, n in enumerate(held):
            totals[i] += sign * n

    def namespace_of(self, scope_digest: bytes) -> str | None:
        """The namespace a scope digest was named under, or None. Read-only."""
        return self._digest_ns.get(scope_digest)

    def namespace_bytes(self, namespace: str, tier: Tier) -> int:
        """Payload bytes of `namespace`'s pages resident in `tier`. Read-only; O(1)."""
        held = self._ns_bytes.get(namespace)
        return held[tier - 1] if held is not None else 0

    def namespaces(self) -> list[str]:
        """The namespaces named so far that still have pages (or a put naming them)."""
        return [ns for ns, digests in self._ns_digests.items() if digests]

    def digests_of(self, namespace: str) -> frozenset[bytes]:
        """The scope digests named under `namespace`. Read-only."""
        return frozenset(self._ns_digests.get(namespace, ()))

    def scope_candidates(self, tier: Tier, digests: frozenset[bytes]) -> Iterator[PageEntry]:
        """Unpinned entries of the scopes `digests` resident in `tier`, least recently used
        first (across the scopes by `last_access`): the order in which a namespace's own pages
        leave a tier. Lazy and safe to mutate between steps, as `eviction_candidates`; each
        entry is yielded at most once per iterator."""
        lru = self._scope_lru[tier]
        yielded: set[bytes] = set()
        while True:
            best: PageEntry | None = None
            for digest in digests:
                for key in lru.get(digest, ()):
                    if key in yielded:
                        continue
                    entry = self._entries[key]
                    if entry.leases:
                        continue
                    if best is None or entry.last_access < best.last_access:
                        best = entry
                    break
            if best is None:
                return
            yielded.add(best.key)
            yield best

    def keys_of_scope(self, scope_digest: bytes) -> list[bytes]:
        """Keys of the pages of one scope, in insertion order."""
        return list(self._scopes.get(scope_digest, ()))

    def lookup_prefix(self, scope_digest: bytes, keys: Sequence[bytes]) -> list[PageEntry]:
        """Entries of the longest present prefix of `keys`: stops at the first key that is absent
        or belongs to another scope. Does not count as a hit (the caller `touch`es what it uses)."""
        found: list[PageEntry] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.scope_digest != scope_digest:
                break
            found.append(entry)
        return found

    def prefix_tier_codes(
        self, scope_digest: bytes, packed_keys: bytes, gone: set[bytes] | frozenset[bytes]
    ) -> bytes:
        """`lookup_prefix` over packed 16-byte keys, answering only the fastest tier of each hit
        as its `Tier` value (one byte a page); a key in `gone` ends the prefix too. The lookup's
        fast path: no list of keys, no list of entries. Read-only."""
        codes = bytearray()
        add = codes.append
        get = self._entries.get
        whole = len(packed_keys) - len(packed_keys) % KEY_BYTES  # a partial key at the end: out
        packed = packed_keys if whole == len(packed_keys) else packed_keys[:whole]
        for (key,) in _PACKED_KEY.iter_unpack(packed):  # split in C: ~20 % off a 512-hit walk
            entry = get(key)
            if entry is None or entry.scope_digest != scope_digest or (gone and key in gone):
                break
            add(
                _GPU_CODE
                if entry.gpu is not None
                else _DRAM_CODE
                if entry.dram is not None
                else _SSD_CODE
            )
        return bytes(codes)

    def eviction_candidates(self, tier: Tier) -> Iterator[PageEntry]:
        """Unpinned entries resident in `tier`, in the order they should leave it (module doc).

        Lazy: each step reads the live lists, so the caller may demote or remove the entry just
        yielded (or change anything else) before asking for the next; each entry is yielded at most
        once per iterator. O(1) per step when the caller moves each yielded entry out of the tier
        or changes nothing; entries it leaves in place are skipped again after each change.
        """
        segments = self._order[tier]
        yielded: set[bytes] = set()
        version = -1
        seg = 0
        cursor: Iterator[bytes] = iter(())
        while True:
            if version != self._version:  # something changed: rescan from the head
                version, seg, cursor = self._version, 0, iter(segments[0])
            key = next(cursor, None)
            if key is None:
                seg += 1
                if seg == len(segments):
                    return
                cursor = iter(segments[seg])
                continue
            if key not in yielded:
                yielded.add(key)
                yield self._entries[key]

    # ---- mutations --------------------------------------------------------------------------

    def insert(self, entry: PageEntry) -> None:
        """Add a page (mutates: stamps `entry.last_access` with a new tick; the index keeps the
        object, and `hits`/`leases` count as given — an entry may arrive pinned). Raises
        InvalidArgument if the key is present, the entry is resident nowhere, or a field is
        malformed (keys and digests are 16 bytes, counts non-negative)."""
        _validate(entry)
        if entry.key in self._entries:
            raise InvalidArgument(f"page {entry.key.hex()} is already in the index")
        self._insert(entry)

    def insert_many(self, entries: Sequence[PageEntry], *, checked: bool = False) -> None:
        """`insert` each entry in order, in one call: all of them or (raising InvalidArgument,
        for any entry `insert` would refuse or a key given twice) none. `checked`: the caller
        built the entries from validated page headers, so their fields are not checked again
        (presence and duplicates still are).

        The same result as inserting them one by one, but every entry is registered before any
        is filed, so a parent arriving with its children in the same call is filed once, in the
        list it ends up in, instead of being refiled as each child arrives.
        """
        batch: set[bytes] = set()
        for entry in entries:
            if not checked:
                _validate(entry)
            key = entry.key
            if key in self._entries or key in batch:
                raise InvalidArgument(f"page {key.hex()} is already in the index")
            batch.add(key)
        for entry in entries:
            self._register(entry)
        for entry in entries:
            self._count_children(entry.key)
        for entry in entries:
            self._tick += 1
            entry.last_access = self._tick
            parent_counted = entry.parent in batch  # its count above included this entry
            for t in entry.tiers:
                self._arrive(entry, t, parent_counted=parent_counted)

    def _insert(self, entry: PageEntry) -> None:
        self._register(entry)
        self._count_children(entry.key)
        self._tick += 1
        entry.last_access = self._tick
        for t in entry.tiers:
            self._arrive(entry, t)

    def _register(self, entry: PageEntry) -> None:
        key = entry.key
        self._entries[key] = entry
        scope = self._scopes.get(entry.scope_digest)
        if scope is None:
            scope = self._scopes[entry.scope_digest] = {}
            self._digest_bytes[entry.scope_digest] = [0, 0, 0]
        scope[key] = None
        self._children.setdefault(entry.parent, set()).add(key)

    def _count_children(self, key: bytes) -> None:
        kids = [0, 0, 0]
        for child in self._children.get(key, ()):
            for t in self._entries[child].tiers:
                kids[t - 1] += 1
        self._kids_in[key] = kids

    def remove(self, key: bytes) -> PageEntry:
        """Drop a page and return its entry. Its children stay valid entries (a later page with
        this key becomes their parent again). Raises InvalidArgument if absent or leased."""
        entry = self._entry(key)
        if entry.leases:
            raise InvalidArgument(f"page {key.hex()} is leased ({entry.leases}) and cannot go")
        for t in entry.tiers:
            self._leave(entry, t)
        del self._entries[key], self._kids_in[key]
        self.chain.remember(key, entry.scope_digest)
        scope = self._scopes[entry.scope_digest]
        del scope[key]
        if not scope:
            digest = entry.scope_digest
            del self._scopes[digest], self._digest_bytes[digest]
            namespace = self._digest_ns.pop(digest, None)
            if namespace is not None:
                named = self._ns_digests[namespace]
                named.discard(digest)
                if not named:
                    del self._ns_digests[namespace]
                    self._ns_bytes.pop(namespace, None)  # all zero: its pages have left
        siblings = self._children[entry.parent]
        siblings.discard(key)
        if not siblings:
            del self._children[entry.parent]
        return entry

    def seal_header(self, key: bytes, header: bytes) -> None:
        """Replace a page's header by the same header with its payload checksum filled in (the
        daemon's checksum of a same-host put, client/contract/page.py `seal_header`). Mutates
        the entry; InvalidArgument if the page is absent or `header` is not the stored one
        sealed (same length, and the same bytes but for the flags and the two checksums)."""
        entry = self._entry(key)
        old = entry.header
        fixed = HEADER_FIXED_BYTES - 8
        if (
            len(header) != len(old)
            or header[:6] != old[:6]
            or header[8:fixed] != old[8:fixed]
            or header[HEADER_FIXED_BYTES:-8] != old[HEADER_FIXED_BYTES:-8]
        ):
            raise InvalidArgument(f"page {key.hex()}: a sealed header must be its own header")
        entry.header = header

    def set_residency(self, key: bytes, tier: Tier, location: int | bool | None) -> None:
        """Record where a page lives in `tier`: an offset (GPU, DRAM) or True (SSD) sets it; None
        or False clears it. Mutates the entry; arriving in a tier counts as a use there (most-recent
        end), leaving takes it out of the tier's order, a new offset in the same tier (relocation)
        changes no order.

        Raises InvalidArgument if the page is absent, the location does not fit the tier, clearing
        would leave the page nowhere (remove it instead), or the page is leased and the change
        would clear or relocate an existing copy (leased pages never move; adding a copy is fine).
        """
        entry = self._entry(key)
        clear = location is None or location is False
        offset: int | None = None
        if not clear:
            if tier is Tier.SSD:
                if location is not True:
                    raise InvalidArgument(f"ssd residency is True/False/None, not {location!r}")
            elif isinstance(location, bool) or not isinstance(location, int) or location < 0:
                raise InvalidArgument(f"{tier.name.lower()} residency needs an offset >= 0")
            else:
                offset = location
        was = _resident(entry, tier)
        if clear and not was:
            return
        if not clear and was and (tier is Tier.SSD or offset == _location(entry, tier)):
            return
        if entry.leases and was:
            raise InvalidArgument(f"page {key.hex()} is leased: its {tier.name.lower()} copy stays")
        if clear and entry.tiers == (tier,):
            raise InvalidArgument(f"clearing {tier.name.lower()} would leave {key.hex()} nowhere")
        if clear:
            self._leave(entry, tier)
        if tier is Tier.GPU:
            entry.gpu = offset
        elif tier is Tier.DRAM:
            entry.dram = offset
        else:
            entry.ssd = not clear
        if not was:
            self._arrive(entry, tier)

    def touch(self, key: bytes) -> None:
        """Count a hit: bump `hits`, stamp `last_access` with a new tick, and move the page to the
        most-recent end in every tier holding it. Raises InvalidArgument if absent."""
        entry = self._entry(key)
        entry.hits += 1
        self._tick += 1
        entry.last_access = self._tick
        for t in entry.tiers:
            self._scope_lru[t][entry.scope_digest].move_to_end(key)
        if entry.leases:  # a pinned page is in no eviction list; unpin files it as fresh
            return
        for t in entry.tiers:
            self._refile(entry, t, fresh=True)

    def pin(self, key: bytes, *, hit: bool = False) -> None:
        """Take one lease on a page: while pinned it is never yielded, moved or removed. With
        `hit`, also count a hit as `touch` does (one call for a reader's acquire).
        Raises InvalidArgument if absent."""
        entry = self._entry(key)
        if not entry.leases:  # leaves its lists: each is the one its state names (invariant)
            for t in entry.tiers:
                current = self._segment(entry, t)
                if current is not None:
                    del self._order[t][current][key]
                    self._version += 1
        entry.leases += 1
        if hit:
            entry.hits += 1
            self._tick += 1
            entry.last_access = self._tick

    def unpin(self, key: bytes) -> None:
        """Release one lease; the last release counts as a use (most-recent end of its lists).
        Raises InvalidArgument if absent or not pinned."""
        entry = self._entry(key)
        if entry.leases <= 0:
            raise InvalidArgument(f"page {key.hex()} is not pinned")
        entry.leases -= 1
        if entry.leases == 0:  # in no list while pinned: file it at the most-recent end
            self._tick += 1
            for t in entry.tiers:
                self._scope_lru[t][entry.scope_digest].move_to_end(key)
                want = self._segment(entry, t)
                if want is not None:
                    self._order[t][want][key] = self._tick
                    self._version += 1

    # ---- internals --------------------------------------------------------------------------

    def _entry(self, key: bytes) -> PageEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise InvalidArgument(f"page {key.hex()} is not in the index")
        return entry

    def _segment(self, entry: PageEntry, tier: Tier) -> int | None:
        """The list `entry` belongs in for `tier`, or None (pinned or not resident)."""
        if entry.leases or not _resident(entry, tier):
            return None
        if self._kids_in[entry.key][tier - 1]:
            return _INNER
        return _PROTECTED if entry.hits >= PROTECTED_HITS else _PROBATION

    def _refile(self, entry: PageEntry, tier: Tier, fresh: bool) -> None:
        """Put `entry` in the list its state calls for; `fresh` = it was just used (new stamp)."""
        segments = self._order[tier]
        key = entry.key
        current = None
        for i, members in enumerate(segments):
            if key in members:
                current = i
                break
        want = self._segment(entry, tier)
        if current == want and not fresh:
            return
        self._version += 1
        stamp = self._tick
        if current is not None:
            old = segments[current].pop(key)
            stamp = self._tick if fresh else old
        if want is None:
            return
        target = segments[want]
        if fresh or not target or stamp >= next(reversed(target.values())):
            target[key] = stamp
            return
        first = next(iter(target.values()))
        target[key] = stamp if stamp <= first else first - 1
        target.move_to_end(key, last=False)

    def _arrive(self, entry: PageEntry, tier: Tier, *, parent_counted: bool = False) -> None:
        """`entry` (already in `_entries`) became resident in `tier`: counts, parent, lists.
        `parent_counted`: the parent's child counts already include this arrival."""
        self._pages[tier] += 1
        self._bytes[tier] += entry.payload_bytes
        self._digest_bytes[entry.scope_digest][tier - 1] += entry.payload_bytes
        namespace = self._digest_ns.get(entry.scope_digest)
        if namespace is not None:
            self._ns_bytes[namespace][tier - 1] += entry.payload_bytes
        lru = self._scope_lru[tier].get(entry.scope_digest)
        if lru is None:
            lru = self._scope_lru[tier][entry.scope_digest] = OrderedDict()
        lru[entry.key] = None
        self._tick += 1
        # just arrived in `tier`, so in none of its lists yet: file it fresh (what _refile does
        # for this case, without looking for it first)
        want = self._segment(entry, tier)
        if want is not None:
            self._version += 1
            self._order[tier][want][entry.key] = self._tick
        if parent_counted:
            return
        parent = self._entries.get(entry.parent)
        if parent is not None:
            kids = self._kids_in[parent.key]
            kids[tier - 1] += 1
            if kids[tier - 1] == 1:
                self._refile(parent, tier, fresh=False)

    def _leave(self, entry: PageEntry, tier: Tier) -> None:
        """`entry` is about to stop being resident in `tier`: counts, parent, lists."""
        self._pages[tier] -= 1
        self._bytes[tier] -= entry.payload_bytes
        self._digest_bytes[entry.scope_digest][tier - 1] -= entry.payload_bytes
        namespace = self._digest_ns.get(entry.scope_digest)
        if namespace is not None:
            self._ns_bytes[namespace][tier - 1] -= entry.payload_bytes
        lru = self._scope_lru[tier][entry.scope_digest]
        del lru[entry.key]
        if not lru:
            del self._scope_lru[tier][entry.scope_digest]
        for segment in self._order[tier]:
            if segment.pop(entry.key, None) is not None:
                self._version += 1
        parent = self._entries.get(entry.parent)
        if parent is not None:
            kids = self._kids_in[parent.key]
            kids[tier - 1] -= 1
            if kids[tier - 1] == 0:
                self._refile(parent, tier, fresh=False)

    def check_integrity(self) -> None:
        """Recompute every derived structure from the entries and compare: child links and
        counts, per-tier page and byte counts, the scope index, and the order lists (membership,
        list, stamp order). Does not mutate; raises RuntimeError naming the first mismatch."""

        def fail(message: str) -> NoReturn:
            raise RuntimeError(f"index integrity: {message}")

        children: dict[bytes, set[bytes]] = {}
        scopes: dict[bytes, set[bytes]] = {}
        pages = dict.fromkeys(_TIERS, 0)
        nbytes = dict.fromkeys(_TIERS, 0)
        for key, entry in self._entries.items():
            if entry.key != key:
                fail(f"entry filed under {key.hex()} has key {entry.key.hex()}")
            try:
                _validate(entry)
            except InvalidArgument as exc:
                fail(f"entry {key.hex()}: {exc}")
            if entry.last_access > self._tick:
                fail(f"entry {key.hex()} last_access {entry.last_access} > tick {self._tick}")
            children.setdefault(entry.parent, set()).add(key)
            scopes.setdefault(entry.scope_digest, set()).add(key)
            for t in entry.tiers:
                pages[t] += 1
                nbytes[t] += entry.payload_bytes
        if children != self._children:
            fail("parent -> children links differ from the entries' parent fields")
        if scopes != {d: set(keys) for d, keys in self._scopes.items()}:
            fail("scope index differs from the entries' scope digests")
        per_digest: dict[bytes, list[int]] = {d: [0, 0, 0] for d in scopes}
        for entry in self._entries.values():
            for t in entry.tiers:
                per_digest[entry.scope_digest][t - 1] += entry.payload_bytes
        if per_digest != self._digest_bytes:
            fail("per-scope byte counts differ from the entries'")
        for t in _TIERS:
            resident: dict[bytes, set[bytes]] = {}
            for key, entry in self._entries.items():
                if _resident(entry, t):
                    resident.setdefault(entry.scope_digest, set()).add(key)
            if resident != {d: set(keys) for d, keys in self._scope_lru[t].items()}:
                fail(f"{t.name.lower()} per-scope recency lists differ from residency")
        if set(self._digest_ns) - set(self._digest_bytes):
            fail("a namespace is recorded for a scope with no pages")
        if {d for ds in self._ns_digests.values() for d in ds} != set(self._digest_ns):
            fail("namespace -> scopes differs from scope -> namespace")
        ns_bytes: dict[str, list[int]] = {}
        for digest, namespace in self._digest_ns.items():
            totals = ns_bytes.setdefault(namespace, [0, 0, 0])
            for i, n in enumerate(self._digest_bytes[digest]):
                totals[i] += n
        kept = {ns: b for ns, b in self._ns_bytes.items() if any(b)}
        if {ns: b for ns, b in ns_bytes.items() if any(b)} != kept:
            fail("per-namespace byte counts differ from their scopes'")
        if set(self._ns_bytes) - set(self._ns_digests):
            fail("byte counts are kept for a namespace with no scope")
        if pages != self._pages or nbytes != self._bytes:
            fail(f"tier counts {self._pages}/{self._bytes}, recomputed {pages}/{nbytes}")
        if self._kids_in.keys() != self._entries.keys():
            fail("child counts are kept for a different set of keys than the entries")
        for key in self._entries:
            kids = [0, 0, 0]
            for child in children.get(key, ()):
                for t in self._entries[child].tiers:
                    kids[t - 1] += 1
            if kids != self._kids_in[key]:
                fail(f"children of {key.hex()} per tier: kept {self._kids_in[key]}, real {kids}")
        for t in _TIERS:
            listed: set[bytes] = set()
            for i, segment in enumerate(self._order[t]):
                where = f"{t.name.lower()} {_SEGMENT_NAMES[i]}"
                stamps = list(segment.values())
                if any(a > b for a, b in itertools.pairwise(stamps)):
                    fail(f"{where} list is not in stamp order: {stamps}")
                if stamps and stamps[-1] > self._tick:
                    fail(f"{where} list has a stamp past the tick {self._tick}")
                for key in segment:
                    held = self._entries.get(key)
                    if key in listed or held is None or self._segment(held, t) != i:
                        fail(f"{where} list wrongly holds {key.hex()}")
                    listed.add(key)
            due = {k for k, e in self._entries.items() if self._segment(e, t) is not None}
            if listed != due:
                fail(f"{t.name.lower()} lists miss {len(due - listed)} unpinned resident pages")


def _location(entry: PageEntry, tier: Tier) -> int | bool | None:
    if tier is _GPU:
        return entry.gpu
    if tier is _DRAM:
        return entry.dram
    return entry.ssd


def _validate(entry: PageEntry) -> None:
    """Raise InvalidArgument unless `entry` is well-formed and resident somewhere."""
    key, parent, digest = entry.key, entry.parent, entry.scope_digest
    if not (
        type(key) is bytes
        and type(parent) is bytes
        and type(digest) is bytes
        and len(key) == len(parent) == len(digest) == KEY_BYTES
    ):
        for name in ("key", "parent", "scope_digest"):
            value = getattr(entry, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise InvalidArgument(f"PageEntry.{name} must be {KEY_BYTES} bytes")
    if key == parent:
        raise InvalidArgument(f"page {key.hex()} is its own parent")
    for name in ("payload_bytes", "leases", "hits"):
        value = getattr(entry, name)
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"PageEntry.{name} must be an int >= 0, not {value!r}")
    for name in ("gpu", "dram"):
        value = getattr(entry, name)
        if value is not None and (type(value) is not int or value < 0):
            raise InvalidArgument(f"PageEntry.{name} must be None or an offset >= 0")
    if type(entry.ssd) is not bool:
        raise InvalidArgument("PageEntry.ssd must be a bool")
    if entry.gpu is None and entry.dram is None and not entry.ssd:
        raise InvalidArgument(f"page {key.hex()} is resident in no tier")
