"""Background movement: write-through copies, watermark demotion and lease expiry.

One thread. Each pass (on a kick — a write that took DRAM above its high watermark, a queued
write-through copy, a drain — or every `interval_s`): end expired leases; check the payloads of
same-host puts whose writer sent a checksum not checked yet (a batch per pass; a reader never
waits for this: it checks a page it wants itself; a checksum the writer left to the daemon is
computed when the page leaves DRAM, here in `copy_to_ssd`); copy queued
write-through pages to SSD; and, while DRAM is above its high watermark, demote least valuable
pages until it is below the low one. SSD writes run as I/O class BACKGROUND (so they yield to
reads and respect the background bandwidth cap), with the page pinned and the store lock free.
`drain()` lets tests and benchmarks wait for the work queued so far without sleeping.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from client.contract.page import PageHeader, payload_checksum, seal_header
from kvstore.config import DramConfig
from kvstore.errors import CapacityExhausted, StrataError
from kvstore.index import PageEntry
from kvstore.keys import IoClass, Tier
from kvstore.movement import Tiers
from kvstore.scheduler import IoScheduler

log = logging.getLogger(__name__)


class Mover:
    """The background mover thread of one store."""

    def __init__(
        self,
        lock: threading.RLock,
        tiers: Tiers,
        scheduler: IoScheduler,
        dram: DramConfig,
        reap_leases: Callable[[], int],
        unpin: Callable[[bytes], None],
        interval_s: float = 0.2,
        verify: Callable[[], int] | None = None,
    ) -> None:
        self._lock = lock
        self._tiers = tiers
        self._scheduler = scheduler
        self._high = dram.high_watermark
        self._low = dram.low_watermark
        self._reap = reap_leases
        self._unpin = unpin
        self._verify = verify  # checks same-host puts' payloads (Store.verify_same_host_puts)
        self._interval_s = interval_s
        # write-through copies and SSD placements asked for, bounded: a key per DRAM page at
        # most (the oldest request goes first when it overflows; its page just stays in DRAM)
        self._queue: deque[tuple[bytes, bool]] = deque(maxlen=max(1, dram.capacity_bytes // 4096))
        self.dropped_requests = 0
        self._cond = threading.Condition()
        self._kicked = False
        self._stopped = False
        self._passes = 0
        self._thread = threading.Thread(target=self._run, name="strata-mover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def kick(self) -> None:
        """Ask for a pass soon."""
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def kick_if_above_watermark(self) -> None:
        """Ask for a pass soon if DRAM is above its high watermark (after a write). Below it, a
        pass would find nothing to do: waking the thread anyway costs the writer its reply time
        (the woken thread competes for the GIL); expired leases are reaped on the timer."""
        dram = self._tiers.dram
        if dram.used_bytes > self._high * dram.capacity_bytes:
            self.kick()

    def write_through(self, key: bytes) -> None:
        """Queue a page for a background copy to SSD (it stays in DRAM too)."""
        self._request(key, clear_dram=False)

    def place_on_ssd(self, key: bytes) -> None:
        """Queue a page to be moved to SSD (its writer asked for that tier): written by the
        mover with the store lock free, then its DRAM copy released."""
        self._request(key, clear_dram=True)

    def _request(self, key: bytes, *, clear_dram: bool) -> None:
        with self._cond:
            if len(self._queue) == self._queue.maxlen:
                self.dropped_requests += 1
            self._queue.append((key, clear_dram))
            self._kicked = True
            self._cond.notify_all()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Block until two full passes have run after this call (so all queued work is done)."""
        with self._cond:
            target = self._passes + 2
            self._kicked = True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._passes >= target or self._stopped, timeout_s):
                raise TimeoutError("mover did not drain in time")

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._kicked and not self._stopped:
                    self._cond.wait(self._interval_s)
                if self._stopped:
                    return
                self._kicked = False
            try:
                self._pass()
            except Exception:  # the mover must outlive any one bad page
                log.exception("mover pass failed")
            with self._cond:
                self._passes += 1
                self._cond.notify_all()

    def _pass(self) -> None:
        self._reap()
        if self._verify is not None:
            self._verify()
        while True:
            with self._cond:
                if not self._queue:
                    break
                key, clear_dram = self._queue.popleft()
            with self._lock:
                entry = self._tiers.index.get(key)
                if entry is None or entry.dram is None or (entry.ssd and not clear_dram):
                    continue
                if entry.ssd:  # already there: only its DRAM copy goes
                    if entry.leases == 0:
                        self._tiers.demote_dram(entry)
                    continue
            self.copy_to_ssd(entry, clear_dram=clear_dram)
        self._demote_to_watermark()
        ssd = self._tiers.ssd
        if ssd is not None:  # disk work of the SSD tier itself, never under the store lock
            try:
                ssd.flush_deletes()
                ssd.compact_step()
            except StrataError as exc:
                log.warning("ssd tier upkeep failed: %s", exc)

    def _demote_to_watermark(self) -> None:
        dram = self._tiers.dram
        if dram.used_bytes <= self._high * dram.capacity_bytes:
            return
        target = self._low * dram.capacity_bytes
        moved = 0
        while dram.used_bytes > target:
            with self._lock:
                victim = next(self._tiers.candidates(Tier.DRAM), None)
                if victim is None:
                    break
                needs_io = (
                    self._tiers.ssd is not None
                    and not victim.ssd
                    and victim.gpu is None
                    and self._tiers.admission.admit(victim)
                )
                if not needs_io:  # nothing to write: the fast path drops or keeps a lower copy
                    self._tiers.demote_dram(victim)
                    moved += 1
                    continue
            if not self.copy_to_ssd(victim, clear_dram=True):
                break
            moved += 1
        if moved:
            log.debug("demoted %d pages below the DRAM low watermark", moved)

    def copy_to_ssd(
        self,
        entry: PageEntry,
        *,
        clear_dram: bool,
        io_class: IoClass = IoClass.BACKGROUND,
        must_leave: bool = True,
    ) -> bool:
        """Write a DRAM page to SSD with the store lock free (plan under the lock: room on SSD,
        a pin; the write through the scheduler in `io_class`; apply under the lock: SSD
        residency, unpin) and, with `clear_dram`, release its DRAM copy. A page that cannot be
        written (SSD full of leased pages, a disk error) and `must_leave` DRAM (to make room)
        is dropped: a page is never nowhere, and never half written; otherwise it stays in
        DRAM. A page whose payload checksum was left to the daemon (a same-host put not sealed
        yet) gets it now, from the pinned DRAM bytes, before it is written: no page reaches SSD
        without its checksum, and its index header carries it from then on. False when nothing
        could be done."""
        ssd = self._tiers.ssd
        if ssd is None:
            return False
        key = entry.key
        with self._lock:
            if self._tiers.index.get(key) is not entry or entry.dram is None:
                return True
            try:
                self._tiers.make_room_ssd(
                    entry.payload_bytes + len(entry.header), entry.scope_digest, entry.payload_bytes
                )
            except CapacityExhausted as exc:
                log.debug("background SSD write skipped: %s", exc)
                if clear_dram and must_leave and entry.leases == 0:
                    self._tiers.drop(entry, reason_tier=Tier.DRAM)  # SSD cannot take it
                    return True
                return False
            self._tiers.index.pin(key)
            raw = entry.header
            header = PageHeader.decode(raw)
            view = self._tiers.dram.view(entry.dram, entry.payload_bytes)
        ok = failed = False
        try:
            if header.checksum_deferred:  # pinned: its bytes stay where they are
                raw = seal_header(raw, payload_checksum(view))
                header = PageHeader.decode(raw)
                with self._lock:
                    if self._tiers.index.get(key) is entry and entry.header != raw:
                        self._tiers.index.seal_header(key, raw)
            with self._scheduler.admit(io_class, entry.payload_bytes):
                ssd.write(header, view)
            ok = True
            self._tiers.counters.add_bytes("ssd", "in", io_class, entry.payload_bytes)
        except StrataError as exc:
            failed = True
            log.warning("SSD write of %s failed: %s", key.hex(), exc)
            with self._tiers.counters.lock:
                self._tiers.counters.ssd_write_errors += 1
        finally:
            with self._lock:
                if ok and self._tiers.index.get(key) is entry:
                    self._tiers.index.set_residency(key, Tier.SSD, True)
                self._unpin(key)
                if (
                    clear_dram
                    and (ok or (failed and must_leave))
                    and self._tiers.index.get(key) is entry
                    and entry.leases == 0
                    and entry.dram is not None
                ):
                    if ok:  # on SSD now: frees the DRAM copy, counts the demotion, tells watchers
                        self._tiers.demote_dram(entry)
                    else:  # it must leave and cannot go lower: dropped whole
                        self._tiers.drop(entry, reason_tier=Tier.DRAM)
        return ok
