"""Arrival processes: the send times of a run, seeded and pure.

`arrival_times(spec, rate, duration_s, rng)` returns sorted times in [0, duration_s):
- poisson: exponential gaps of mean 1/rate;
- gamma: gamma gaps of mean 1/rate and coefficient of variation `cv` (cv > 1 is burstier than
  Poisson, cv < 1 smoother; cv = 1 is Poisson);
- onoff: Poisson during `on_s` windows separated by `off_s` of silence, the on-rate raised so the
  mean over a cycle is `rate`;
- ramp: a Poisson process whose rate goes linearly from `rate` to `rate_end` (by thinning).
Trace timestamps are not generated here: `trace.py` reads them.
"""

from __future__ import annotations

import random

from loadtests.workload.spec import ArrivalSpec, WorkloadError

_MAX_ARRIVALS = 10_000_000


def arrival_times(
    spec: ArrivalSpec, rate: float, duration_s: float, rng: random.Random
) -> list[float]:
    """Send times for a mean rate of `rate`/s over `duration_s` (ramp: `rate` scales both ends)."""
    if rate <= 0:
        raise WorkloadError(f"arrival rate must be > 0, got {rate}")
    if rate * duration_s > _MAX_ARRIVALS:
        raise WorkloadError(f"{rate}/s for {duration_s}s is more than {_MAX_ARRIVALS} requests")
    out: list[float] = []
    t = 0.0
    if spec.process in ("poisson", "gamma"):
        shape = 1.0 / (spec.cv * spec.cv) if spec.process == "gamma" else 1.0
        scale = 1.0 / (rate * shape)
        while True:
            t += (
                rng.gammavariate(shape, scale) if spec.process == "gamma" else rng.expovariate(rate)
            )
            if t >= duration_s:
                return out
            out.append(t)
    if spec.process == "onoff":
        cycle = spec.on_s + spec.off_s
        on_rate = rate * cycle / spec.on_s
        while True:
            t += rng.expovariate(on_rate)
            phase_start = (t // spec.on_s) * cycle  # map "on-time" onto the wall clock
            wall = phase_start + (t % spec.on_s)
            if wall >= duration_s:
                return out
            out.append(wall)
    if spec.process == "ramp":
        start, end = rate, rate * (spec.rate_end / spec.rate) if spec.rate > 0 else rate
        peak = max(start, end)
        while True:
            t += rng.expovariate(peak)
            if t >= duration_s:
                return out
            current = start + (end - start) * t / duration_s
            if rng.random() * peak < current:
                out.append(t)
    raise WorkloadError(
        f"arrival process {spec.process!r} has no generated times (trace reads them)"
    )
