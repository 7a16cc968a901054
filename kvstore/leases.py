"""Leases: time-limited claims on pages, so a crashed engine leaks nothing (DESIGN §5).

A READ lease pins pages a reader was handed; a RESERVE lease holds slots a writer will fill. The
table only keeps the leases and their clock; the store pins and unpins pages for them.

Every lease leaves the table exactly once: by `release()` before it expires, or by
`expire_due()` after. An expired lease is refused by `get`, `renew` and `release` but stays in the
table until `expire_due()` hands it to the store, which then frees what it covered.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, LeaseExpired

__all__ = ["NO_LEASE", "Lease", "LeaseKind", "LeaseTable"]

NO_LEASE = 0  # the wire's "no lease taken"; never granted


class LeaseKind(enum.Enum):
    READ = 1  # pins pages handed to a reader
    RESERVE = 2  # holds slots reserved for a writer


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    kind: LeaseKind
    keys: tuple[bytes, ...]
    expires_at: float  # on the table's monotonic clock, seconds

    def remaining_s(self, now: float) -> float:
        """Seconds left at `now` (0 once expired)."""
        return max(0.0, self.expires_at - now)


class LeaseTable:
    """Active leases by id, with an expiry heap (lazy deletion) on an injectable clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ids = itertools.count(NO_LEASE + 1)
        self._leases: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []  # (expires_at, lease_id); stale items skipped

    def __len__(self) -> int:
        """Leases in the table, including expired ones not yet reaped by `expire_due`."""
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        """Whether `lease_id` is in the table (live, or expired and not yet reaped)."""
        return lease_id in self._leases

    def grant(self, kind: LeaseKind, keys: Iterable[bytes], ttl_s: float) -> Lease:
        """Create a lease for `keys` expiring `ttl_s` from now. Mutates. Ids start at 1 and are
        never reused in a process. Raises InvalidArgument unless `ttl_s` is finite and > 0."""
        lease = Lease(next(self._ids), kind, tuple(keys), self._expiry(ttl_s))
        self._leases[lease.lease_id] = lease
        self._push(lease)
        return lease

    def get(self, lease_id: int) -> Lease:
        """The live lease. Does not mutate. Raises LeaseExpired if unknown or expired."""
        lease = self._leases.get(lease_id)
        if lease is None or self._clock() >= lease.expires_at:
            raise LeaseExpired(f"lease {lease_id} is unknown or has expired")
        return lease

    def renew(self, lease_id: int, ttl_s: float) -> Lease:
        """Extend (or shorten) a live lease to expire `ttl_s` from now; returns the new value.
        Mutates. Raises LeaseExpired if unknown or expired, InvalidArgument for a bad ttl."""
        lease = self.get(lease_id)
        renewed = Lease(lease.lease_id, lease.kind, lease.keys, self._expiry(ttl_s))
        self._leases[lease_id] = renewed
        self._push(renewed)
        return renewed

    def release(self, lease_id: int) -> Lease:
        """Remove a live lease and return it (the caller frees what it covered). Mutates.
        Raises LeaseExpired if unknown or expired; an expired one is left for `expire_due`."""
        lease = self.get(lease_id)
        del self._leases[lease_id]
        self._compact()
        return lease

    def expire_due(self) -> list[Lease]:
        """Remove and return every lease expired by now, earliest expiry first (ties by id).
        Mutates; the caller frees what each covered."""
        now = self._clock()
        due: list[Lease] = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, lease_id = heapq.heappop(self._heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at:
                del self._leases[lease_id]
                due.append(lease)
        return due

    def next_expiry(self) -> float | None:
        """When the earliest lease expires (clock seconds), or None if there are none.
        Drops stale heap items on the way; the set of leases does not change."""
        while self._heap:
            expires_at, lease_id = self._heap[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at:
                return expires_at
            heapq.heappop(self._heap)
        return None

    def _expiry(self, ttl_s: float) -> float:
        if not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidArgument(f"lease ttl must be a positive number of seconds, not {ttl_s!r}")
        return self._clock() + ttl_s

    def _push(self, lease: Lease) -> None:
        heapq.heappush(self._heap, (lease.expires_at, lease.lease_id))
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap once stale items outnumber live ones, so memory stays O(leases)."""
        if len(self._heap) > 2 * len(self._leases) + 64:
            self._heap = [(lease.expires_at, lease.lease_id) for lease in self._leases.values()]
            heapq.heapify(self._heap)
