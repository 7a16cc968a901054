"""Comparing every prediction with what happened: the time model's error, and whether it drifted.

The router records, per request, the TTFT and TPOT it predicted and the ones it then observed.
The tracker keeps the last `window` pairs of each kind (and only those younger than `max_age_s`)
and reports the median signed relative error (predicted - observed) / observed: positive means
the model is pessimistic, negative optimistic. A profile has drifted when that median's size
exceeds `threshold` over at least `min_samples` pairs; the shell exports both to /metrics and
logs the change. No clock: `now` comes in with each call.
"""

from __future__ import annotations

import statistics
from collections import deque

KINDS = ("ttft", "tpot")


class PredictionTracker:
    def __init__(
        self,
        *,
        window: int = 512,
        threshold: float = 0.25,
        min_samples: int = 20,
        max_age_s: float = 600.0,
    ) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.threshold = threshold
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._pairs: dict[str, deque[tuple[float, float]]] = {
            k: deque(maxlen=window) for k in KINDS
        }  # (time, signed relative error)
        self.recorded: dict[str, int] = {k: 0 for k in KINDS}

    def record(self, kind: str, predicted_s: float, observed_s: float, now: float) -> float:
        """Store one pair; returns its signed relative error. Ignores a non-positive observation."""
        if kind not in KINDS:
            raise ValueError(f"unknown prediction kind {kind!r} (known: {', '.join(KINDS)})")
        if not observed_s > 0:
            return 0.0
        error = (predicted_s - observed_s) / observed_s
        self._pairs[kind].append((now, error))
        self.recorded[kind] += 1
        return error

    def _recent(self, kind: str, now: float | None) -> list[float]:
        if kind not in KINDS:
            raise ValueError(f"unknown prediction kind {kind!r} (known: {', '.join(KINDS)})")
        pairs = self._pairs[kind]
        if now is None:
            return [e for _, e in pairs]
        return [e for t, e in pairs if now - t <= self.max_age_s]

    def count(self, kind: str, now: float | None = None) -> int:
        return len(self._recent(kind, now))

    def median_relative_error(self, kind: str, now: float | None = None) -> float:
        """The median signed relative error (0.0 with no samples)."""
        errors = self._recent(kind, now)
        return statistics.median(errors) if errors else 0.0

    def median_abs_relative_error(self, kind: str, now: float | None = None) -> float:
        errors = self._recent(kind, now)
        return statistics.median(abs(e) for e in errors) if errors else 0.0

    def drifted(self, kind: str, now: float | None = None) -> bool:
        """True when the median error's size passed `threshold` over >= `min_samples` pairs."""
        errors = self._recent(kind, now)
        if len(errors) < self.min_samples:
            return False
        return abs(statistics.median(errors)) > self.threshold
