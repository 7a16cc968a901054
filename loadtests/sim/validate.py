"""Live vs simulated: the same workload's TTFT and TPOT p50 at each rate, with their ratio.

A simulated p50 within ±25% of the live one counts as agreement (the issue's target); the table
says so per rate and metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loadtests.report.metrics import run_metrics
from loadtests.report.records import RunResult

TOLERANCE = 0.25


def agreement(
    live: Sequence[RunResult], sim: Sequence[RunResult]
) -> list[tuple[float, str, float, float, bool]]:
    """(rate, metric, live p50, sim p50, within tolerance) for each live run matched by rate."""
    out = []
    for lr in live:
        match = min(sim, key=lambda s: abs(s.target_rate - lr.target_rate), default=None)
        if match is None:
            continue
        lm, sm = run_metrics(lr).overall, run_metrics(match).overall
        for name, a, b in (
            ("TTFT p50", lm.ttft.p50, sm.ttft.p50),
            ("TPOT p50", lm.tpot.p50, sm.tpot.p50),
        ):
            ok = not (math.isnan(a) or math.isnan(b)) and a > 0 and abs(b - a) / a <= TOLERANCE
            out.append((lr.target_rate, name, a, b, ok))
    return out


def validation_table(live: Sequence[RunResult], sim: Sequence[RunResult]) -> str:
    lines = [
        "| rate /s | metric | live ms | simulated ms | sim/live | within ±25% |",
        "|---|---|---|---|---|---|",
    ]
    for rate, name, a, b, ok in agreement(live, sim):
        ratio = b / a if a else math.nan
        lines.append(
            f"| {rate:.3g} | {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {ratio:.2f} | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)
