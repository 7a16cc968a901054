"""Live goodput search: bounded bisection over the request rate (`strata loadtest --search`).

Goodput is the highest rate at which ≥ 90% of requests meet both targets of their class. The
search probes `low` first (if it fails, goodput is under the range: 0), then `high` (if it
passes, goodput is at least `high`), then bisects between the highest passing and the lowest
failing rate, `steps` probes in all (never more; it stops early when a bound decides it). A
probe passes when the run meets the goal and is valid: a run whose client fell behind its
schedule measured the client, so it cannot vouch for the rate and counts as failing.

`next_rate(...)` is the plan (pure); `search(run_at, ...)` applies it, one short open-loop run
per step, with a progress line per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtests.report.metrics import ATTAINMENT_GOAL, run_metrics
from loadtests.report.records import RunResult


class SearchError(ValueError):
    """A search range or step count that cannot be searched."""


@dataclass(frozen=True, slots=True)
class Probe:
    rate: float
    attainment: float
    valid: bool

    def passed(self, goal: float = ATTAINMENT_GOAL) -> bool:
        return self.valid and not math.isnan(self.attainment) and self.attainment >= goal


def check_range(low: float, high: float, steps: int) -> None:
    if not 0 < low < high or not math.isfinite(high):
        raise SearchError(f"the search needs 0 < low < high, got {low:g} and {high:g}")
    if steps < 2:
        raise SearchError(f"the search needs at least 2 steps (the two bounds), got {steps}")


def next_rate(
    low: float, high: float, steps: int, done: Sequence[Probe], goal: float = ATTAINMENT_GOAL
) -> float | None:
    """The next rate to probe after `done`, or None when the search is over."""
    if len(done) >= steps:
        return None
    if not done:
        return low
    if not done[0].passed(goal):
        return None  # even the low bound misses: goodput is under the range
    if len(done) == 1:
        return high
    if done[1].passed(goal):
        return None  # the high bound meets the goal: goodput is at least the range's top
    good = max(p.rate for p in done if p.passed(goal))
    bad = min(p.rate for p in done if not p.passed(goal) and p.rate > good)
    return (good + bad) / 2


def goodput(done: Sequence[Probe], goal: float = ATTAINMENT_GOAL) -> float:
    """The highest probed rate that passed (0 when none did)."""
    return max((p.rate for p in done if p.passed(goal)), default=0.0)


def search(
    run_at: Callable[[float], RunResult],
    low: float,
    high: float,
    steps: int,
    *,
    goal: float = ATTAINMENT_GOAL,
    progress: Callable[[str], None] = print,
) -> tuple[list[RunResult], list[Probe]]:
    """Probe rates by `next_rate` with `run_at(rate)` (one run each); the runs and probes."""
    check_range(low, high, steps)
    runs: list[RunResult] = []
    probes: list[Probe] = []
    while (rate := next_rate(low, high, steps, probes, goal)) is not None:
        run = run_at(rate)
        m = run_metrics(run)
        probe = Probe(rate, m.overall.attainment, m.valid)
        runs.append(run)
        probes.append(probe)
        verdict = "meets" if probe.passed(goal) else "misses"
        progress(
            f"search step {len(probes)}/{steps}: {rate:.3g}/s, attainment "
            f"{probe.attainment * 100:.1f}%{'' if probe.valid else ' (INVALID: client behind)'}"
            f" -> {verdict} the {goal * 100:.0f}% goal; goodput so far {goodput(probes, goal):.3g}/s"
        )
    return runs, probes
