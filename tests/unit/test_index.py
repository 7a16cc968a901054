"""The page index: residency, leases, child counts and prefix-aware eviction order."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.errors import InvalidArgument
from kvstore.index import PROTECTED_HITS, Index, PageEntry
from kvstore.keys import Tier

pytestmark = pytest.mark.unit

S1 = b"\x01" * 16
S2 = b"\x02" * 16


def k(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def page(
    name: str,
    parent: str | None = None,
    scope: bytes = S1,
    gpu: int | None = None,
    dram: int | None = None,
    ssd: bool = False,
    payload_bytes: int = 100,
) -> PageEntry:
    return PageEntry(
        key=k(name),
        parent=k(parent) if parent else scope,
        scope_digest=scope,
        header=b"hdr-" + name.encode(),
        payload_bytes=payload_bytes,
        gpu=gpu,
        dram=dram,
        ssd=ssd,
    )


def chain(
    index: Index, names: list[str], scope: bytes = S1, gpu: int | None = None, ssd: bool = False
) -> None:
    parent = None
    for name in names:
        index.insert(page(name, parent, scope, gpu=gpu, ssd=ssd))
        parent = name


def order(index: Index, tier: Tier) -> list[bytes]:
    return [e.key for e in index.eviction_candidates(tier)]


def ks(*names: str) -> list[bytes]:
    return [k(n) for n in names]


def test_insert_get_and_tier_accounting() -> None:
    index = Index()
    index.insert(page("a", gpu=0, ssd=True, payload_bytes=10))
    index.insert(page("b", "a", dram=64, payload_bytes=7))
    a = index.get(k("a"))
    assert a is not None and a.tiers == (Tier.GPU, Tier.SSD) and a.fastest is Tier.GPU
    assert index.get(k("nope")) is None
    assert len(index) == 2 and k("b") in index and k("c") not in index
    assert [index.pages_in(t) for t in Tier] == [1, 1, 1]
    assert [index.bytes_in(t) for t in Tier] == [10, 7, 10]
    assert index.children_in(k("a"), Tier.DRAM) == 1 and index.children_in(k("a"), Tier.GPU) == 0
    index.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [
        page("a"),  # resident nowhere
        page("a", gpu=-1),
        PageEntry(b"short", S1, S1, b"", 1, gpu=0),
        PageEntry(k("a"), k("a"), S1, b"", 1, gpu=0),  # its own parent
        PageEntry(k("a"), S1, S1, b"", -1, gpu=0),
        PageEntry(k("a"), S1, S1, b"", 1, gpu=True),
    ],
)
def test_insert_rejects_malformed_entries(bad: PageEntry) -> None:
    index = Index()
    with pytest.raises(InvalidArgument):
        index.insert(bad)
    assert len(index) == 0
    index.check_integrity()


def test_insert_twice_and_remove_absent_raise() -> None:
    index = Index()
    index.insert(page("a", gpu=0))
    with pytest.raises(InvalidArgument, match="already"):
        index.insert(page("a", dram=0))
    with pytest.raises(InvalidArgument, match="not in the index"):
        index.remove(k("zz"))
    assert index.remove(k("a")).header == b"hdr-a"
    assert len(index) == 0 and index.pages_in(Tier.GPU) == 0 and index.bytes_in(Tier.GPU) == 0
    index.check_integrity()


def test_set_residency_rules() -> None:
    index = Index()
    index.insert(page("a", gpu=0))
    with pytest.raises(InvalidArgument, match="nowhere"):
        index.set_residency(k("a"), Tier.GPU, None)
    with pytest.raises(InvalidArgument):
        index.set_residency(k("a"), Tier.SSD, 5)
    with pytest.raises(InvalidArgument):
        index.set_residency(k("a"), Tier.DRAM, True)
    with pytest.raises(InvalidArgument):
        index.set_residency(k("a"), Tier.DRAM, -3)
    index.set_residency(k("a"), Tier.DRAM, 4096)
    index.set_residency(k("a"), Tier.SSD, True)
    index.set_residency(k("a"), Tier.GPU, False)
    a = index.get(k("a"))
    assert a is not None and (a.gpu, a.dram, a.ssd) == (None, 4096, True)
    assert [index.pages_in(t) for t in Tier] == [0, 1, 1]
    index.check_integrity()


def test_relocation_changes_no_order() -> None:
    index = Index()
    chain(index, ["p", "c"], gpu=0)
    index.insert(page("x", gpu=1))
    index.insert(page("y", gpu=2))
    before = order(index, Tier.GPU)
    assert before == ks("c", "x", "y", "p")
    index.set_residency(k("c"), Tier.GPU, 64)
    index.set_residency(k("x"), Tier.GPU, 128)
    assert order(index, Tier.GPU) == before
    entry = index.get(k("c"))
    assert entry is not None and entry.gpu == 64 and index.pages_in(Tier.GPU) == 4
    index.check_integrity()


def test_leased_pages_never_move_or_go() -> None:
    index = Index()
    index.insert(page("a", gpu=0, dram=8))
    index.pin(k("a"))
    index.pin(k("a"))
    for move in (
        lambda: index.remove(k("a")),
        lambda: index.set_residency(k("a"), Tier.GPU, None),
        lambda: index.set_residency(k("a"), Tier.DRAM, 16),  # relocation is a move
    ):
        with pytest.raises(InvalidArgument, match="leased"):
            move()
    index.set_residency(k("a"), Tier.SSD, True)  # adding a copy is fine
    index.set_residency(k("a"), Tier.DRAM, 8)  # same place: no change
    assert order(index, Tier.GPU) == [] and order(index, Tier.SSD) == []
    index.unpin(k("a"))
    assert order(index, Tier.GPU) == []
    index.unpin(k("a"))
    assert order(index, Tier.GPU) == ks("a")
    with pytest.raises(InvalidArgument, match="not pinned"):
        index.unpin(k("a"))
    assert index.remove(k("a")).leases == 0
    index.check_integrity()


def test_leaves_go_before_their_parents() -> None:
    index = Index()
    chain(index, ["a1", "a2", "a3"], gpu=0)
    index.insert(page("x", gpu=0))
    assert order(index, Tier.GPU) == ks("a3", "x", "a1", "a2")
    assert index.children_in(k("a1"), Tier.GPU) == 1


def test_chain_unwinds_from_its_tail_when_demoted() -> None:
    index = Index()
    chain(index, ["a1", "a2", "a3"], gpu=0)
    chain(index, ["b1", "b2"], gpu=0)
    demoted: list[bytes] = []
    for entry in index.eviction_candidates(Tier.GPU):
        index.set_residency(entry.key, Tier.DRAM, len(demoted))
        index.set_residency(entry.key, Tier.GPU, None)
        demoted.append(entry.key)
        index.check_integrity()
    assert demoted == ks("a3", "a2", "a1", "b2", "b1")
    assert index.pages_in(Tier.GPU) == 0 and index.pages_in(Tier.DRAM) == 5
    assert index.children_in(k("a2"), Tier.DRAM) == 1


def test_probation_goes_before_protected() -> None:
    index = Index()
    index.insert(page("old", gpu=0))
    for _ in range(PROTECTED_HITS):
        index.touch(k("old"))
    index.insert(page("new", gpu=1))
    index.touch(k("new"))  # one hit: still on probation
    assert order(index, Tier.GPU) == ks("new", "old")
    index.insert(page("newer", gpu=2))
    index.touch(k("new"))  # now protected, and the most recent
    assert order(index, Tier.GPU) == ks("newer", "old", "new")
    entry = index.get(k("new"))
    assert entry is not None and entry.hits == 2


def test_touch_moves_to_most_recent_end() -> None:
    index = Index()
    for name in "abc":
        index.insert(page(name, dram=0))
    before = index.get(k("a"))
    assert before is not None
    stamp = before.last_access
    index.touch(k("a"))
    assert before.last_access > stamp and before.hits == 1
    assert order(index, Tier.DRAM) == ks("b", "c", "a")
    with pytest.raises(InvalidArgument):
        index.touch(k("zz"))


def test_pinned_never_yielded_and_unpin_counts_as_use() -> None:
    index = Index()
    for name in "abc":
        index.insert(page(name, gpu=0))
    index.pin(k("a"))
    assert order(index, Tier.GPU) == ks("b", "c")
    index.unpin(k("a"))
    assert order(index, Tier.GPU) == ks("b", "c", "a")


def test_scan_without_mutation_yields_each_once() -> None:
    index = Index()
    chain(index, ["a1", "a2", "a3"], ssd=True)
    chain(index, ["b1", "b2"], S2, ssd=True)
    got = order(index, Tier.SSD)
    assert sorted(got) == sorted(ks("a1", "a2", "a3", "b1", "b2"))
    assert got[:2] == ks("a3", "b2")


def test_mutation_of_others_during_iteration_is_seen() -> None:
    index = Index()
    chain(index, ["a1", "a2"], gpu=0)
    index.insert(page("x", gpu=0))
    it = index.eviction_candidates(Tier.GPU)
    assert next(it).key == k("a2")
    index.insert(page("y", gpu=0))  # a new leaf appears mid-iteration
    index.touch(k("x"))
    assert [e.key for e in it] == ks("y", "x", "a1")


def test_parent_turning_leaf_in_the_middle_is_placed_first() -> None:
    index = Index()
    chain(index, ["p", "c"], gpu=0)
    index.insert(page("x", gpu=0))
    index.touch(k("p"))  # p is now more recent than x ...
    index.insert(page("y", gpu=0))  # ... but older than y
    index.set_residency(k("c"), Tier.DRAM, 0)
    index.set_residency(k("c"), Tier.GPU, None)
    assert order(index, Tier.GPU) == ks("p", "x", "y")
    index.check_integrity()


def test_children_may_arrive_before_parent_and_outlive_it() -> None:
    index = Index()
    index.insert(page("c1", "p", gpu=0))
    index.insert(page("c2", "p", dram=0))
    index.insert(page("p", gpu=0, dram=1))
    assert index.children_in(k("p"), Tier.GPU) == 1
    assert index.children_in(k("p"), Tier.DRAM) == 1
    assert order(index, Tier.GPU) == ks("c1", "p")
    index.check_integrity()
    index.remove(k("p"))
    index.check_integrity()
    assert order(index, Tier.GPU) == ks("c1")
    index.insert(page("p", ssd=True))
    assert index.children_in(k("p"), Tier.GPU) == 1
    assert order(index, Tier.SSD) == ks("p")  # no child on ssd: a leaf there
    index.check_integrity()


def _layouts(index: Index) -> list[list[bytes]]:
    return [order(index, t) for t in (Tier.GPU, Tier.DRAM, Tier.SSD)]


def test_insert_many_files_as_inserting_one_by_one() -> None:
    """A chain, a lone page and a page whose parent is already stored, in one call, leave the
    index as the same inserts one at a time would, eviction order included."""
    specs = [("a", None), ("b", "a"), ("c", "b"), ("x", None), ("p2", "p1"), ("d", "c")]

    def fresh() -> Index:
        index = Index()
        index.insert(page("p1", dram=1))
        index.insert(page("old", dram=2))
        return index

    one_by_one, batched = fresh(), fresh()
    for name, parent in specs:
        one_by_one.insert(page(name, parent, dram=3))
    batched.insert_many([page(name, parent, dram=3) for name, parent in specs])
    batched.check_integrity()
    assert _layouts(batched) == _layouts(one_by_one)
    assert order(batched, Tier.DRAM) == ks("old", "x", "p2", "d", "p1", "a", "b", "c")
    assert [batched.children_in(k(n), Tier.DRAM) for n in ("p1", "a", "c", "d")] == [1, 1, 1, 0]


def test_insert_many_is_all_or_nothing() -> None:
    index = Index()
    index.insert(page("b", dram=1))
    for bad in (
        [page("a", dram=2), page("b", dram=2)],  # b is present
        [page("a", dram=2), page("a", dram=3)],  # a twice
        [page("a", dram=2), page("c")],  # c is resident nowhere
    ):
        with pytest.raises(InvalidArgument):
            index.insert_many(bad)
        assert len(index) == 1 and index.get(k("a")) is None
        index.check_integrity()
    for bad in ([page("a", dram=2), page("b", dram=2)], [page("a", dram=2), page("a", dram=3)]):
        with pytest.raises(InvalidArgument):  # checked entries: presence and repeats still count
            index.insert_many(bad, checked=True)
        assert len(index) == 1


def test_pin_as_hit_is_pin_and_touch() -> None:
    plain, hit = Index(), Index()
    for index in (plain, hit):
        chain(index, ["a", "b", "c"], ssd=True)
    plain.pin(k("a"))
    plain.touch(k("a"))
    hit.pin(k("a"), hit=True)
    for index in (plain, hit):
        assert index.get(k("a")).hits == 1  # type: ignore[union-attr]
        assert k("a") not in order(index, Tier.SSD)
        index.unpin(k("a"))
        index.check_integrity()
    assert _layouts(plain) == _layouts(hit)


def test_lookup_prefix_stops_at_gap_and_scope_mismatch() -> None:
    index = Index()
    chain(index, ["a1", "a2", "a3", "a4"], gpu=0)
    index.insert(page("b1", scope=S2, dram=0))
    assert [e.key for e in index.lookup_prefix(S1, ks("a1", "a2", "a3"))] == ks("a1", "a2", "a3")
    index.remove(k("a3"))
    assert [e.key for e in index.lookup_prefix(S1, ks("a1", "a2", "a3", "a4"))] == ks("a1", "a2")
    assert [e.key for e in index.lookup_prefix(S1, ks("a1", "b1", "a2"))] == ks("a1")
    assert index.lookup_prefix(S2, ks("a1")) == []
    assert index.lookup_prefix(S1, []) == []
    entry = index.get(k("a1"))
    assert entry is not None and entry.hits == 0  # a lookup is not a hit


def test_keys_of_scope() -> None:
    index = Index()
    chain(index, ["a1", "a2"], gpu=0)
    chain(index, ["b1"], S2, gpu=0)
    assert index.keys_of_scope(S1) == ks("a1", "a2")
    assert index.keys_of_scope(S2) == ks("b1")
    index.remove(k("b1"))
    assert index.keys_of_scope(S2) == []


def test_check_integrity_catches_direct_edits() -> None:
    index = Index()
    chain(index, ["a", "b"], gpu=0)
    entry = index.get(k("b"))
    assert entry is not None
    entry.gpu = None
    entry.dram = 0
    with pytest.raises(RuntimeError, match="index integrity"):
        index.check_integrity()


# ---- property test -----------------------------------------------------------------------------

# A universe of pages: two scopes, each a binary tree of depth 3 (14 pages).
PATHS = [p for n in (1, 2, 3) for p in itertools.product("01", repeat=n)]
UNIVERSE = {
    (scope, path): (k(f"{scope.hex()}/{''.join(path)}"), scope)
    for scope in (S1, S2)
    for path in PATHS
}
PARENT = {
    key: (UNIVERSE[(scope, path[:-1])][0] if len(path) > 1 else scope)
    for (scope, path), (key, _) in UNIVERSE.items()
}
SCOPE = {key: scope for key, scope in UNIVERSE.values()}
KEYS = sorted(PARENT)
LOWER = {Tier.GPU: Tier.DRAM, Tier.DRAM: Tier.SSD}

keys_st = st.sampled_from(KEYS)
tiers_st = st.sampled_from(list(Tier))


@dataclass
class Model:
    tiers: set[Tier] = field(default_factory=set)
    leases: int = 0
    hits: int = 0


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = Index()
        self.model: dict[bytes, Model] = {}

    def tiers_of(self, key: bytes) -> set[Tier]:
        return self.model[key].tiers

    def location(self, tier: Tier, where: int) -> int | bool:
        return True if tier is Tier.SSD else where

    @rule(key=keys_st, tiers=st.sets(tiers_st, min_size=1), where=st.integers(0, 99))
    def insert(self, key: bytes, tiers: set[Tier], where: int) -> None:
        entry = PageEntry(key, PARENT[key], SCOPE[key], b"h", 10 + key[0])
        entry.gpu = where if Tier.GPU in tiers else None
        entry.dram = where if Tier.DRAM in tiers else None
        entry.ssd = Tier.SSD in tiers
        if key in self.model:
            with pytest.raises(InvalidArgument):
                self.index.insert(entry)
            return
        self.index.insert(entry)
        self.model[key] = Model(set(tiers))

    @rule(key=keys_st, tiers=st.sets(tiers_st, min_size=1), where=st.integers(0, 99))
    def insert_path(self, key: bytes, tiers: set[Tier], where: int) -> None:
        """Insert `key` and its absent ancestors, root first, as a prefill publishes a chain."""
        path = [key]
        while PARENT[path[-1]] in PARENT:
            path.append(PARENT[path[-1]])
        for ancestor in reversed(path):
            if ancestor not in self.model:
                self.insert(ancestor, tiers, where)

    @rule(
        keys=st.lists(keys_st, min_size=1, max_size=6),
        tiers=st.sets(tiers_st, min_size=1),
        where=st.integers(0, 99),
    )
    def insert_many(self, keys: list[bytes], tiers: set[Tier], where: int) -> None:
        """Insert several pages in one call (any order, parents and children mixed): all or,
        when one is present or repeated, none."""
        entries = []
        for key in keys:
            entry = PageEntry(key, PARENT[key], SCOPE[key], b"h", 10 + key[0])
            entry.gpu = where if Tier.GPU in tiers else None
            entry.dram = where if Tier.DRAM in tiers else None
            entry.ssd = Tier.SSD in tiers
            entries.append(entry)
        if len(set(keys)) < len(keys) or any(key in self.model for key in keys):
            with pytest.raises(InvalidArgument):
                self.index.insert_many(entries)
            return
        self.index.insert_many(entries)
        for key in keys:
            self.model[key] = Model(set(tiers))

    @rule(key=keys_st)
    def pin_as_hit(self, key: bytes) -> None:
        if key in self.model:
            self.index.pin(key, hit=True)
            self.model[key].leases += 1
            self.model[key].hits += 1

    @rule(key=keys_st, tier=tiers_st, where=st.integers(0, 99), clear=st.booleans())
    def set_residency(self, key: bytes, tier: Tier, where: int, clear: bool) -> None:
        location = None if clear else self.location(tier, where)
        if key not in self.model:
            with pytest.raises(InvalidArgument):
                self.index.set_residency(key, tier, location)
            return
        entry = self.index.get(key)
        assert entry is not None
        tiers = self.tiers_of(key)
        current = {Tier.GPU: entry.gpu, Tier.DRAM: entry.dram, Tier.SSD: entry.ssd}[tier]
        unchanged = (tier not in tiers) if clear else (tier in tiers and current == location)
        refused = not unchanged and (
            (clear and tiers == {tier}) or (self.model[key].leases and tier in tiers)
        )
        if refused:
            with pytest.raises(InvalidArgument):
                self.index.set_residency(key, tier, location)
            return
        self.index.set_residency(key, tier, location)
        if clear:
            tiers.discard(tier)
        else:
            tiers.add(tier)

    @rule(key=keys_st)
    def touch(self, key: bytes) -> None:
        if key not in self.model:
            with pytest.raises(InvalidArgument):
                self.index.touch(key)
            return
        self.index.touch(key)
        self.model[key].hits += 1

    @rule(key=keys_st)
    def pin(self, key: bytes) -> None:
        if key in self.model:
            self.index.pin(key)
            self.model[key].leases += 1

    @rule(key=keys_st)
    def unpin(self, key: bytes) -> None:
        if key in self.model and self.model[key].leases:
            self.index.unpin(key)
            self.model[key].leases -= 1
        else:
            with pytest.raises(InvalidArgument):
                self.index.unpin(key)

    @rule(key=keys_st)
    def remove(self, key: bytes) -> None:
        if key not in self.model or self.model[key].leases:
            with pytest.raises(InvalidArgument):
                self.index.remove(key)
            return
        assert self.index.remove(key).key == key
        del self.model[key]

    @rule(tier=tiers_st, n=st.integers(1, 6))
    def evict(self, tier: Tier, n: int) -> None:
        """Move up to n candidates out of `tier`, as the store's evictor would."""
        seen: set[bytes] = set()
        for entry in self.index.eviction_candidates(tier):
            assert entry.key not in seen and tier in entry.tiers and entry.leases == 0
            seen.add(entry.key)
            tiers = self.tiers_of(entry.key)
            if tiers == {tier}:
                if tier in LOWER:
                    self.index.set_residency(entry.key, LOWER[tier], self.location(LOWER[tier], 7))
                    tiers.add(LOWER[tier])
                else:
                    self.index.remove(entry.key)
                    del self.model[entry.key]
                    if len(seen) == n:
                        break
                    continue
            self.index.set_residency(entry.key, tier, None)
            tiers.discard(tier)
            if len(seen) == n:
                break

    @invariant()
    def consistent(self) -> None:
        self.index.check_integrity()
        assert len(self.index) == len(self.model)
        for key, state in self.model.items():
            entry = self.index.get(key)
            assert entry is not None
            assert set(entry.tiers) == state.tiers
            assert (entry.leases, entry.hits) == (state.leases, state.hits)
        for tier in Tier:
            assert self.index.pages_in(tier) == sum(tier in s.tiers for s in self.model.values())
            self.check_order(tier)

    def check_order(self, tier: Tier) -> None:
        """Candidates = unpinned residents; probation leaves, protected leaves, then inner."""

        def rank(key: bytes) -> int:
            if any(PARENT[c] == key and tier in s.tiers for c, s in self.model.items()):
                return 2
            return 1 if self.model[key].hits >= PROTECTED_HITS else 0

        got = order(self.index, tier)
        want = {key for key, s in self.model.items() if tier in s.tiers and not s.leases}
        assert sorted(got) == sorted(want)
        ranks = [rank(key) for key in got]
        assert ranks == sorted(ranks)


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
