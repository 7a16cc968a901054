"""The TPOT margin an admission mode needs: the router's two admission modes (predicted-load and
current-load) compared at one offered rate in the simulator (`strata plan --admission RATE`).

Each mode runs at the simulator's default margin (`SIM_TPOT_MARGIN`) and at the smallest TPOT
margin (`AdmissionConfig.tpot_margin`, bisected on [0, MAX_MARGIN]) at which ≥ 90% of the
requests it admits meet both targets of their class. A mode whose admitted requests break their
SLOs has not refused enough, so the fair comparison is at the margin each needs: a mode that
predicts the decode batch worse needs a wider one, and refuses more at it. The bisection takes
attainment to grow with the margin, which it does in trend, not strictly run by run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.router.core import TimeModel
from loadtests.report.metrics import ATTAINMENT_GOAL
from loadtests.report.records import RunResult
from loadtests.sim.cluster import ClusterSpec
from loadtests.sim.simulator import SIM_TPOT_MARGIN, simulate
from loadtests.workload import WorkloadSpec, generate_requests

MAX_MARGIN = 0.5
MARGIN_BISECTIONS = 7  # the margin to within 0.5 / 2^7 ≈ 0.4% of the target
ADMISSION_MODES = ("predicted", "current")


@dataclass(frozen=True, slots=True)
class AdmissionPoint:
    """One admission mode at one TPOT margin: what it refused and how its admitted requests did."""

    mode: str
    tpot_margin: float
    requests: int
    refused: int
    admitted_meeting: float  # of the requests it admitted, the fraction meeting both targets
    goodput_rps: float  # requests meeting both targets per second of run

    @property
    def holds(self) -> bool:
        return self.admitted_meeting >= ATTAINMENT_GOAL


def admission_point(run: RunResult, mode: str, tpot_margin: float) -> AdmissionPoint:
    targets = {c.name: (c.ttft_s, c.tpot_s) for c in run.classes}
    admitted = [r for r in run.records if r.status != "refused"]
    meeting = 0
    for r in admitted:
        ttft_s, tpot_s = targets[r.slo_class]
        if r.status == "ok" and r.ttft_s <= ttft_s and r.tpot_s <= tpot_s:
            meeting += 1
    return AdmissionPoint(
        mode,
        tpot_margin,
        len(run.records),
        len(run.records) - len(admitted),
        meeting / len(admitted) if admitted else 1.0,
        meeting / run.duration_s if run.duration_s > 0 else 0.0,
    )


def admission_at(
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    *,
    rate: float,
    duration_s: float,
    policy: str,
    mode: str,
    tpot_margin: float,
) -> AdmissionPoint:
    """One simulated run of `mode` at `tpot_margin` (Poisson-rate override of the workload)."""
    reqs = generate_requests(spec, rate=rate, duration_s=duration_s)
    run = simulate(
        cluster,
        spec,
        model,
        reqs,
        policy=policy,
        admission=mode,
        rate=rate,
        duration_s=duration_s,
        tpot_margin=tpot_margin,
    )
    return admission_point(run, mode, tpot_margin)


def smallest_margin(
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    *,
    rate: float,
    duration_s: float,
    policy: str,
    mode: str,
) -> AdmissionPoint:
    """The smallest TPOT margin at which `mode`'s admitted requests meet their SLOs (≥ 90%),
    bisected on [0, MAX_MARGIN]; the point at MAX_MARGIN when even that does not hold."""

    def at(margin: float) -> AdmissionPoint:
        return admission_at(
            spec,
            cluster,
            model,
            rate=rate,
            duration_s=duration_s,
            policy=policy,
            mode=mode,
            tpot_margin=margin,
        )

    low = at(0.0)
    if low.holds:
        return low
    best = at(MAX_MARGIN)
    if not best.holds:
        return best
    lo, hi = 0.0, MAX_MARGIN
    for _ in range(MARGIN_BISECTIONS):
        mid = (lo + hi) / 2
        point = at(mid)
        if point.holds:
            hi, best = mid, point
        else:
            lo = mid
    return best


def compare_admission(
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    *,
    rate: float,
    duration_s: float,
    policy: str = "strata",
) -> list[AdmissionPoint]:
    """Per mode: the point at the simulator's default margin, then at its smallest holding one."""
    out = []
    for mode in ADMISSION_MODES:
        out.append(
            admission_at(
                spec,
                cluster,
                model,
                rate=rate,
                duration_s=duration_s,
                policy=policy,
                mode=mode,
                tpot_margin=SIM_TPOT_MARGIN,
            )
        )
        out.append(
            smallest_margin(
                spec, cluster, model, rate=rate, duration_s=duration_s, policy=policy, mode=mode
            )
        )
    return out


def print_admission(points: Sequence[AdmissionPoint], rate: float) -> None:
    print(
        f"\n| mode @ {rate:g}/s | TPOT margin | refused (429) | admitted meeting both targets "
        "| goodput req/s |\n|---|---|---|---|---|"
    )
    for p in points:
        print(
            f"| {p.mode} | {p.tpot_margin:.1%} | {p.refused} of {p.requests} "
            f"({p.refused / max(p.requests, 1):.1%}) | {p.admitted_meeting:.1%} "
            f"| {p.goodput_rps:.3g} |"
        )
