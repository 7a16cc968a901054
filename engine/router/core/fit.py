"""Fitting a `TimeModel` to measured samples (pure Python least squares, see lstsq.py).

Each part is fitted on its own samples: prefill on (new, cached) points, decode on (batch,
context) points, and one pull line per (tier, path) that has samples. A part without samples
cannot be fitted: prefill and decode are required, pulls are optional.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from engine.router.core.lstsq import nonnegative_least_squares
from engine.router.core.timemodel import (
    DecodeCoeffs,
    PrefillCoeffs,
    Provenance,
    PullCoeffs,
    Samples,
    TimeModel,
)


def fit_time_model(samples: Samples, provenance: Provenance) -> TimeModel:
    """The model whose predictions best match `samples` in relative error (coefficients >= 0)."""
    if not samples.prefill:
        raise ValueError("a time model needs prefill samples")
    if not samples.decode:
        raise ValueError("a time model needs decode samples")
    p = nonnegative_least_squares(
        [PrefillCoeffs.features(s.new_tokens, s.cached_tokens) for s in samples.prefill],
        [s.seconds for s in samples.prefill],
    )
    d = nonnegative_least_squares(
        [DecodeCoeffs.features(s.batch, s.context_tokens) for s in samples.decode],
        [s.seconds for s in samples.decode],
    )
    pulls: list[PullCoeffs] = []
    paths = sorted({(s.tier, s.same_host) for s in samples.pull})
    for tier, same_host in paths:
        points = [s for s in samples.pull if s.tier == tier and s.same_host == same_host]
        if len({s.nbytes for s in points}) < 2:
            # One size cannot separate latency from bandwidth: all of it is bandwidth.
            per_byte = statistics.median(s.seconds / max(s.nbytes, 1) for s in points)
            pulls.append(PullCoeffs(tier, same_host, 0.0, per_byte))
            continue
        fixed, per_byte = nonnegative_least_squares(
            [(1.0, float(s.nbytes)) for s in points], [s.seconds for s in points]
        )
        pulls.append(PullCoeffs(tier, same_host, fixed, per_byte))
    return TimeModel(
        prefill=PrefillCoeffs(*p),
        decode=DecodeCoeffs(*d),
        pulls=tuple(pulls),
        provenance=provenance,
        samples=samples,
    )


@dataclass(frozen=True, slots=True)
class FitQuality:
    """How well a model predicts samples: median and worst relative error per part."""

    prefill_median: float
    prefill_max: float
    decode_median: float
    decode_max: float
    pull_median: float  # 0.0 when there are no pull samples
    pull_max: float


def fit_quality(model: TimeModel, samples: Samples | None = None) -> FitQuality:
    """Relative errors |predicted - measured| / measured of `model` on `samples` (default: its own)."""
    data = samples if samples is not None else model.samples
    pre = [_rel(model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in data.prefill]
    dec = [_rel(model.decode_step_s(s.batch, s.context_tokens), s.seconds) for s in data.decode]
    pul = [_rel(model.pull_s(s.nbytes, s.tier, s.same_host), s.seconds) for s in data.pull]
    return FitQuality(
        _median(pre),
        max(pre, default=0.0),
        _median(dec),
        max(dec, default=0.0),
        _median(pul),
        max(pul, default=0.0),
    )


def _rel(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else abs(predicted)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
