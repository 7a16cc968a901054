"""`strata loadtest WORKLOAD --up --rates a,b,c --validate CLUSTER.toml`: live against simulated.

One command, in this order on one running `strata up`:
1. `calibrate`: the serving path measured through the API (loadtests/live/calibrate.py), just
   before the live runs and under the machine's conditions of the moment; the pulls come from
   the profile `strata up` used (`--time-model` to give another);
2. the live runs at each rate (the runner; fresh prefixes, so each rate starts as cold as a
   simulation does);
3. `simulate_and_report`: the same requests (same seed, rates and duration) through the
   simulator on the cluster with the measured terms, and one report of both: the calibration,
   the live and simulated runs side by side, and TTFT and TPOT p50 per rate with pass/fail
   (±25%, loadtests/sim/validate.py).
The measured time model and terms are saved in the output folder as soon as they are measured
(`calibrated_timemodel.json`, `calibration.json`) and the live runs before the simulation
(`live/report.json`), so `strata simulate WORKLOAD --cluster CLUSTER --time-model
DIR/calibrated_timemodel.json --calibration DIR/calibration.json --validate DIR/live/report.json`
redoes the simulated half alone.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from engine.router.core import TimeModel
from loadtests.live.calibrate import Calibration, CalibrationError, fit, measure, plan_for
from loadtests.live.http_user import Sent, completion_body, stream_completion
from loadtests.live.target import UpTarget
from loadtests.report.files import write_report
from loadtests.report.records import RequestRecord, RunResult
from loadtests.sim.cluster import ClusterSpec
from loadtests.workload import WorkloadSpec, generate_requests


def calibrate(
    args: argparse.Namespace, spec: WorkloadSpec, target: UpTarget, cluster: ClusterSpec
) -> Calibration:
    profile_path = args.time_model or target.profile or cluster.time_model
    try:
        profile = TimeModel.load(Path(profile_path).expanduser())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot read the profile {profile_path}: {exc}") from exc
    rates = [float(r) for r in args.rates.split(",")]
    duration = args.duration or spec.duration_s
    lengths = [
        r.prompt_tokens
        for rate in rates
        for r in generate_requests(spec, rate=rate, duration_s=duration)
    ]
    plan = plan_for(lengths, spec.model.vocab_size, cluster.page_tokens, spec.model.token_low)
    print(
        f"calibrating the serving path at {target.base_url} (prompts of "
        f"{', '.join(map(str, plan.prompt_lengths))} tokens; pulls from {profile_path})",
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
    cal = fit(
        measured,
        profile,
        page_tokens=cluster.page_tokens,
        page_bytes=cluster.page_bytes,
        note=f"measured through {target.base_url} by strata loadtest --validate; pulls from "
        f"{profile_path}",
    )
    print(f"  calibrated in {now():.1f} s: {cal.summary()}", flush=True)
    save_calibration(cal, Path(args.out))
    return cal


def save_calibration(cal: Calibration, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cal.model.save(out / "calibrated_timemodel.json")
    (out / "calibration.json").write_text(
        json.dumps(
            {"terms": cal.terms(), "requests": cal.requests, "summary": cal.summary()}, indent=2
        )
        + "\n"
    )


def simulate_and_report(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    cal: Calibration,
    live: Sequence[RunResult],
) -> int:
    from loadtests.report.compare import side_by_side
    from loadtests.sim.cli import run_grid
    from loadtests.sim.validate import validation_table, verdict

    out = Path(args.out)
    write_report(live, out / "live", f"Live: {spec.name}", plots=False)
    measured = cluster.with_(**cal.terms())  # type: ignore[arg-type]
    print(
        f"simulating the same requests on {cluster.name} ({cluster.layout}) with the measured "
        "terms",
        flush=True,
    )
    sims = run_grid(
        spec,
        measured,
        cal.model,
        [cluster.policy],
        [r.target_rate for r in live],
        duration_s=live[0].duration_s if live else None,
        progress=True,
    )
    table = validation_table(live, sims)
    within, points = verdict(live, sims)
    terms = "\n".join(f"- `{k}` = {v:.4g}" for k, v in cal.terms().items())
    extra = (
        "## Serving-path calibration (measured before the live runs)\n\n"
        f"{cal.summary()}\n\n{terms}\n\n"
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
