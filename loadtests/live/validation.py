"""`strata loadtest WORKLOAD --up --rates a,b,c --validate CLUSTER.toml`: live against simulated.

One command, on one running `strata up`: `measure_now` (the serving path through the API,
loadtests/live/calibrate.py) before each rate's live run and once after the last, so every live
run is bracketed by two calibrations taken under the machine's conditions of its minutes (this
machine is shared: its speed drifts), and the live run of each rate in turn (the runner; fresh
prefixes, so each rate starts as cold as a simulation does). Then `simulate_and_report`: each
rate's terms fitted to the two calibrations around it together (the pulls from the profile
`strata up` used, `--time-model` to give another), its requests (same seed, rate and duration)
through the simulator on the cluster with those terms, and one report of
both: the calibrations, the live and simulated runs side by side, and TTFT and TPOT p50 per rate
with pass/fail (±25%, loadtests/sim/validate.py). The measurements are saved in the output
folder (`calibration.json`, `calibrated_timemodel_K.json`, `live/report.json`) before the
simulation, so `strata simulate WORKLOAD --cluster CLUSTER --calibration DIR/calibration.json
--validate DIR/live/report.json --out DIR2` redoes the simulated half alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from engine.router.core import TimeModel
from loadtests.live.calibrate import (
    Calibration,
    CalibrationError,
    Measurements,
    fit,
    measure,
    merge,
    plan_for,
)
from loadtests.live.http_user import Sent, completion_body, stream_completion
from loadtests.live.target import UpTarget
from loadtests.report.files import write_report
from loadtests.report.records import RequestRecord, RunResult
from loadtests.sim.cluster import ClusterSpec
from loadtests.workload import WorkloadSpec, generate_requests

MAX_IDLE_S = 1.5


def profile_of(args: argparse.Namespace, target: UpTarget, cluster: ClusterSpec) -> str:
    """The profile whose pulls the simulation uses: --time-model, `strata up`'s, the cluster's."""
    return str(args.time_model or target.profile or cluster.time_model)


def measure_now(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    target: UpTarget,
    cluster: ClusterSpec,
    rate: float,
) -> Measurements:
    """The serving path measured now, at the prompt lengths of `rate`'s requests."""
    duration = args.duration or spec.duration_s
    lengths = [r.prompt_tokens for r in generate_requests(spec, rate=rate, duration_s=duration)]
    # each measured request after the rate's mean gap between arrivals (capped: bounded time)
    idle = min(MAX_IDLE_S, 1.0 / rate) if rate > 0 else 0.0
    plan = plan_for(
        lengths, spec.model.vocab_size, cluster.page_tokens, spec.model.token_low, idle_s=idle
    )
    print(
        f"calibrating the serving path at {target.base_url} (prompts of "
        f"{', '.join(map(str, plan.prompt_lengths))} tokens, {idle:.2g} s idle before each)",
        flush=True,
    )
    http = httpx.Client(limits=httpx.Limits(max_connections=64))
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def send(
        prompt: list[int], max_tokens: int, on_first_token: Callable[[], None] | None = None
    ) -> RequestRecord:
        t = now()
        return stream_completion(
            http,
            target.base_url,
            completion_body(target.model, prompt, max_tokens),
            Sent("calibration", "", t, t, len(prompt), max_tokens),
            now,
            timeout_s=args.request_timeout,
            on_first_token=on_first_token,
        )

    try:
        measured = measure(send, plan, lambda line: print(f"  {line}", flush=True))
    finally:
        http.close()
    print(
        f"  measured in {now():.1f} s (load average {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return measured


def fit_bracket(
    before: Measurements, after: Measurements, profile_path: str, cluster: ClusterSpec
) -> Calibration:
    """The terms of the live run between two calibrations, fitted to both together."""
    try:
        profile = TimeModel.load(Path(profile_path).expanduser())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot read the profile {profile_path}: {exc}") from exc
    return fit(
        merge(before, after),
        profile,
        page_tokens=cluster.page_tokens,
        page_bytes=cluster.page_bytes,
        note=f"measured by strata loadtest --validate before and after a live run; pulls from "
        f"{profile_path}",
    )


def save_calibrations(cals: Sequence[tuple[float, Calibration]], out: Path) -> Path:
    """`calibration.json` (and one time model file per rate) in `out`; its path."""
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for k, (rate, cal) in enumerate(cals, 1):
        name = f"calibrated_timemodel_{k}.json"
        cal.model.save(out / name)
        entries.append(
            {
                "rate": rate,
                "terms": cal.terms(),
                "model": name,
                "requests": cal.requests,
                "summary": cal.summary(),
            }
        )
    path = out / "calibration.json"
    path.write_text(json.dumps({"rates": entries}, indent=2) + "\n")
    return path


def simulate_and_report(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    profile_path: str,
    measured: Sequence[Measurements],
    live: Sequence[RunResult],
) -> int:
    """Fit each live run's terms to the calibrations before and after it, simulate, report."""
    from loadtests.report.compare import side_by_side
    from loadtests.sim.validate import (
        load_calibration,
        simulate_calibrated,
        validation_table,
        verdict,
    )

    out = Path(args.out)
    write_report(live, out / "live", f"Live: {spec.name}", plots=False)
    if len(measured) != len(live) + 1:
        raise CalibrationError(f"{len(live)} live runs need {len(live) + 1} calibrations")
    cals = [
        (run.target_rate, fit_bracket(measured[k], measured[k + 1], profile_path, cluster))
        for k, run in enumerate(live)
    ]
    for rate, cal in cals:
        print(f"  terms for {rate:g}/s: {cal.summary()}", flush=True)
    saved = save_calibrations(cals, out)
    print(
        f"simulating the same requests on {cluster.name} ({cluster.layout}) with the measured "
        "terms",
        flush=True,
    )
    sims = simulate_calibrated(spec, cluster, load_calibration(saved), live)
    table = validation_table(live, sims)
    within, points = verdict(live, sims)
    lines = [
        "| before rate /s | "
        + " | ".join(f"`{k}`" for k in cals[0][1].terms())
        + " | time model |",
        "|---|" + "---|" * (len(cals[0][1].terms()) + 1),
    ]
    for rate, cal in cals:
        lines.append(
            f"| {rate:g} | "
            + " | ".join(
                f"{v:.4g}" if isinstance(v, float) else cal.jitter_summary()
                for v in cal.terms().values()
            )
            + f" | {cal.model_summary()} |"
        )
    extra = (
        "## Serving-path calibration (measured before and after each live rate)\n\n"
        f"Pulls from {profile_path}.\n\n" + "\n".join(lines) + "\n\n"
        "## Live vs simulated\n\n"
        f"{table}\n\n**{within} of {points} within ±25%**\n"
    )
    paths = write_report(
        [*live, *sims],
        out,
        f"Validation: {spec.name} live and simulated on {cluster.name}",
        plots=not args.no_plots,
        extra_markdown=extra,
    )
    print(side_by_side([*live, *sims]))
    print(table)
    print(f"{within} of {points} within ±25%", flush=True)
    print(f"wrote {paths['json']} and {paths['markdown']}", flush=True)
    return 0
