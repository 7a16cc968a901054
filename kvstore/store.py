"""The store: the daemon's operations on pages, above the index, tiers and leases.

One lock guards the index, the tiers' allocators, the lease table and pending reservations.
Slow work never runs under it: SSD reads happen with the pages pinned and the lock released,
and background movement (write-through, watermark demotion, lease expiry) runs in the mover.

Every public method says whether it mutates, what it leases and what it raises. A miss is a
result, never an error.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from client.contract.page import (
    PageHeader,
    checked_payload_checksum,
    checksum_deferred,
    payload_checksum,
    quick_check,
    seal_header,
)
from client.contract.scope import KEY_BYTES, Scope, base_namespace
from kvstore.chain import ChainRejected, first_unverified, prefix_keys
from kvstore.config import StoreConfig
from kvstore.errors import (
    CapacityExhausted,
    Corrupt,
    InvalidArgument,
    LeaseExpired,
    StrataError,
    Unavailable,
)
from kvstore.events import EventKind, EventLog
from kvstore.fence import DAEMON, Holder, Quarantine
from kvstore.index import Index, PageEntry
from kvstore.keys import IoClass, Tier
from kvstore.leases import Lease, LeaseKind, LeaseTable
from kvstore.metrics import NamespaceGauge, StoreCounters, TierGauge
from kvstore.movement import NeedsDemotion, Tiers
from kvstore.mover import Mover
from kvstore.policy import WriteMode, make_admission
from kvstore.quota import Quotas
from kvstore.scheduler import IoScheduler
from kvstore.tiers.dram import DramTier
from kvstore.tiers.faults import faults_from_config
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.ssd import SsdTier

log = logging.getLogger(__name__)
_GPU, _DRAM = Tier.GPU, Tier.DRAM  # enum lookups cost ~75 ns each on Python 3.11

_SCOPE_CACHE = 1024
_PREFIX_CACHE = 8  # chain prefixes whose keys are kept (kvstore/chain.py)
_READ_OK, _READ_BAD, _READ_IO_ERROR = 1, 2, 3  # outcomes of one SSD page read (`_read_ssd`)
_ROOM_ROUNDS = 4096 + 8  # pages a call may write to SSD (one at a time) to find DRAM room


def index_payload_bytes(index: Index, key: bytes) -> int:
    """Payload size of a page in the index (0 when it is gone)."""
    entry = index.get(key)
    return entry.payload_bytes if entry is not None else 0


_TIER_OF_CODE = {int(t): t for t in Tier}


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """The longest present prefix: `codes[i]` is the `Tier` value of the fastest tier of hit i
    (one byte a page, what the wire carries)."""

    codes: bytes

    @property
    def hit_count(self) -> int:
        return len(self.codes)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(_TIER_OF_CODE[c] for c in self.codes)


class SlotGrant(NamedTuple):  # per page, on the hot path: cheaper to build than a frozen dataclass
    """Where a client writes one reserved page (`reserved` False: skip it; it is already
    present, or, with `pending`, being written by another reservation now)."""

    reserved: bool
    offset: int
    length: int
    pending: bool = False


@dataclass(frozen=True, slots=True)
class Reservation:
    lease_id: int
    slots: tuple[SlotGrant, ...]
    expires_unix_ms: int


class HeldPage(NamedTuple):  # per page, on the hot path: cheaper to build than a frozen dataclass
    """A page pinned in DRAM under a read lease; `None` fields when it was a miss."""

    tier: Tier
    offset: int
    length: int
    header: bytes
    generation: int  # of the DRAM slot (kvstore/tiers/dram.py): a reader checks it after copying


@dataclass(frozen=True, slots=True)
class Acquisition:
    lease_id: int  # 0 when nothing was present
    pages: tuple[HeldPage | None, ...]
    expires_unix_ms: int


class PlannedPage(
    NamedTuple
):  # per page, on the hot path: cheaper to build than a frozen dataclass
    """What the store needs of one validated page header to place it."""

    key: bytes
    parent: bytes
    scope_digest: bytes
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class PutPlan:
    """Side-effect-free plan of a write: which pages are new, and how many bytes they need."""

    scope: Scope
    headers: tuple[PlannedPage, ...]
    new: tuple[int, ...]  # indexes into headers of pages to store
    need_bytes: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierGauge, ...]
    pages: int
    active_leases: int


@dataclass(slots=True)
class _Pending:
    header: PlannedPage
    raw_header: bytes
    offset: int


class Store:
    """Pages in tiers, keyed by 16-byte page keys. Thread-safe."""

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self.index = Index(chain_memory_keys=config.limits.chain_memory_keys)
        self.leases = LeaseTable(clock)
        self.counters = StoreCounters()
        self.events = EventLog()
        self.scheduler = IoScheduler(config.io.concurrency, config.io.background_bytes_per_s)
        self.write_mode = WriteMode.parse(config.ssd.write_mode)
        dram = DramTier(config.dram.capacity_bytes, config.segment_name)
        ssd = gpu = None
        try:
            if config.ssd.enabled:
                ssd = SsdTier(
                    config.ssd_path,
                    config.ssd.capacity_bytes,
                    sync_writes=config.ssd.sync_writes,
                    faults=faults_from_config(config.ssd),
                )
            if config.gpu.enabled:
                gpu = GpuTier(config.gpu.capacity_bytes, config.gpu.device)
        except BaseException:
            dram.close()
            if ssd is not None:
                ssd.close()
            raise
        self.tiers = Tiers(
            self.index,
            dram,
            ssd,
            gpu,
            make_admission(config.ssd.admission),
            self.counters,
            self.events,
            quotas=Quotas(config.quota),
        )
        self._pending: dict[int, list[_Pending | None]] = {}
        self._pending_class: dict[int, IoClass] = {}  # I/O class each reservation was made in
        self._pending_keys: set[bytes] = set()
        self._pending_holder: dict[int, Holder] = {}  # who copies into each reservation's slots
        self._pending_client: dict[int, tuple[str, int]] = {}  # lease -> (client, bytes)
        self._reserved_bytes: dict[str, int] = {}  # client -> DRAM bytes it holds reserved
        # namespace quotas (kvstore/quota.py): lease -> (namespace, payload bytes reserved), and
        # namespace -> payload bytes its live reservations hold
        self._pending_ns: dict[int, tuple[str, int]] = {}
        self._ns_reserved: dict[str, int] = {}
        self._doomed: set[bytes] = set()
        # pages put again while their deleted predecessor is still leased: stored when it goes
        self._replacing: dict[bytes, _Pending] = {}
        # same-host puts whose writer sent a checksum the daemon has not checked yet: checked
        # before any reader gets the page (by the mover's pass, or by the acquire that wants
        # it). A page whose checksum the writer left to the daemon (the header's
        # FLAG_CHECKSUM_DEFERRED: its index header says so) is not here: it is computed
        # ("sealed") when the page leaves DRAM — an acquire for a remote reader, an SSD write —
        # and never for a page that does not, so no same-host put costs a hash of its payload
        # anywhere unless its bytes go where they can be damaged.
        self._unverified: set[bytes] = set()
        self._corrupt_pinned: set[bytes] = set()  # failed that check, waiting for their pins
        self._replacing_unverified: set[bytes] = set()  # same-host puts among `_replacing`
        self.quarantine = Quarantine(config.limits.quarantine_max_ms / 1000.0)
        self._scopes: OrderedDict[bytes, Scope] = OrderedDict()
        self._prefixes: OrderedDict[tuple[bytes, tuple[bytes, ...]], set[bytes]] = OrderedDict()
        self._ssd_pool: ThreadPoolExecutor | None = None
        self.rebuilt_pages = self._rebuild()
        self.mover = Mover(
            self._lock,
            self.tiers,
            self.scheduler,
            config.dram,
            self.reap_leases,
            self._unpin,
            verify=self.verify_same_host_puts,
        )
        self.mover.start()

    # ---- lifecycle --------------------------------------------------------------------------

    def _rebuild(self) -> int:
        """Rebuild the index from the SSD tier's page headers (restart). Mutates the index."""
        ssd = self.tiers.ssd
        if ssd is None:
            return 0
        result = ssd.scan()
        if result.dropped:
            with self.counters.lock:
                self.counters.corrupt_dropped += result.dropped
            log.warning(
                "dropped %d unreadable SSD pages while rebuilding the index", result.dropped
            )
        for header in result.headers:
            self.index.insert(
                PageEntry(
                    key=header.key,
                    parent=header.parent,
                    scope_digest=header.scope_digest,
                    header=header.encode(),
                    payload_bytes=header.payload_bytes,
                    gpu=None,
                    dram=None,
                    ssd=True,
                )
            )
        for digest, namespace in result.namespaces.items():  # whose pages these are
            self.index.name_scope(digest, namespace)
        return len(result.headers)

    def close(self) -> None:
        """Stop the mover, flush the SSD tier, unmap and unlink the DRAM segment."""
        self.mover.stop()
        self.events.close()
        pool, self._ssd_pool = self._ssd_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            if self.tiers.ssd is not None:
                self.tiers.ssd.flush()
                self.tiers.ssd.close()
            if self.tiers.gpu is not None:
                self.tiers.gpu.close()
            self.tiers.dram.close()

    def drain(self) -> None:
        """Block until background movement queued so far is done (tests, benchmarks)."""
        self.mover.drain()

    # ---- validation helpers -----------------------------------------------------------------

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        self._check_count(len(keys))

    def _check_count(self, count: int) -> None:
        if count > self.config.limits.max_keys_per_call:
            raise InvalidArgument(
                f"{count} keys in one call; the limit is {self.config.limits.max_keys_per_call}"
            )

    def scope_of(self, encoded: bytes) -> Scope:
        """Decode (and cache) a canonical scope encoding. Raises InvalidArgument."""
        with self._lock:
            scope = self._scopes.get(encoded)
            if scope is not None:
                self._scopes.move_to_end(encoded)
                return scope
        scope = Scope.decode(encoded)
        with self._lock:
            self._scopes[encoded] = scope
            if len(self._scopes) > _SCOPE_CACHE:
                self._scopes.popitem(last=False)
        return scope

    def _ttl_s(self, lease_ms: int) -> float:
        limits = self.config.limits
        ms = lease_ms or limits.lease_ttl_ms
        return min(ms, limits.max_lease_ttl_ms) / 1000.0

    def _unix_ms(self, lease: Lease) -> int:
        return int((time.time() + lease.expires_at - self._clock()) * 1000)

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, scope_digest: bytes, keys: Sequence[bytes] | bytes) -> LookupOutcome:
        """Longest present prefix of `keys` (a sequence of keys, or keys packed as on the wire)
        in `scope_digest`. Read-only; no lease. InvalidArgument for too many keys, a packed
        field that is not whole keys, or a bad digest."""
        if isinstance(keys, bytes):
            if len(keys) % KEY_BYTES:
                raise InvalidArgument(
                    f"packed keys length {len(keys)} is not a multiple of {KEY_BYTES}"
                )
            packed = keys
            self._check_count(len(keys) // KEY_BYTES)
        else:
            self._check_keys(keys)
            packed = b"".join(k for k in keys if len(k) == KEY_BYTES)
            if len(packed) != KEY_BYTES * len(keys):  # a short key ends the prefix there
                cut = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
                packed = packed[: KEY_BYTES * cut]
        if len(scope_digest) != KEY_BYTES:
            raise InvalidArgument(f"scope digest must be {KEY_BYTES} bytes")
        with self._lock:
            # deleted while leased: gone for new readers, as `acquire` says
            codes = self.index.prefix_tier_codes(scope_digest, packed, self._doomed)
        with self.counters.lock:
            self.counters.lookups += 1
            self.counters.lookup_hit_pages += len(codes)
        return LookupOutcome(codes)

    # ---- writes: plan, reserve, commit ------------------------------------------------------

    def plan_put(
        self,
        scope: Scope,
        raw_headers: Sequence[bytes],
        chain_prefix: Sequence[bytes] = (),
        *,
        same_host: bool = False,
    ) -> PutPlan:
        """Validate headers against `scope` and find the pages not yet stored. No side effects
        (but a counter).

        Raises InvalidArgument for a malformed header, a page of another scope or layout, an
        oversize page or too many pages; ChainRejected (an InvalidArgument, counted in
        `chain_rejected`) when a page's parent is not a key of the scope (kvstore/chain.py);
        `chain_prefix` (token ids of prompts from their first page on) vouches for ancestors
        this node does not know. A header that leaves its payload checksum to the daemon is
        InvalidArgument unless `same_host` (a same-host Reserve: the writer copies into DRAM
        itself; bytes that cross a network come with their checksum).
        """
        self._check_keys(raw_headers)
        limit = self.config.limits.max_page_bytes
        if scope.page_payload_bytes > limit:
            raise InvalidArgument(
                f"page of {scope.page_payload_bytes} bytes exceeds max_page_bytes {limit}"
            )
        headers = []
        digest, size = scope.digest, scope.page_payload_bytes
        for raw in raw_headers:
            quick = quick_check(raw, scope) if isinstance(raw, bytes) else None
            if quick is not None and (same_host or not checksum_deferred(raw)):
                headers.append(PlannedPage(quick[0], quick[1], digest, size))
                continue
            try:  # the slow path names exactly what is wrong
                header = PageHeader.decode(raw)
            except Corrupt as exc:
                raise InvalidArgument(f"malformed page header: {exc}") from None
            if header.checksum_deferred and not same_host:
                raise InvalidArgument(
                    "a page whose payload checksum is left to the daemon may only be put on the "
                    "same-host path; send its checksum"
                )
            if header.payload_bytes > limit:
                raise InvalidArgument(
                    f"page of {header.payload_bytes} bytes exceeds max_page_bytes {limit}"
                )
            header.validate_for(scope)
            headers.append(
                PlannedPage(header.key, header.parent, header.scope_digest, header.payload_bytes)
            )
        seen: set[bytes] = set()
        new = []
        need = 0
        links = [(h.key, h.parent) for h in headers]
        with self._lock:
            bad = first_unverified(digest, links, self.index.scope_of)
        if bad is not None and chain_prefix:  # hashed outside the lock, and only when needed
            vouched = self._prefix_keys(digest, tuple(chain_prefix), scope.layout.page_tokens)
            known = self.index.scope_of

            def scope_of(key: bytes) -> bytes | None:
                return digest if key in vouched else known(key)

            with self._lock:
                bad = first_unverified(digest, links, scope_of)
        with self._lock:
            if bad is not None:
                with self.counters.lock:
                    self.counters.chain_rejected += 1
                raise ChainRejected(bad, headers[bad].key, headers[bad].parent)
            for i, planned in enumerate(headers):
                key = planned.key
                if key in seen or not self._writable(key):
                    continue
                seen.add(key)
                new.append(i)
                need += planned.payload_bytes
        return PutPlan(scope, tuple(headers), tuple(new), need)

    def _prefix_keys(
        self, digest: bytes, prefix: tuple[bytes, ...], page_tokens: int
    ) -> set[bytes]:
        """`chain.prefix_keys`, remembered for the last few puts: a gRPC put reserves page by
        page, each with the stream's prefixes."""
        with self._lock:
            found = self._prefixes.get((digest, prefix))
        if found is None:
            found = prefix_keys(digest, prefix, page_tokens)
            with self._lock:
                self._prefixes[(digest, prefix)] = found
                if len(self._prefixes) > _PREFIX_CACHE:
                    self._prefixes.popitem(last=False)
        return found

    def _writable(self, key: bytes) -> bool:
        """Whether a put of `key` stores anything: not present (a page deleted while leased is
        not), not being written by a reservation, not waiting to replace one. Lock held."""
        if key in self._pending_keys or key in self._replacing:
            return False
        return key not in self.index or key in self._doomed

    def refuse_oversized_put(self, scope: Scope, page_count: int) -> None:
        """Raise CapacityExhausted (counted) if a put naming `page_count` pages of `scope` is
        bigger than its namespace's whole DRAM quota: no room the namespace could make would
        hold it. Decided from the count alone, not from which pages are new, so every put path
        answers alike: a batch reserve (same-host, TCP/UCX) checks its headers, a gRPC put stream
        the page_count of its PutBegin, before any page is stored."""
        namespace = base_namespace(scope.namespace)  # a sub-namespace counts as its base's
        quota = self.tiers.quotas.limit(namespace, _DRAM)
        size = scope.page_payload_bytes * page_count
        if quota and size > quota:
            with self.counters.lock:
                self.counters.quota_refused[namespace] += 1
            raise CapacityExhausted(
                f"a put of {page_count} pages ({size} bytes) exceeds namespace {namespace!r}'s "
                f"DRAM quota of {quota}: put less at once"
            )

    def reserve(
        self,
        scope: Scope,
        raw_headers: Sequence[bytes],
        lease_ms: int = 0,
        io_class: IoClass = IoClass.NORMAL,
        holder: Holder = DAEMON,
        client: str = "",
        chain_prefix: Sequence[bytes] = (),
        *,
        same_host: bool = False,
    ) -> Reservation:
        """Reserve DRAM slots for the new pages among `raw_headers`. Mutates; takes a RESERVE lease.

        `holder` is who copies into the slots (kvstore/fence.py): the daemon itself, or a
        same-host client process; if the lease expires, the slots stay quarantined until the
        holder is done. A page already present is not reserved; one being written by another
        reservation is not reserved and marked `pending`. Evicts (demotes) unleased pages as
        needed. `client` names who asks (a process, a connection; "" = the daemon itself): one
        client holds at most `limits.max_reserved_bytes_per_client` reserved at once, and a
        reservation's lease is at most `limits.max_reserve_lease_ms`. Raises InvalidArgument
        (see plan_put; `same_host` as there) or CapacityExhausted — in which case nothing was
        reserved and nothing else changed.
        """
        plan = self.plan_put(scope, raw_headers, chain_prefix, same_host=same_host)
        limits = self.config.limits
        ttl_s = min(self._ttl_s(lease_ms), limits.max_reserve_lease_ms / 1000.0)
        namespace = base_namespace(scope.namespace)
        quota = self.tiers.quotas.limit(namespace, _DRAM)
        self.refuse_oversized_put(scope, len(raw_headers))
        for _ in range(_ROOM_ROUNDS if quota else 0):  # the namespace's own pages make room
            with self._lock:
                count = sum(1 for i in plan.new if self._writable(plan.headers[i].key))
                victims = self.tiers.plan_namespace_room(
                    namespace,
                    scope.page_payload_bytes,
                    count,
                    self._ns_reserved.get(namespace, 0),
                )
            if not victims:
                break
            self._write_out(victims, io_class)
        for _ in range(_ROOM_ROUNDS):  # pages that must go to SSD to make room: written unlocked
            with self._lock:
                count = sum(1 for i in plan.new if self._writable(plan.headers[i].key))
                victims = (
                    self.tiers.plan_dram_room(scope.page_payload_bytes, count) if count else []
                )
            if not victims:
                break
            self._write_out(victims, io_class)
        for round_ in range(_ROOM_ROUNDS + 1):
            try:
                lease, granted, busy = self._grant(
                    plan, raw_headers, ttl_s, io_class, holder, client
                )
            except NeedsDemotion as exc:  # another call took the room made above: make it again
                if round_ == _ROOM_ROUNDS:
                    raise
                self._write_out([exc.victim], io_class)
                continue
            break
        slots = tuple(
            SlotGrant(True, p.offset, p.header.payload_bytes)
            if p is not None
            else SlotGrant(False, 0, 0, busy[i])
            for i, p in enumerate(granted)
        )
        return Reservation(lease.lease_id, slots, self._unix_ms(lease))

    def _grant(
        self,
        plan: PutPlan,
        raw_headers: Sequence[bytes],
        ttl_s: float,
        io_class: IoClass,
        holder: Holder,
        client: str,
    ) -> tuple[Lease, list[_Pending | None], list[bool]]:
        """The locked part of `reserve`: slots for the pages of `plan` still writable, and the
        lease. Raises CapacityExhausted (NeedsDemotion: a page must be written to SSD first),
        having reserved nothing."""
        scope = plan.scope
        with self._lock:
            self.reap_leases()
            new = [i for i in plan.new if self._writable(plan.headers[i].key)]
            slot_bytes = self.tiers.dram.slot_bytes_for(scope.page_payload_bytes) * len(new)
            namespace = base_namespace(scope.namespace)
            need = scope.page_payload_bytes * len(new)
            quota = self.tiers.quotas.limit(namespace, _DRAM)
            if quota and new:
                held = self.index.namespace_bytes(namespace, _DRAM)
                held += self._ns_reserved.get(namespace, 0)
                if held + need > quota:
                    with self.counters.lock:
                        self.counters.quota_refused[namespace] += 1
                    raise CapacityExhausted(
                        f"namespace {namespace!r} holds {held} bytes of DRAM (reserved "
                        f"included); this put needs {need} more and its quota is {quota}: "
                        "retry once its pages have left DRAM",
                        retry_after_s=self.tiers.retry_after_s,
                    )
            if client and new:
                held = self._reserved_bytes.get(client, 0)
                cap = self.config.reserved_bytes_per_client
                if held + slot_bytes > cap:
                    with self.counters.lock:
                        self.counters.refused_full += 1
                    raise CapacityExhausted(
                        f"this client would hold {held + slot_bytes} bytes of DRAM reserved; "
                        f"one client may hold {cap}: commit or release first, or put less at once",
                        retry_after_s=self.tiers.retry_after_s,
                    )
            granted: list[_Pending | None] = [None] * len(plan.headers)
            # every page of a put has its scope's page size: one batch allocation
            offsets = self.tiers.allocate_dram_many(scope.page_payload_bytes, len(new))
            for i, offset in zip(new, offsets, strict=True):
                granted[i] = _Pending(plan.headers[i], bytes(raw_headers[i]), offset)
            keys = tuple(p.header.key for p in granted if p is not None)
            # verified: their children verify while these are being written, and after
            self.index.chain.remember_many(keys, scope.digest)
            lease = self.leases.grant(LeaseKind.RESERVE, keys, ttl_s)
            if client and new:
                self._reserved_bytes[client] = self._reserved_bytes.get(client, 0) + slot_bytes
                self._pending_client[lease.lease_id] = (client, slot_bytes)
            self._pending[lease.lease_id] = granted
            self._pending_class[lease.lease_id] = io_class
            self._pending_ns[lease.lease_id] = (namespace, need)
            self._ns_reserved[namespace] = self._ns_reserved.get(namespace, 0) + need
            self._pending_holder[lease.lease_id] = holder
            busy = [
                p is None and h.key in self._pending_keys
                for p, h in zip(granted, plan.headers, strict=True)
            ]
            self._pending_keys.update(keys)
        return lease, granted, busy

    def commit(
        self,
        lease_id: int,
        tier: Tier | None = None,
        io_class: IoClass | None = None,
        path: str = "shm",
    ) -> int:
        """Make a reservation's pages visible. Mutates; ends the lease. Returns pages stored.

        `tier` GPU or SSD moves the pages there right away (DRAM is the default home).
        Raises LeaseExpired for an unknown, expired or non-reservation lease.
        """
        with self._lock:
            self.reap_leases()
            if self._late_call(lease_id):
                raise LeaseExpired(
                    f"lease {lease_id} expired before its commit: nothing of it was stored"
                )
            # A read lease handed in by mistake stays as it is (its pages stay pinned until it
            # is released or expires): checked before the lease leaves the table.
            if self.leases.get(lease_id).kind is not LeaseKind.RESERVE:
                raise LeaseExpired(f"lease {lease_id} is not a write reservation")
            self.leases.release(lease_id)
            granted = self._pending.pop(lease_id, None)
            self._pending_holder.pop(lease_id, None)
            namespace = self._pending_ns.get(lease_id, ("", 0))[0]
            self._unreserve(lease_id)
            reserved_class = self._pending_class.pop(lease_id, IoClass.NORMAL)
            io_class = io_class or reserved_class
            if granted is None:
                raise LeaseExpired(f"lease {lease_id} is not a write reservation")
            entries: list[PageEntry] = []
            replacing = 0
            committed_bytes = 0
            index = self.index
            for pending in granted:
                if pending is None:
                    continue
                header = pending.header
                key = header.key
                committed_bytes += header.payload_bytes
                self._pending_keys.discard(key)
                if key in self._doomed and key not in self._replacing:
                    # put again while its deleted predecessor is still leased: stored (and
                    # visible) when the predecessor's last lease ends
                    self._replacing[key] = pending
                    if path == "shm":
                        self._replacing_unverified.add(key)
                    replacing += 1
                    continue
                if key in index or key in self._replacing:  # stored meanwhile by another path
                    self.tiers.dram.free(pending.offset)
                    continue
                # key, parent, scope digest, header, payload bytes, gpu, dram
                entries.append(
                    PageEntry(
                        key,
                        header.parent,
                        header.scope_digest,
                        pending.raw_header,
                        header.payload_bytes,
                        None,
                        pending.offset,
                    )
                )
            index.insert_many(entries, checked=True)  # built from headers plan_put checked
            if entries:  # they count toward their namespace's quota (kvstore/quota.py)
                index.name_scope(entries[0].scope_digest, namespace)
            if path == "shm":  # a writer's checksum: checked off its critical path
                self._unverified.update(
                    e.key for e in entries if not checksum_deferred(e.header)
                )
            self.events.publish_many(
                [
                    (EventKind.STORED, e.key, e.scope_digest, e.payload_bytes, None, Tier.DRAM)
                    for e in entries
                ]
            )  # every STORED before any MOVED of placing a page
            to_ssd: list[PageEntry] = []
            if tier is not None or self.write_mode is WriteMode.WRITE_THROUGH:
                for entry in entries:  # placing one may move others: look each up again
                    placed = index.get(entry.key)
                    if tier is Tier.SSD and placed is not None and self.tiers.ssd is not None:
                        to_ssd.append(placed)
                    else:
                        self._place(placed, tier, io_class)
            self.counters.add_bytes(path, "in", io_class, committed_bytes)
            stored = len(entries) + replacing
        if entries:  # before any of them can reach SSD: a restart then knows their namespace
            self._name_on_ssd(entries[0].scope_digest, namespace)
        for entry in to_ssd:  # placed as asked before the call returns, the store lock free
            self.mover.copy_to_ssd(entry, clear_dram=True, io_class=io_class, must_leave=False)
        self.mover.kick_if_above_watermark()
        return stored

    def _name_on_ssd(self, digest: bytes, namespace: str) -> None:
        """Record a scope's namespace in the SSD tier (kvstore/tiers/ssd.py `name_scope`), best
        effort: a failure only means its pages, after a restart, belong to no namespace until a
        put names the scope again. Lock NOT held."""
        ssd = self.tiers.ssd
        if ssd is None:
            return
        try:
            ssd.name_scope(digest, namespace)
        except StrataError as exc:
            log.warning("ssd tier: cannot record the namespace of a scope: %s", exc)

    def _write_out(self, victims: Sequence[PageEntry], io_class: IoClass) -> None:
        """Demote `victims` to SSD to make room in DRAM: each written with the store lock free
        (through the scheduler as BACKGROUND I/O, so the background cap holds for demotions
        too, whoever waits for them), then its DRAM copy released (kvstore/mover.py
        `copy_to_ssd`). Lock NOT held."""
        for victim in victims:
            if not self.mover.copy_to_ssd(victim, clear_dram=True):
                with self._lock:  # it could not be written: it leaves anyway (never nowhere)
                    if (
                        self.index.get(victim.key) is victim
                        and victim.leases == 0
                        and victim.dram is not None
                        and not victim.ssd
                        and victim.gpu is None
                    ):
                        self.tiers.drop(victim, reason_tier=Tier.DRAM)

    def _place(self, entry: PageEntry | None, tier: Tier | None, io_class: IoClass) -> None:
        """Move a just-committed DRAM page where its writer asked. Best effort: a page that cannot
        go there (the tier is full of leased pages, too small, failing) stays stored in DRAM;
        raising here would leave the rest of the reservation neither stored nor freed."""
        if entry is None:
            return
        try:
            if tier is Tier.GPU and self.tiers.gpu is not None:
                if entry.key in self._unverified and not self._checked_before_gpu(entry):
                    return
                self.tiers.move_to_gpu(entry)
            elif self.write_mode is WriteMode.WRITE_THROUGH and self.tiers.ssd is not None:
                self.mover.write_through(entry.key)
        except StrataError as exc:
            log.warning("page %s stays in DRAM, not placed in %s: %s", entry.key.hex(), tier, exc)

    def _checked_before_gpu(self, entry: PageEntry) -> bool:
        """Check the writer's checksum of a same-host put about to leave DRAM for the GPU tier
        (where neither the mover's pass nor a reader's acquire would check it). A bad page is
        dropped and counted. Lock held; hashes the payload under it (only a same-host writer
        that sent its checksum and asked for the GPU tier pays this). Returns whether it is
        good."""
        assert entry.dram is not None
        self._unverified.discard(entry.key)
        want = checked_payload_checksum(entry.header)
        if payload_checksum(self.tiers.dram.view(entry.dram, entry.payload_bytes)) == want:
            return True
        log.warning("same-host put of page %s failed its checksum: dropped", entry.key.hex())
        with self.counters.lock:
            self.counters.shm_put_corrupt += 1
            self.counters.corrupt_dropped += 1
        self._drop_if_unpinned(entry)
        if entry.leases:
            self._corrupt_pinned.add(entry.key)
            self._doomed.add(entry.key)
        return False

    def abort(self, lease_id: int) -> bool:
        """Cancel a reservation (frees its slots). Mutates. False if unknown or expired (an
        expired reservation's quarantined slots are freed: its holder is done with them)."""
        with self._lock:
            if self._late_call(lease_id):
                return False
            try:
                lease = self.leases.release(lease_id)
            except LeaseExpired:
                return False
            self._end_lease(lease)
            return True

    # ---- reads: acquire, release ------------------------------------------------------------

    def acquire(
        self,
        scope_digest: bytes,
        keys: Sequence[bytes],
        io_class: IoClass = IoClass.NORMAL,
        lease_ms: int = 0,
        *,
        same_host: bool = False,
    ) -> Acquisition:
        """Pin each present page in DRAM under one READ lease. Mutates (promotes SSD/GPU hits).

        A page absent, of another scope, failing verification or with no DRAM room is `None`.
        A same-host put whose writer sent a checksum is checked before it is handed out; one
        whose checksum was left to the daemon is sealed first (its header then carries the
        checksum) unless `same_host` (a reader that copies from DRAM itself needs none: the
        page's header says the checksum is deferred, or carries it once sealed).
        Raises InvalidArgument for bad keys.
        """
        self._check_keys(keys)
        held: list[HeldPage | None] = [None] * len(keys)
        pinned: list[bytes] = []
        slow: list[int] = []  # pinned pages not in DRAM: copied from GPU or read from SSD
        need_ssd: list[int] = []
        hit_tiers: list[Tier] = []
        index, doomed = self.index, self._doomed
        generation = self.tiers.dram.generation
        with self._lock:
            self.reap_leases()
            misses = 0
            for i, key in enumerate(keys):
                entry = index.get(key)
                if entry is None or entry.scope_digest != scope_digest or key in doomed:
                    misses += 1
                    continue
                pinned.append(key)
                if entry.dram is None:
                    index.pin(key)
                    slow.append(i)
                    if entry.gpu is None:
                        need_ssd.append(i)
                    continue
                index.pin(key, hit=True)  # a DRAM hit (maybe also in GPU): served from DRAM now
                hit = _GPU if entry.gpu is not None else _DRAM
                hit_tiers.append(hit)
                held[i] = HeldPage(
                    hit, entry.dram, entry.payload_bytes, entry.header, generation(entry.dram)
                )
            if misses:  # one counters round for all of them
                first = Tier.GPU if self.tiers.gpu else Tier.DRAM
                self._count_miss(first, through_ssd=True, count=misses)
            if not pinned:  # nothing present: nothing to check, count as a hit or lease
                return Acquisition(0, tuple(held), 0)
            unverified = self._unverified
            check = [
                i
                for i, h in enumerate(held)
                if h is not None
                and (keys[i] in unverified or (not same_host and checksum_deferred(h.header)))
            ]
            if not slow and not check:
                self._count_hits(hit_tiers)
                lease = self.leases.grant(LeaseKind.READ, tuple(pinned), self._ttl_s(lease_ms))
                return Acquisition(lease.lease_id, tuple(held), self._unix_ms(lease))
        if check:  # same-host puts not checked yet: checked now, before anyone reads them
            bad = self._check_same_host_puts([keys[i] for i in check], check)
            for i in bad:
                held[i] = None
                pinned.remove(keys[i])
                hit_tiers.remove(_DRAM if _DRAM in hit_tiers else hit_tiers[0])
            self._refresh_headers(keys, held, check)
        # SSD pages are read straight into DRAM slots taken now (lock free while reading).
        # Whatever goes wrong from here on, every pin and slot taken is given back.
        slots: dict[int, int] = {}
        adopted: set[int] = set()
        try:
            if need_ssd:
                for _ in range(_ROOM_ROUNDS):  # room made by SSD writes, lock free
                    with self._lock:
                        victims = self.tiers.plan_dram_room(
                            index_payload_bytes(index, keys[need_ssd[0]]), len(need_ssd)
                        )
                    if not victims:
                        break
                    self._write_out(victims, io_class)
                for _ in range(_ROOM_ROUNDS):  # until each has a slot or DRAM has no more room
                    victim = None
                    with self._lock:
                        for i in need_ssd:
                            entry = index.get(keys[i])
                            if i in slots or entry is None or entry.dram is not None:
                                continue
                            try:
                                slots[i] = self.tiers.allocate_dram(entry.payload_bytes)
                            except NeedsDemotion as exc:  # the room made above was taken
                                victim = exc.victim
                                break
                            except CapacityExhausted:
                                pass
                    if victim is None:
                        break
                    self._write_out([victim], io_class)
            read_ok = self._read_ssd(keys, slots, io_class) if slots else {}
            with self._lock:
                for i in slow:
                    key = keys[i]
                    entry = index.get(key)
                    if entry is None:
                        continue
                    source = entry.fastest
                    slot = slots.get(i)
                    outcome = read_ok.get(i)
                    copied = entry.dram is not None or entry.gpu is not None  # by another reader
                    if slot is not None and (copied or outcome is not _READ_OK):
                        self.tiers.dram.free(slot)
                        adopted.add(i)  # given back
                        slot = None
                    if entry.dram is None:
                        if entry.gpu is not None:  # a DRAM copy of a GPU page, to serve it from
                            served = self.tiers.copy_gpu_to_dram(entry)
                        elif slot is not None:
                            self.tiers.adopt_promotion(entry, slot)
                            adopted.add(i)
                            served = True
                        elif outcome is _READ_IO_ERROR:  # the disk failed, not the page: keep it
                            self._unpin(key)
                            pinned.remove(key)
                            continue
                        elif i in slots:  # failed verification, or lost from the SSD
                            self._unpin(key)
                            pinned.remove(key)
                            self._drop_if_unpinned(entry, corrupt=True)
                            continue
                        else:
                            served = False
                        if not served:
                            self._unpin(key)
                            pinned.remove(key)
                            log.warning(
                                "no DRAM room to serve page %s; reported as a miss", key.hex()
                            )
                            continue
                    assert entry.dram is not None and source is not None
                    index.touch(key)
                    hit_tiers.append(source)
                    held[i] = HeldPage(
                        source,
                        entry.dram,
                        entry.payload_bytes,
                        entry.header,
                        self.tiers.dram.generation(entry.dram),
                    )
                self._count_hits(hit_tiers)
                if not pinned:
                    return Acquisition(0, tuple(held), 0)
                lease = self.leases.grant(LeaseKind.READ, tuple(pinned), self._ttl_s(lease_ms))
        except BaseException:
            with self._lock:
                for i, slot in slots.items():
                    if i not in adopted:
                        self.tiers.dram.free(slot)
                for key in pinned:
                    self._unpin(key)
            raise
        # A page served from a GPU copy may still leave its checksum to the daemon (it went to
        # the GPU before anything sealed it): sealed now, from the DRAM copy pinned above, so a
        # remote reader never gets a header that vouches for no bytes.
        late = [
            i
            for i in slow
            if not same_host and (h := held[i]) is not None and checksum_deferred(h.header)
        ]
        if late:
            try:
                self._check_same_host_puts([keys[i] for i in late], late)
            except BaseException:
                self.release(lease.lease_id)
                raise
            self._refresh_headers(keys, held, late)
        return Acquisition(lease.lease_id, tuple(held), self._unix_ms(lease))

    def _refresh_headers(
        self, keys: Sequence[bytes], held: list[HeldPage | None], indices: Sequence[int]
    ) -> None:
        """Give each held page among `indices` its index header (one the daemon has just
        sealed carries its checksum now). Mutates `held`."""
        with self._lock:
            for i in indices:
                page = held[i]
                entry = self.index.get(keys[i])
                if page is not None and entry is not None and entry.header != page.header:
                    held[i] = page._replace(header=entry.header)

    def verify_same_host_puts(self, limit: int = 256) -> int:
        """Check the payload checksums of up to `limit` same-host puts not checked yet (the
        mover calls this each pass); a bad page is dropped and counted. Mutates. Returns how
        many were checked."""
        with self._lock:
            if not self._unverified:
                return 0
            keys = list(itertools.islice(self._unverified, limit))
        self._check_same_host_puts(keys, list(range(len(keys))), background=True)
        return len(keys)

    def _check_same_host_puts(
        self, keys: Sequence[bytes], tags: Sequence[int], *, background: bool = False
    ) -> list[int]:
        """Verify the DRAM payloads of same-host puts `keys`, lock free; drop and count the bad
        ones. A page whose checksum was left to the daemon is sealed instead: its checksum
        computed and stored in its header (it cannot be bad). Returns the `tags` of the bad. The
        caller (an acquire) holds a pin on each page, which goes for the bad ones. `background`
        (the mover): no pins (a pin would count as a use and reorder eviction); a page freed
        meanwhile (its slot generation moved) is left for the next pass."""
        dram = self.tiers.dram
        todo: list[tuple[int, bytes, PageEntry, int, int, memoryview, int | None]] = []
        known_bad: list[tuple[int, bytes]] = []
        with self._lock:
            for tag, key in zip(tags, keys, strict=True):
                if key in self._corrupt_pinned:  # found bad by another check, still pinned
                    if not background:
                        known_bad.append((tag, key))
                    continue
                entry = self.index.get(key)
                deferred = entry is not None and checksum_deferred(entry.header)
                if (
                    entry is None
                    or entry.dram is None
                    or (key not in self._unverified and not deferred)
                ):
                    self._unverified.discard(key)
                    continue
                raw = entry.header
                want = None if deferred else checked_payload_checksum(raw)
                view = dram.view(entry.dram, entry.payload_bytes)
                slot = entry.dram
                todo.append((tag, key, entry, slot, dram.generation(slot), view, want))
        results = [
            (tag, key, entry, slot, gen, want, payload_checksum(view))
            for tag, key, entry, slot, gen, view, want in todo
        ]
        bad: list[int] = []
        with self._lock:
            for tag, key in known_bad:
                bad.append(tag)
                self._unpin(key)
            for tag, key, entry, slot, gen, want, got in results:
                if background and (
                    self.index.get(key) is not entry
                    or entry.dram != slot  # back in DRAM, elsewhere: the generation is another's
                    or dram.generation(slot) != gen
                ):
                    continue  # it moved or went while being checked: the result says nothing
                self._unverified.discard(key)
                if want is None:  # left to the daemon: sealed with the checksum of its bytes
                    if self.index.get(key) is entry and checksum_deferred(entry.header):
                        self.index.seal_header(key, seal_header(entry.header, got))
                    continue
                if got == want:
                    continue
                bad.append(tag)
                log.warning("same-host put of page %s failed its checksum: dropped", key.hex())
                with self.counters.lock:
                    self.counters.shm_put_corrupt += 1
                    self.counters.corrupt_dropped += 1
                if background:
                    self._drop_if_unpinned(entry)  # or, when a reader holds it, at its release
                    if entry.leases:
                        self._corrupt_pinned.add(key)
                        self._doomed.add(key)
                    continue
                self._corrupt_pinned.add(key)
                self._doomed.add(key)  # gone for new readers; dropped with its last pin
                self._unpin(key)
        return bad

    def _read_ssd(
        self, keys: Sequence[bytes], slots: dict[int, int], io_class: IoClass
    ) -> dict[int, int]:
        """Read pinned SSD pages `keys[i]` straight into their DRAM slots `slots[i]`, verified,
        lock free. Each page's outcome: `_READ_OK`, `_READ_BAD` (failed verification or gone
        from the SSD: the caller drops it) or `_READ_IO_ERROR` (the disk failed: the page stays,
        the read is a miss; counted in `ssd_read_errors`).

        Reads run one ahead on a reader thread while this one verifies the page before: the
        read releases the GIL, so the checksum of one page overlaps the disk read of the next.
        """
        ssd = self.tiers.ssd
        out: dict[int, int] = {}
        if ssd is None:
            return out
        dram = self.tiers.dram

        def fetch(i: int) -> tuple[PageHeader | None, memoryview] | StrataError:
            key, slot = keys[i], slots[i]
            entry = self.index.get(key)  # pinned: it stays
            try:
                known = PageHeader.decode(entry.header) if entry is not None else None
                view = dram.view(slot, dram.slot_bytes(slot))
                return ssd.read_into(key, view, known, verify=False), view
            except (Corrupt, Unavailable) as exc:
                return exc
            except OSError as exc:  # an I/O error the tier did not wrap: still a disk failure
                return Unavailable(f"ssd tier: reading page {key.hex()}: {exc}")

        order = list(slots)
        errors = 0
        total = sum(dram.slot_bytes(slots[i]) for i in order)
        with self.scheduler.admit(io_class, total):  # SSD reads keep to their class (and cap)
            ahead = self._ssd_reader().submit(fetch, order[0])
            for n, i in enumerate(order):
                got = ahead.result()
                if n + 1 < len(order):
                    ahead = self._ssd_reader().submit(fetch, order[n + 1])
                if isinstance(got, Unavailable):
                    log.warning("SSD read of page %s failed: %s", keys[i].hex(), got)
                    out[i] = _READ_IO_ERROR
                    errors += 1
                    continue
                if not isinstance(got, StrataError):
                    header, view = got
                    try:
                        if header is not None:
                            header.verify_payload(view[: header.payload_bytes])
                    except Corrupt as exc:
                        got = exc
                if isinstance(got, StrataError):
                    log.warning("SSD page %s failed verification: %s", keys[i].hex(), got)
                    out[i] = _READ_BAD
                    continue
                out[i] = _READ_OK if got[0] is not None else _READ_BAD
                if got[0] is not None:
                    self.counters.add_bytes("ssd", "out", io_class, got[0].payload_bytes)
        if errors:
            with self.counters.lock:
                self.counters.ssd_read_errors += errors
        return out

    def _ssd_reader(self) -> ThreadPoolExecutor:
        """The thread that reads SSD pages ahead of their verification (made on first use)."""
        pool = self._ssd_pool
        if pool is None:
            with self._lock:
                if self._ssd_pool is None:
                    self._ssd_pool = ThreadPoolExecutor(1, thread_name_prefix="strata-ssd-read")
                pool = self._ssd_pool
        return pool

    def release(self, lease_id: int) -> bool:
        """End a lease (read: unpin; reservation: abort). Mutates. False if unknown/expired
        (an expired reservation's quarantined slots are freed: its holder is done with them)."""
        with self._lock:
            if self._late_call(lease_id):
                return False
            try:
                lease = self.leases.release(lease_id)
            except LeaseExpired:
                return False
            self._end_lease(lease)
            return True

    def renew(self, lease_id: int, lease_ms: int = 0) -> int:
        """Extend a lease; returns its new expiry (unix ms). A reservation is renewed for at
        most `limits.max_reserve_lease_ms`, as it was granted. Raises LeaseExpired."""
        with self._lock:
            ttl_s = self._ttl_s(lease_ms)
            if self.leases.get(lease_id).kind is LeaseKind.RESERVE:
                ttl_s = min(ttl_s, self.config.limits.max_reserve_lease_ms / 1000.0)
            lease = self.leases.renew(lease_id, ttl_s)
        return self._unix_ms(lease)

    def reap_leases(self) -> int:
        """End every lease past its expiry. Mutates; caller may or may not hold the lock."""
        with self._lock:
            expired = self.leases.expire_due()
            for lease in expired:
                self._end_lease(lease, expired=True)
            if len(self.quarantine):
                for offsets in self.quarantine.sweep(self._clock()):
                    for offset in offsets:
                        self.tiers.dram.free(offset)
        if expired:
            with self.counters.lock:
                self.counters.lease_expiries += len(expired)
            log.info("%d leases expired", len(expired))
        return len(expired)

    def _end_lease(self, lease: Lease, *, expired: bool = False) -> None:
        """Free what a lease held. An expired reservation's keys are free at once; its slots
        are quarantined until its holder is done (kvstore/fence.py). Lock held."""
        if lease.kind is LeaseKind.RESERVE:
            self._pending_class.pop(lease.lease_id, None)
            self._unreserve(lease.lease_id)
            holder = self._pending_holder.pop(lease.lease_id, DAEMON)
            held: list[int] = []
            for pending in self._pending.pop(lease.lease_id, []):
                if pending is not None:
                    self._pending_keys.discard(pending.header.key)
                    held.append(pending.offset)
            if expired and held:
                self.quarantine.hold(lease.lease_id, holder, tuple(held), self._clock())
                with self.counters.lock:
                    self.counters.quarantined_slots += len(held)
            else:
                for offset in held:
                    self.tiers.dram.free(offset)
            return
        for key in lease.keys:
            self._unpin(key)

    def _unreserve(self, lease_id: int) -> None:
        """A reservation ended: its bytes leave its client's and its namespace's share. Lock
        held."""
        held = self._pending_ns.pop(lease_id, None)
        if held is not None:
            namespace, n_bytes = held
            # (a reservation that reserved nothing, n_bytes 0, may end after the namespace's
            # last reserved bytes left: its entry is gone then)
            left = self._ns_reserved.get(namespace, 0) - n_bytes
            if left > 0:
                self._ns_reserved[namespace] = left
            else:
                self._ns_reserved.pop(namespace, None)
        owner = self._pending_client.pop(lease_id, None)
        if owner is None:
            return
        client, n_bytes = owner
        left = self._reserved_bytes[client] - n_bytes
        if left > 0:
            self._reserved_bytes[client] = left
        else:
            del self._reserved_bytes[client]

    def _late_call(self, lease_id: int) -> bool:
        """The holder of an expired, quarantined reservation called on it: free its slots (its
        copy is over). True when it was one. Lock held."""
        offsets = self.quarantine.late_call(lease_id)
        if offsets is None:
            return False
        for offset in offsets:
            self.tiers.dram.free(offset)
        with self.counters.lock:
            self.counters.stale_fenced += 1
        log.info("late call on expired reservation %d: its %d slots freed", lease_id, len(offsets))
        return True

    def _unpin(self, key: bytes) -> None:
        """Drop one pin; a page deleted while pinned goes when its last pin does. Lock held."""
        entry = self.index.get(key)
        if entry is None:
            return
        self.index.unpin(key)
        if key in self._doomed:
            self._drop_if_unpinned(entry)

    def _drop_if_unpinned(self, entry: PageEntry, *, corrupt: bool = False) -> None:
        if corrupt:
            if entry.leases == 0:
                self._doomed.discard(entry.key)
                self.tiers.drop_corrupt(entry)
                if self.index.get(entry.key) is None:
                    self._install_replacement(entry.key)
            else:
                with self.counters.lock:
                    self.counters.corrupt_dropped += 1
                self._doomed.add(entry.key)
            return
        if entry.leases:
            return
        self._doomed.discard(entry.key)
        self._corrupt_pinned.discard(entry.key)
        self.tiers.drop(entry, reason_tier=None, count_eviction=False)
        self._install_replacement(entry.key)

    def _install_replacement(self, key: bytes) -> None:
        """Store the page put while its deleted predecessor was leased (it is gone now)."""
        pending = self._replacing.pop(key, None)
        if pending is None:
            return
        if key in self._replacing_unverified:
            self._replacing_unverified.discard(key)
            if not checksum_deferred(pending.raw_header):
                self._unverified.add(key)
        header = pending.header
        entry = PageEntry(
            key,
            header.parent,
            header.scope_digest,
            pending.raw_header,
            header.payload_bytes,
            None,
            pending.offset,
        )
        self.index.insert(entry)
        self.events.publish(
            EventKind.STORED, key, entry.scope_digest, entry.payload_bytes, None, Tier.DRAM
        )

    # ---- delete, stats ------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes] | None = None, scope_digest: bytes | None = None) -> int:
        """Remove pages by key or by scope. Mutates. Leased pages go when their lease ends.

        Returns the number of pages deleted (including those deferred behind a lease).
        """
        if (keys is None) == (scope_digest is None):
            raise InvalidArgument("delete needs exactly one of keys or scope_digest")
        with self._lock:
            targets = (
                list(keys) if keys is not None else self.index.keys_of_scope(scope_digest or b"")
            )
            if keys is not None:
                self._check_keys(targets)
            deleted = 0
            for key in targets:
                replacement = self._replacing.pop(key, None)
                self._replacing_unverified.discard(key)
                if replacement is not None:  # the page put again after an earlier delete
                    self.tiers.dram.free(replacement.offset)
                    deleted += 1
                    continue
                entry = self.index.get(key)
                if entry is None or key in self._doomed:
                    continue
                deleted += 1
                if entry.leases:
                    self._doomed.add(key)
                else:
                    self.tiers.drop(entry, reason_tier=None, count_eviction=False)
            return deleted

    def stats(self) -> StoreStats:
        """A snapshot of tier occupancy. Read-only. (Counters: read `self.counters`.)"""
        with self._lock:
            return StoreStats(tuple(self.tiers.gauges()), len(self.index), len(self.leases))

    def check_integrity(self) -> None:
        """Verify the index's derived state and the tiers' byte accounting. Raises RuntimeError."""
        with self._lock:
            self.index.check_integrity()
            dram_blocks = sum(
                1 for key in self.index_keys() if (e := self.index.get(key)) and e.dram is not None
            )
            pending = sum(1 for g in self._pending.values() for p in g if p is not None)
            pending += len(self._replacing) + self.quarantine.blocks
            if dram_blocks + pending != self.tiers.dram.allocated_blocks:
                raise RuntimeError(
                    f"DRAM blocks: {self.tiers.dram.allocated_blocks} allocated, "
                    f"{dram_blocks} resident + {pending} pending, replacing or quarantined"
                )
            stray = set(self._pending_holder) - set(self._pending)
            if stray:
                raise RuntimeError(f"holders of reservations that are gone: {sorted(stray)}")

    def namespace_usage(self) -> list[NamespaceGauge]:
        """Bytes per namespace and tier, with its quota (metrics). Read-only."""
        quotas = self.tiers.quotas
        tiers = [t for t in (Tier.GPU, Tier.DRAM, Tier.SSD) if t is not Tier.GPU or self.tiers.gpu]
        with self._lock:
            names = set(self.index.namespaces()) | set(quotas.named())
            return [
                NamespaceGauge(ns, t, self.index.namespace_bytes(ns, t), quotas.limit(ns, t))
                for ns in sorted(names)
                for t in tiers
                if t is not Tier.SSD or self.tiers.ssd is not None
            ]

    def index_keys(self) -> list[bytes]:
        with self._lock:
            return self.index.keys()

    # ---- accounting -------------------------------------------------------------------------

    def _count_hits(self, tiers: Sequence[Tier]) -> None:
        """Count pages served by their tier; every faster tier present was consulted and missed."""
        if not tiers:
            return
        faster = [
            t for t in (Tier.GPU, Tier.DRAM) if t is not Tier.GPU or self.tiers.gpu is not None
        ]
        with self.counters.lock:
            for tier in tiers:
                self.counters.hits[tier] += 1
                for f in faster:
                    if f < tier:
                        self.counters.misses[f] += 1

    def _count_miss(self, first: Tier, *, through_ssd: bool, count: int = 1) -> None:
        """`count` misses, in every tier from `first` down (SSD only `through_ssd`)."""
        with self.counters.lock:
            for tier in (Tier.GPU, Tier.DRAM, Tier.SSD):
                if tier < first:
                    continue
                if tier is Tier.SSD and (self.tiers.ssd is None or not through_ssd):
                    continue
                self.counters.misses[tier] += count
