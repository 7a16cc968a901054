"""Fault injection for the SSD tier: a disk that fails or is slow, on purpose.

`SsdFaults` is what the tier's segment files consult on every payload read and write (one
attribute read when no fault is configured). A read error raises the same `Unavailable` an
`EIO` from `preadv` raises; a write error the same one a failed `pwritev` raises; delays sleep
where the disk would, before the I/O. The daemon builds it from `ssd.fault_*` config (so a
daemon subprocess takes it from `STRATA_SSD_FAULT_*` environment variables: chaos runs and
the slow-disk measurement use that); tests may also assign `SsdTier.faults` directly.

Never on in production: every field defaults to no fault, and the daemon logs a warning at
start when any is set.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from kvstore.config import SsdConfig
from kvstore.errors import InvalidArgument, Unavailable

__all__ = ["NO_FAULTS", "SsdFaults", "faults_from_config"]


@dataclass(frozen=True, slots=True)
class SsdFaults:
    """Which SSD faults to inject. Rates are probabilities per payload read or write."""

    read_error_rate: float = 0.0
    write_error_rate: float = 0.0
    read_delay_ms: int = 0
    write_delay_ms: int = 0
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)
    _rng_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("read_error_rate", "write_error_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise InvalidArgument(f"ssd fault {name} must be in [0, 1], got {rate}")
        if self.read_delay_ms < 0 or self.write_delay_ms < 0:
            raise InvalidArgument("ssd fault delays must not be negative")
        self._rng.seed(self.seed)

    @property
    def active(self) -> bool:
        return bool(
            self.read_error_rate
            or self.write_error_rate
            or self.read_delay_ms
            or self.write_delay_ms
        )

    def before_read(self, what: str) -> None:
        """Called before a payload read: sleeps, then maybe raises Unavailable (an I/O error)."""
        if self.read_delay_ms:
            time.sleep(self.read_delay_ms / 1000.0)
        if self.read_error_rate and self._roll(self.read_error_rate):
            raise Unavailable(f"ssd tier: reading {what}: [Errno 5] Input/output error (injected)")

    def before_write(self, what: str) -> None:
        """Called before a payload write: sleeps, then maybe raises Unavailable."""
        if self.write_delay_ms:
            time.sleep(self.write_delay_ms / 1000.0)
        if self.write_error_rate and self._roll(self.write_error_rate):
            raise Unavailable(f"ssd tier: writing {what}: [Errno 5] Input/output error (injected)")

    def _roll(self, rate: float) -> bool:
        with self._rng_lock:
            return self._rng.random() < rate


NO_FAULTS = SsdFaults()


def faults_from_config(ssd: SsdConfig) -> SsdFaults:
    """The injected faults `ssd.fault_*` ask for (none by default)."""
    return SsdFaults(
        read_error_rate=ssd.fault_read_error_rate,
        write_error_rate=ssd.fault_write_error_rate,
        read_delay_ms=ssd.fault_read_delay_ms,
        write_delay_ms=ssd.fault_write_delay_ms,
        seed=ssd.fault_seed,
    )
