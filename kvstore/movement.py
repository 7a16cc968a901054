"""Moving pages between tiers: demotion, promotion, making room, dropping.

`Tiers` bundles the tier objects with the index, the admission policy, counters and events, and
implements the movement rules of DESIGN §5. Every method here must be called with the store lock
held (the store and the mover own that lock), and none does disk I/O: a page that must be
written to SSD before it can leave DRAM is not demoted here (`demote_dram` raises
`NeedsDemotion`); `plan_dram_room` names such pages, and the mover writes them with the lock
free (`Mover.copy_to_ssd`: plan under the lock, I/O outside, apply under the lock). SSD deletes
only change the SSD tier's accounting (its tombstones are written later, by the mover).

Invariant kept by every method: a page is never nowhere. A demotion writes the lower tier before
it clears the upper one; a page that cannot go lower is dropped whole (and an event says so).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from kvstore.errors import CapacityExhausted
from kvstore.events import EventKind, EventLog
from kvstore.index import Index, PageEntry
from kvstore.keys import Tier
from kvstore.metrics import StoreCounters, TierGauge
from kvstore.policy import SsdAdmission
from kvstore.quota import Quotas
from kvstore.tiers.dram import DramTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

# Stop looking for victims after this many candidates in one call (all pinned, say).
_MAX_VICTIM_SCAN = 100_000


class NeedsDemotion(CapacityExhausted):
    """DRAM has room only once `victim` is written to SSD (disk I/O: not under the lock)."""

    def __init__(self, victim: PageEntry, retry_after_s: float) -> None:
        super().__init__(
            f"DRAM full: page {victim.key.hex()} must be written to SSD first",
            retry_after_s=retry_after_s,
        )
        self.victim = victim


class Tiers:
    """The tier objects plus the movement rules between them. Caller holds the store lock."""

    def __init__(
        self,
        index: Index,
        dram: DramTier,
        ssd: SsdTier | None,
        gpu: GpuTier | None,
        admission: SsdAdmission,
        counters: StoreCounters,
        events: EventLog,
        retry_after_s: float = 0.5,
        quotas: Quotas | None = None,
    ) -> None:
        self.index = index
        self.dram = dram
        self.ssd = ssd
        self.gpu = gpu
        self.admission = admission
        self.counters = counters
        self.events = events
        self.retry_after_s = retry_after_s
        self.quotas = quotas or Quotas()

    # ---- eviction order across namespaces (kvstore/quota.py) --------------------------------

    def over_share(self, tier: Tier) -> frozenset[bytes]:
        """Scope digests of the namespaces holding more of `tier` than their quota."""
        quotas = self.quotas
        if not quotas.enabled:
            return frozenset()
        over: set[bytes] = set()
        for namespace in self.index.namespaces():
            limit = quotas.limit(namespace, tier)
            if limit and self.index.namespace_bytes(namespace, tier) > limit:
                over |= self.index.digests_of(namespace)
        return frozenset(over)

    def candidates(self, tier: Tier, only: frozenset[bytes] | None = None) -> Iterator[PageEntry]:
        """`Index.eviction_candidates(tier)`, pages of namespaces over their share of the tier
        first, least recently used first (`Index.scope_candidates`), then every page in the
        index's order (one a caller left in place may come twice). With `only`: just the pages
        of those scope digests. Lazy, as the index's iterators."""
        first = self.over_share(tier) if only is None else only
        if first:  # those namespaces' own pages, least recently used first
            yield from self.index.scope_candidates(tier, first)
        if only is None:
            yield from self.index.eviction_candidates(tier)

    # ---- allocation with eviction ---------------------------------------------------------

    def allocate_dram(self, n_bytes: int) -> int:
        """A DRAM block of n_bytes, demoting unpinned pages as needed (those that need no disk
        I/O: dropped, or already on SSD). Mutates.

        Raises NeedsDemotion when the next page to leave must be written to SSD first (the
        caller has it written with the lock free, see `plan_dram_room`, and tries again), or
        CapacityExhausted (with a retry hint) when nothing more can leave DRAM.
        """
        offset = self.dram.allocate(n_bytes)
        scanned = 0
        while offset is None:
            victim = next(self.candidates(Tier.DRAM), None)
            if victim is None or scanned > _MAX_VICTIM_SCAN:
                with self.counters.lock:
                    self.counters.refused_full += 1
                raise CapacityExhausted(
                    f"DRAM tier full: no unleased page can leave to make room for {n_bytes} bytes",
                    retry_after_s=self.retry_after_s,
                )
            self.demote_dram(victim)
            scanned += 1
            offset = self.dram.allocate(n_bytes)
        return offset

    def allocate_dram_many(self, n_bytes: int, count: int) -> list[int]:
        """`count` DRAM blocks of n_bytes, as `allocate_dram` gives one (demoting as needed).
        Mutates. Raises CapacityExhausted (having freed what it took) when they do not fit."""
        offsets = self.dram.allocate_many(n_bytes, count)
        try:
            while len(offsets) < count:
                offsets.append(self.allocate_dram(n_bytes))
        except CapacityExhausted:
            for offset in offsets:
                self.dram.free(offset)
            raise
        return offsets

    def allocate_gpu(self, n_bytes: int) -> int:
        """A GPU block of n_bytes, demoting GPU pages to DRAM as needed. Mutates; may raise."""
        assert self.gpu is not None
        offset = self.gpu.allocate(n_bytes)
        while offset is None:
            victim = next(self.index.eviction_candidates(Tier.GPU), None)
            if victim is None:
                with self.counters.lock:
                    self.counters.refused_full += 1
                raise CapacityExhausted(
                    f"GPU tier full: nothing can leave to make room for {n_bytes} bytes",
                    retry_after_s=self.retry_after_s,
                )
            self.demote_gpu(victim)
            offset = self.gpu.allocate(n_bytes)
        return offset

    def needs_ssd_write(self, entry: PageEntry) -> bool:
        """Whether `entry` must be written to SSD before it can leave DRAM (it is admitted there
        and has no copy in another tier)."""
        return (
            self.ssd is not None
            and entry.gpu is None
            and not entry.ssd
            and self.admission.admit(entry)
        )

    def plan_dram_room(self, page_bytes: int, count: int = 1) -> list[PageEntry]:
        """Make room for `count` pages of `page_bytes` in DRAM as far as it takes no disk I/O,
        and name the next page that must be written to SSD to make the rest (none: there is
        room, or nothing can leave). Mutates (demotes the pages that need no write); the caller
        writes the named one with the lock free, then asks again."""
        slot = self.dram.slot_bytes_for(page_bytes)

        def short() -> int:  # bytes still missing (0 when the pages fit now)
            free = self.dram.capacity_bytes - self.dram.used_bytes
            if free >= slot * count and self.dram.largest_free_slot() >= slot:
                return 0
            return max(slot * count - free, slot)

        for scanned, victim in enumerate(self.candidates(Tier.DRAM)):
            if short() == 0 or scanned > _MAX_VICTIM_SCAN:
                break
            if victim.dram is None:
                continue
            if self.needs_ssd_write(victim):
                # one at a time: once it is gone its parent may be the next leaf to go
                return [victim]
            self.demote_dram(victim)  # dropped, or its SSD copy kept: no I/O
        return []

    def make_room_ssd(
        self, n_bytes: int, scope_digest: bytes = b"", payload_bytes: int = 0
    ) -> None:
        """Evict SSD pages until n_bytes more fit, for a page of `scope_digest` with
        `payload_bytes` of payload: first, while its namespace would be over its SSD quota, that
        namespace's own pages. Mutates; raises CapacityExhausted if it cannot."""
        ssd = self.ssd
        assert ssd is not None
        if n_bytes > ssd.capacity_bytes:
            raise CapacityExhausted(f"page of {n_bytes} bytes exceeds the SSD tier's budget")
        namespace = self.index.namespace_of(scope_digest) if scope_digest else None
        limit = self.quotas.limit(namespace, Tier.SSD) if namespace is not None else 0
        if limit:
            if payload_bytes > limit:
                raise CapacityExhausted(
                    f"a page of {payload_bytes} bytes exceeds namespace {namespace!r}'s SSD quota"
                )
            own = self.index.digests_of(namespace or "")
            while self.index.namespace_bytes(namespace or "", Tier.SSD) + payload_bytes > limit:
                victim = next(self.candidates(Tier.SSD, only=own), None)
                if victim is None:
                    self._count_quota(namespace or "")
                    raise CapacityExhausted(
                        f"namespace {namespace!r} is at its SSD quota of {limit} bytes and every "
                        "page of it there is leased",
                        retry_after_s=self.retry_after_s,
                    )
                self._evict_ssd(victim)
        while ssd.used_bytes + n_bytes > ssd.capacity_bytes:
            victim = next(self.candidates(Tier.SSD), None)
            if victim is None:
                raise CapacityExhausted(
                    "SSD tier full and every page in it is leased", retry_after_s=self.retry_after_s
                )
            self._evict_ssd(victim)

    def _evict_ssd(self, victim: PageEntry) -> None:
        assert self.ssd is not None
        self._bump(self.counters.evictions, Tier.SSD)
        self.ssd.delete(victim.key)
        if victim.dram is None and victim.gpu is None:
            self.drop(victim, reason_tier=Tier.SSD, count_eviction=False)
        else:
            self.index.set_residency(victim.key, Tier.SSD, False)

    def plan_namespace_room(
        self, namespace: str, page_bytes: int, count: int, reserved: int
    ) -> list[PageEntry]:
        """Move `namespace`'s own pages out of DRAM until `count` more pages of `page_bytes`
        (beyond `reserved` bytes it has reserved) fit its DRAM quota, as far as that takes no
        disk I/O; name the next of its pages that must be written to SSD first (none: they fit,
        or nothing of it can leave). Mutates, as `plan_dram_room`."""
        limit = self.quotas.limit(namespace, Tier.DRAM)
        if not limit:
            return []
        own = self.index.digests_of(namespace)
        need = page_bytes * count
        for victim in self.candidates(Tier.DRAM, only=own):
            if self.index.namespace_bytes(namespace, Tier.DRAM) + reserved + need <= limit:
                break
            if victim.dram is None:
                continue
            if self.needs_ssd_write(victim):
                return [victim]
            self.demote_dram(victim)
        return []

    def _count_quota(self, namespace: str) -> None:
        with self.counters.lock:
            self.counters.quota_refused[namespace] += 1

    # ---- demotion ---------------------------------------------------------------------------

    def demote_gpu(self, entry: PageEntry) -> None:
        """Move a page's GPU copy to DRAM (or just drop the GPU copy if DRAM has it). Mutates."""
        assert self.gpu is not None and entry.gpu is not None
        self._bump(self.counters.evictions, Tier.GPU)
        offset = entry.gpu
        if entry.dram is None:
            try:
                dst = self.allocate_dram(entry.payload_bytes)
            except CapacityExhausted:
                dst = None
            if dst is not None:
                self.gpu.read_into(
                    offset, entry.payload_bytes, self.dram.view(dst, entry.payload_bytes)
                )
                self.index.set_residency(entry.key, Tier.DRAM, dst)
            elif not entry.ssd:
                self.drop(entry, reason_tier=Tier.GPU, count_eviction=False)
                return
        self.index.set_residency(entry.key, Tier.GPU, None)
        self.gpu.free(offset)
        # Its fastest copy is now the DRAM one (new, or kept from an earlier read) or the SSD one.
        lower = entry.fastest
        assert lower is not None
        self._move_event(entry, Tier.GPU, lower, demotion=True)

    def demote_dram(self, entry: PageEntry) -> None:
        """Make a page leave DRAM: its copy in a lower tier stays, else it is dropped (a page
        not admitted to SSD). Mutates; no disk I/O. Raises NeedsDemotion (changing nothing)
        for a page that must be written to SSD first."""
        assert entry.dram is not None
        if self.needs_ssd_write(entry):
            raise NeedsDemotion(entry, self.retry_after_s)
        self._bump(self.counters.evictions, Tier.DRAM)
        offset = entry.dram
        if entry.gpu is None and not entry.ssd:
            self.drop(entry, reason_tier=Tier.DRAM, count_eviction=False)
            return
        self.index.set_residency(entry.key, Tier.DRAM, None)
        self.dram.free(offset)
        if entry.gpu is None:  # its fastest copy is now the SSD one (written now or earlier)
            self._move_event(entry, Tier.DRAM, Tier.SSD, demotion=True)

    # ---- promotion --------------------------------------------------------------------------

    def copy_gpu_to_dram(self, entry: PageEntry) -> bool:
        """Give a pinned GPU page a DRAM copy to serve it from. Mutates. The page stays in the
        faster tier, so this is no promotion and its fastest tier (what watchers track) does not
        change. Returns False (and changes nothing) when DRAM has no room for it."""
        assert self.gpu is not None and entry.gpu is not None
        if entry.dram is not None:
            return True
        try:
            dst = self.allocate_dram(entry.payload_bytes)
        except CapacityExhausted:
            return False
        self.gpu.read_into(entry.gpu, entry.payload_bytes, self.dram.view(dst, entry.payload_bytes))
        self.index.set_residency(entry.key, Tier.DRAM, dst)
        return True

    def adopt_promotion(self, entry: PageEntry, dst: int) -> None:
        """Record the DRAM block `dst`, into which the caller read and verified the pinned SSD
        page `entry`, as its DRAM copy (a promotion). Mutates."""
        self.index.set_residency(entry.key, Tier.DRAM, dst)
        with self.counters.lock:
            self.counters.promotions[(Tier.SSD, Tier.DRAM)] += 1
        self.events.publish(
            EventKind.MOVED, entry.key, entry.scope_digest, entry.payload_bytes, Tier.SSD, Tier.DRAM
        )

    def move_to_gpu(self, entry: PageEntry) -> None:
        """Place a DRAM page in the GPU tier and release its DRAM copy. Mutates; may raise."""
        assert self.gpu is not None and entry.dram is not None
        dst = self.allocate_gpu(entry.payload_bytes)
        self.gpu.write(dst, self.dram.view(entry.dram, entry.payload_bytes))
        self.index.set_residency(entry.key, Tier.GPU, dst)
        offset = entry.dram
        self.index.set_residency(entry.key, Tier.DRAM, None)
        self.dram.free(offset)
        self._place_event(entry, Tier.GPU)

    # ---- removal ----------------------------------------------------------------------------

    def drop(
        self, entry: PageEntry, *, reason_tier: Tier | None, count_eviction: bool = True
    ) -> None:
        """Remove a page from every tier and the index. Mutates. The page must not be leased."""
        if count_eviction and reason_tier is not None:
            self._bump(self.counters.evictions, reason_tier)
        key = entry.key
        fastest = entry.fastest
        self.index.remove(key)
        if entry.gpu is not None and self.gpu is not None:
            self.gpu.free(entry.gpu)
        if entry.dram is not None:
            self.dram.free(entry.dram)
        if entry.ssd and self.ssd is not None:
            self.ssd.delete(key)
        self.events.publish(
            EventKind.REMOVED, key, entry.scope_digest, entry.payload_bytes, fastest, None
        )

    def drop_corrupt(self, entry: PageEntry) -> None:
        """Forget a page whose SSD copy failed verification. Mutates; counts it."""
        with self.counters.lock:
            self.counters.corrupt_dropped += 1
        log.warning("dropping corrupt page %s", entry.key.hex())
        if self.ssd is not None:
            self.ssd.delete(entry.key)
        if entry.dram is None and entry.gpu is None:
            self.drop(entry, reason_tier=None, count_eviction=False)
        else:
            self.index.set_residency(entry.key, Tier.SSD, False)

    # ---- reporting --------------------------------------------------------------------------

    def gauges(self) -> list[TierGauge]:
        out = []
        if self.gpu is not None:
            out.append(
                TierGauge(
                    Tier.GPU,
                    self.gpu.capacity_bytes,
                    self.gpu.used_bytes,
                    self.index.pages_in(Tier.GPU),
                )
            )
        out.append(
            TierGauge(
                Tier.DRAM,
                self.dram.capacity_bytes,
                self.dram.used_bytes,
                self.index.pages_in(Tier.DRAM),
            )
        )
        if self.ssd is not None:
            out.append(
                TierGauge(
                    Tier.SSD,
                    self.ssd.capacity_bytes,
                    self.ssd.used_bytes,
                    self.index.pages_in(Tier.SSD),
                )
            )
        return out

    def _bump(self, table: dict[Tier, int], tier: Tier) -> None:
        with self.counters.lock:
            table[tier] += 1

    def _place_event(self, entry: PageEntry, dst: Tier) -> None:
        """A just-stored page was placed in `dst` as its writer asked: moved, not demoted."""
        self.events.publish(
            EventKind.MOVED, entry.key, entry.scope_digest, entry.payload_bytes, Tier.DRAM, dst
        )

    def _move_event(self, entry: PageEntry, src: Tier, dst: Tier, *, demotion: bool) -> None:
        with self.counters.lock:
            (self.counters.demotions if demotion else self.counters.promotions)[(src, dst)] += 1
        self.events.publish(
            EventKind.MOVED, entry.key, entry.scope_digest, entry.payload_bytes, src, dst
        )
