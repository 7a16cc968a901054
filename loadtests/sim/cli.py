"""`strata simulate WORKLOAD.toml --cluster CLUSTER.toml --out DIR [--policies a,b] [--rates r1,r2]`

Runs the workload through the simulated cluster once per policy (and rate), every run placed by
the router's real core, and writes one report with the runs side by side (JSON of every request,
Markdown, plots). Prints the side-by-side table and each policy's ratios against the first.
`--validate LIVE.json` simulates the rates of a live report (with this cluster, typically one
built from this machine's `strata profile`) and lays live and simulated p50s side by side;
`--overheads-from CALIBRATION.json` first fits the cluster's serving-path terms to another live
run (its lowest rate), so the validation is not fitted to the runs it judges;
`--calibration CALIBRATION.json` (with `--validate`) instead simulates each live rate with the
serving-path terms and time model `strata loadtest --validate` measured just before it, which
redoes the simulated half of such a validation.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.router.core import TimeModel
from loadtests.report.compare import side_by_side
from loadtests.report.files import ReportError, load_runs, write_report
from loadtests.report.metrics import run_metrics
from loadtests.report.records import RunResult
from loadtests.sim.cluster import STORE_MODES, ClusterError, ClusterSpec, load_cluster
from loadtests.sim.simulator import SIM_POLICIES, simulate
from loadtests.sim.validate import (
    calibration_run,
    fit_overheads,
    load_calibration,
    simulate_calibrated,
    validation_table,
    verdict,
    without_overheads,
)
from loadtests.workload import WorkloadError, WorkloadSpec, generate_requests, load_workload


def parse_list(text: str, kind: type = str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of {kind.__name__}: {text!r}") from None


def run_grid(
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    policies: Sequence[str],
    rates: Sequence[float | None],
    *,
    duration_s: float | None = None,
    admission: str | None = None,
    progress: bool = False,
) -> list[RunResult]:
    runs: list[RunResult] = []
    for rate in rates:
        requests = generate_requests(workload, rate=rate, duration_s=duration_s)
        offered = rate or (len(requests) / (duration_s or workload.duration_s))
        for policy in policies:
            run = simulate(
                cluster,
                workload,
                model,
                requests,
                policy=policy,
                admission=admission,
                rate=offered,
                duration_s=duration_s,
                label=f"{policy} @ {offered:.3g}/s" + (f" [{admission}]" if admission else ""),
            )
            if progress:
                m = run_metrics(run).overall
                print(
                    f"  {run.label}: {m.requests} requests, TTFT p50 {m.ttft.p50 * 1e3:.1f} ms, "
                    f"attainment {m.attainment * 100:.1f}%",
                    flush=True,
                )
            runs.append(run)
    return runs


def ratios(runs: Sequence[RunResult]) -> list[str]:
    """Each run's mean and p99 TTFT and e2e as a ratio of the first policy's at the same rate."""
    lines = []
    by_rate: dict[float, list[RunResult]] = {}
    for r in runs:
        by_rate.setdefault(r.target_rate, []).append(r)
    for rate, group in by_rate.items():
        base = run_metrics(group[0]).overall
        for r in group[1:]:
            m = run_metrics(r).overall

            def q(a: float, b: float) -> str:
                return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"

            lines.append(
                f"- @ {rate:.3g}/s {group[0].policy} / {r.policy}: TTFT mean {q(base.ttft.mean, m.ttft.mean)}, "
                f"p99 {q(base.ttft.p99, m.ttft.p99)}; e2e mean {q(base.e2e.mean, m.e2e.mean)}, "
                f"p99 {q(base.e2e.p99, m.e2e.p99)}"
            )
    return lines


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="strata simulate", description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--policies",
        type=parse_list,
        default=None,
        help=f"comma list of {', '.join(SIM_POLICIES)} (default: the cluster's)",
    )
    ap.add_argument("--rates", type=lambda t: parse_list(t, float), default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    ap.add_argument("--admission", choices=("off", "predicted", "current"), default=None)
    ap.add_argument(
        "--store", choices=STORE_MODES, default=None, help="override the cluster's store"
    )
    ap.add_argument(
        "--time-model", default=None, help="a `strata profile` JSON instead of the cluster's"
    )
    ap.add_argument("--validate", default=None, help="a live report.json to simulate and compare")
    ap.add_argument(
        "--overheads-from",
        default=None,
        help="a live calibration report.json: fit the cluster's request and token overheads to "
        "its lowest rate first",
    )
    ap.add_argument(
        "--calibration",
        default=None,
        help="with --validate: the calibration.json of `strata loadtest --validate` (each rate "
        "simulated with the terms and time model measured before it)",
    )
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    try:
        workload = load_workload(args.workload)
        cluster = load_cluster(args.cluster)
        if args.store:
            cluster = cluster.with_(store=args.store)
        live: list[RunResult] = load_runs(args.validate) if args.validate else []
        calibration = load_runs(args.overheads_from) if args.overheads_from else []
        calibrated = load_calibration(args.calibration) if args.calibration else []
        # with --calibration each rate has its own model (this one is only the fallback's)
        model = TimeModel.load(
            args.time_model or (calibrated[0].model_path if calibrated else cluster.time_model)
        )
        if calibrated and (args.overheads_from or not live):
            raise ValueError("--calibration needs --validate and excludes --overheads-from")
    except (WorkloadError, ClusterError, ReportError, ValueError, FileNotFoundError) as exc:
        print(f"strata simulate: {exc}", file=sys.stderr)
        return 2
    policies = args.policies or [cluster.policy]
    unknown = [p for p in policies if p not in SIM_POLICIES]
    if unknown:
        print(
            f"strata simulate: unknown policies {unknown} (known: {', '.join(SIM_POLICIES)})",
            file=sys.stderr,
        )
        return 2
    if calibration:
        low = calibration_run(calibration)
        bare = without_overheads(cluster)
        (sim_low,) = run_grid(
            workload, bare, model, [policies[0]], [low.target_rate], duration_s=low.duration_s
        )
        request_s, token_s = fit_overheads(calibration, sim_low)
        cluster = cluster.with_(request_overhead_s=request_s, token_overhead_s=token_s)
        print(
            f"serving-path overheads fitted to {args.overheads_from} at {low.target_rate:g}/s "
            f"({'valid' if run_metrics(low).valid else 'INVALID: the client fell behind'}): "
            f"{request_s * 1e3:.2f} ms per request, {token_s * 1e3:.2f} ms per decode step",
            flush=True,
        )
    rates: list[float | None] = list(args.rates) if args.rates else [None]
    duration = args.duration
    if live:
        rates = [r.target_rate for r in live]
        duration = duration or live[0].duration_s
    print(
        f"simulating {workload.name} on {cluster.name} ({cluster.layout}, store {cluster.store}): "
        f"{len(policies)} policies x {len(rates)} rates",
        flush=True,
    )
    runs = (
        [r for p in policies for r in simulate_calibrated(workload, cluster, calibrated, live, p)]
        if calibrated
        else run_grid(
            workload,
            cluster,
            model,
            policies,
            rates,
            duration_s=duration,
            admission=args.admission,
            progress=True,
        )
    )
    extra = ""
    if live:
        extra = "## Live vs simulated\n\n" + validation_table(live, runs) + "\n"
    extra += "\n## Ratios against the first policy\n\n" + "\n".join(ratios(runs)) + "\n"
    paths = write_report(
        [*live, *runs],
        args.out,
        f"Simulation: {workload.name} on {cluster.name}",
        plots=not args.no_plots,
        extra_markdown=extra,
    )
    print(side_by_side(runs))
    if live:
        print(validation_table(live, runs))
        within, points = verdict(live, runs)
        print(f"{within} of {points} within ±25%")
    for line in ratios(runs):
        print(line)
    print(f"wrote {paths['json']} and {paths['markdown']}")
    return 0


def main_path(path: Path) -> int:  # pragma: no cover - convenience for python -m
    return main([str(path)])
