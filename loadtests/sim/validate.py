"""Live vs simulated: the same workload's TTFT and TPOT p50 at each rate, with their ratio.

A simulated p50 within ±25% of the live one counts as agreement (the issue's target); the table
says so per rate and metric, marks a live run whose client fell behind, and `verdict` counts the
points. `fit_overheads` fits the two serving-path overheads to a calibration run's lowest rate
(live against simulated without overheads); `strata loadtest --validate` measures every
serving-path term instead (loadtests/live/calibrate.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.router.core import TimeModel
from loadtests.report.metrics import run_metrics
from loadtests.report.records import RunResult
from loadtests.sim.cluster import ClusterSpec
from loadtests.sim.simulator import simulate
from loadtests.workload import WorkloadSpec, generate_requests

TOLERANCE = 0.25
# the cluster's serving-path terms `strata loadtest --validate` measures (loadtests/live/calibrate.py)
SERVING_TERMS = (
    "request_overhead_s",
    "token_overhead_s",
    "handoff_s",
    "prefill_contention",
    "decode_contention",
    "prefill_jitter",
)


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
    invalid = {r.target_rate for r in live if not run_metrics(r).valid}
    lines = [
        "| rate /s | metric | live ms | simulated ms | sim/live | within ±25% |",
        "|---|---|---|---|---|---|",
    ]
    for rate, name, a, b, ok in agreement(live, sim):
        ratio = b / a if a else math.nan
        mark = " (live INVALID: client behind)" if rate in invalid else ""
        lines.append(
            f"| {rate:.3g}{mark} | {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {ratio:.2f} | "
            f"{'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)


def verdict(live: Sequence[RunResult], sim: Sequence[RunResult]) -> tuple[int, int]:
    """(points within ±25%, points compared)."""
    points = agreement(live, sim)
    return sum(1 for p in points if p[4]), len(points)


def calibration_run(live: Sequence[RunResult]) -> RunResult:
    """The run overheads are fitted to: the lowest-rate valid one (a run whose client fell behind
    its schedule, often the first after start-up, measures the client), else the lowest."""
    valid = [r for r in live if run_metrics(r).valid]
    return min(valid or live, key=lambda r: r.target_rate)


def fit_overheads(live: Sequence[RunResult], sim_at_lowest: RunResult) -> tuple[float, float]:
    """(request_overhead_s, token_overhead_s) from a live calibration's `calibration_run` and the
    same rate simulated with no overheads: the TTFT and TPOT p50 the simulation misses, at a
    load light enough that they add rather than queue (never negative)."""
    lowest = calibration_run(live)
    lm, sm = run_metrics(lowest).overall, run_metrics(sim_at_lowest).overall
    request = lm.ttft.p50 - sm.ttft.p50
    token = lm.tpot.p50 - sm.tpot.p50
    return (
        request if request > 0 and not math.isnan(request) else 0.0,
        token if token > 0 and not math.isnan(token) else 0.0,
    )


def without_overheads(cluster: ClusterSpec) -> ClusterSpec:
    return cluster.with_(request_overhead_s=0.0, token_overhead_s=0.0)


@dataclass(frozen=True, slots=True)
class CalibratedRate:
    """The serving-path terms and time model measured just before one live rate."""

    rate: float
    terms: dict[str, float | tuple[float, ...]]
    model_path: str


def _term(value: object) -> float | tuple[float, ...]:
    if isinstance(value, list):
        return tuple(float(v) for v in value)
    return float(value)  # type: ignore[arg-type]


def load_calibration(path: str | Path) -> list[CalibratedRate]:
    """The calibrations of a `calibration.json` written by `strata loadtest --validate`, one per
    live rate (ValueError naming what is wrong); model paths are relative to the file."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        out = [
            CalibratedRate(
                float(e["rate"]),
                {str(k): _term(v) for k, v in dict(e["terms"]).items()},
                str(p.parent / str(e["model"])),
            )
            for e in doc["rates"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a calibration.json ({exc!r})") from None
    if not out:
        raise ValueError(f"{path}: no calibrated rate")
    for e in out:
        unknown = sorted(set(e.terms) - set(SERVING_TERMS))
        if unknown:
            raise ValueError(f"{path}: unknown terms {unknown}")
    return out


def simulate_calibrated(
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    calibrations: Sequence[CalibratedRate],
    live: Sequence[RunResult],
    policy: str | None = None,
) -> list[RunResult]:
    """Each live run's requests (same seed, rate, duration) simulated on `cluster` with the
    terms and time model calibrated for that rate (the nearest calibrated one)."""
    runs = []
    for lr in live:
        cal = min(calibrations, key=lambda c: abs(c.rate - lr.target_rate))
        requests = generate_requests(workload, rate=lr.target_rate, duration_s=lr.duration_s)
        runs.append(
            simulate(
                cluster.with_(**cal.terms),
                workload,
                TimeModel.load(cal.model_path),
                requests,
                policy=policy or cluster.policy,
                rate=lr.target_rate,
                duration_s=lr.duration_s,
                label=f"{policy or cluster.policy} @ {lr.target_rate:.3g}/s",
            )
        )
    return runs
