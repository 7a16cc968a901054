"""Background movement: write-through copies, watermark demotion and lease expiry.

One thread. Each pass (on a kick — a write that took DRAM above its high watermark, a queued
write-through copy, a drain — or every `interval_s`): end expired leases; check the payloads of
same-host puts not checked yet (a batch per pass; a reader never waits for this: it checks a
page it wants itself); copy queued
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

from client.page import PageHeader
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
        self._queue: deque[bytes] = deque()
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
        """Queue a page for a background copy to SSD."""
        with self._cond:
            self._queue.append(key)
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
                key = self._queue.popleft()
            with self._lock:
                entry = self._tiers.index.get(key)
                if entry is None or entry.ssd or entry.dram is None:
                    continue
            self._copy_to_ssd(entry, clear_dram=False)
        self._demote_to_watermark()

    def _demote_to_watermark(self) -> None:
        dram = self._tiers.dram
        if dram.used_bytes <= self._high * dram.capacity_bytes:
            return
        target = self._low * dram.capacity_bytes
        moved = 0
        while dram.used_bytes > target:
            with self._lock:
                victim = next(self._tiers.index.eviction_candidates(Tier.DRAM), None)
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
            if not self._copy_to_ssd(victim, clear_dram=True):
                break
            moved += 1
        if moved:
            log.debug("demoted %d pages below the DRAM low watermark", moved)

    def _copy_to_ssd(self, entry: PageEntry, *, clear_dram: bool) -> bool:
        """Write a DRAM page to SSD with the lock free; optionally release its DRAM copy."""
        ssd = self._tiers.ssd
        if ssd is None:
            return False
        key = entry.key
        with self._lock:
            if self._tiers.index.get(key) is not entry or entry.dram is None:
                return True
            try:
                self._tiers.make_room_ssd(entry.payload_bytes + len(entry.header))
            except CapacityExhausted as exc:
                log.debug("background SSD write skipped: %s", exc)
                if clear_dram and entry.leases == 0:
                    self._tiers.demote_dram(entry)  # drops it: SSD cannot take it
                    return True
                return False
            self._tiers.index.pin(key)
            header = PageHeader.decode(entry.header)
            view = self._tiers.dram.view(entry.dram, entry.payload_bytes)
        ok = False
        try:
            with self._scheduler.admit(IoClass.BACKGROUND, entry.payload_bytes):
                ssd.write(header, view)
            ok = True
            self._tiers.counters.add_bytes("ssd", "in", IoClass.BACKGROUND, entry.payload_bytes)
        except StrataError as exc:
            log.warning("background SSD write of %s failed: %s", key.hex(), exc)
        finally:
            with self._lock:
                if ok and self._tiers.index.get(key) is entry:
                    self._tiers.index.set_residency(key, Tier.SSD, True)
                self._unpin(key)
                if (
                    ok
                    and clear_dram
                    and self._tiers.index.get(key) is entry
                    and entry.leases == 0
                    and entry.dram is not None
                ):
                    # already on SSD: frees the DRAM copy, counts the demotion, tells watchers
                    self._tiers.demote_dram(entry)
        return ok
