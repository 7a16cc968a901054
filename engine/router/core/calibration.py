"""Live calibration of the time model's prefill from the workers' own timings.

A profile is measured once, on the machine as it was then; a machine shared with other work (or
a GPU whose clocks change) computes at another speed later, and every TTFT prediction (the
queue drain and the compute, both priced with the prefill coefficients) is off by the same
factor. Each prefill worker reports how long its forward passes took (`PrefillTimings`
compute + sample) for how many computed tokens after how many cached ones; the calibration
keeps the ratio observed / profiled of the latest `window` of them and, once it has
`min_samples`, prices prefills with the profile's coefficients times their median (clipped to
`bounds`). The profile's shape (fixed, per token, attention) is kept; only its speed follows the
machine. `scale` is exported (`strata_router_prefill_speed_scale`; `drifted` when it leaves
DRIFT_BOUNDS, which the shell logs and exports as `strata_router_profile_drift`), so a profile
that has drifted stays visible even though predictions follow it.

Pure: no clock, no I/O; samples come in as arguments.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import replace

from engine.router.core.timemodel import PrefillCoeffs, TimeModel

# A live speed outside these times the profile's: the profile has drifted (measure it again).
DRIFT_BOUNDS = (2 / 3, 1.5)


class PrefillCalibration:
    """The speed of live prefills relative to `base`'s profile; see the module doc."""

    def __init__(
        self,
        base: TimeModel,
        *,
        window: int = 64,
        min_samples: int = 8,
        bounds: tuple[float, float] = (0.05, 20.0),
    ) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(
                f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}"
            )
        if not 0 < bounds[0] <= 1 <= bounds[1]:
            raise ValueError(f"bounds must satisfy 0 < low <= 1 <= high, got {bounds}")
        self.base = base
        self.min_samples = min_samples
        self.bounds = bounds
        self._ratios: deque[float] = deque(maxlen=window)
        self._scale = 1.0
        self._model = base

    @property
    def samples(self) -> int:
        return len(self._ratios)

    @property
    def scale(self) -> float:
        """Live prefill seconds per profiled second (1.0 until `min_samples` were observed)."""
        return self._scale

    @property
    def drifted(self) -> bool:
        """True when the live prefill speed is outside DRIFT_BOUNDS times the profile's."""
        low, high = DRIFT_BOUNDS
        return not low <= self._scale <= high

    @property
    def model(self) -> TimeModel:
        """`base` with its prefill coefficients times `scale` (decode and pulls as profiled)."""
        return self._model

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> bool:
        """One prefill that computed `new_tokens` after `cached_tokens` in `seconds`; returns
        whether `model` changed. Samples without computed tokens or time are ignored."""
        profiled = self.base.prefill_s(new_tokens, cached_tokens)
        if new_tokens <= 0 or seconds <= 0 or profiled <= 0:
            return False
        self._ratios.append(seconds / profiled)
        if len(self._ratios) < self.min_samples:
            return False
        low, high = self.bounds
        scale = min(high, max(low, statistics.median(self._ratios)))
        if abs(scale - self._scale) <= 1e-3 * self._scale:
            return False
        self._scale = scale
        p = self.base.prefill
        self._model = replace(
            self.base,
            prefill=PrefillCoeffs(
                p.fixed_s * scale,
                p.per_token_s * scale,
                p.per_cached_token_s * scale,
                p.attention_s * scale,
            ),
        )
        return True
