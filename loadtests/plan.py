"""`strata plan WORKLOAD.toml --gpus N [--cluster BASE.toml]`: the deployment with the highest
goodput per GPU under the workload's SLOs, found in the simulator (DistServe's placement search).

Options: every prefill:decode split xPyD with x + y engines on the N GPUs, and co-location with
each chunk size in `--chunks` (0 = no chunked prefill). Each option's goodput is the highest
Poisson rate at which ≥ 90% of requests meet both targets of their class: doubled from a low
start until it fails, then bisected. The base cluster gives the time model, page geometry,
pools and store; the ranking prints each option's goodput and goodput per GPU.

`strata plan WORKLOAD.toml --cluster CLUSTER.toml --admission RATE` instead compares the router's
admission modes at one offered rate, each at the TPOT margin it needs (loadtests/margins.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.router.core import TimeModel
from loadtests.margins import compare_admission, print_admission
from loadtests.report.metrics import ATTAINMENT_GOAL, run_metrics
from loadtests.sim.cluster import ClusterError, ClusterSpec, load_cluster
from loadtests.sim.simulator import simulate
from loadtests.workload import WorkloadError, WorkloadSpec, generate_requests, load_workload

DEFAULT_CLUSTER = Path(__file__).resolve().parent / "clusters" / "opt13b_2p1d.toml"
DOUBLINGS = 12
BISECTIONS = 6


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    cluster: ClusterSpec


@dataclass(frozen=True, slots=True)
class Ranked:
    option: Option
    goodput_rps: float
    gpus: int
    runs: int

    @property
    def per_gpu(self) -> float:
        return self.goodput_rps / self.gpus if self.gpus else 0.0


def options(base: ClusterSpec, gpus: int, chunks: Sequence[int]) -> list[Option]:
    engines = gpus // base.gpus_per_engine
    if engines < 1:
        raise ClusterError(f"{gpus} GPUs hold no engine of {base.gpus_per_engine} GPUs")
    out = []
    for chunk in chunks:
        label = f"{engines} co-located" + (f", chunked prefill {chunk}" if chunk else "")
        out.append(
            Option(label, base.with_(colocated=engines, prefill=0, decode=0, chunk_tokens=chunk))
        )
    for x in range(1, engines):
        store = base.store if base.store != "per_engine" else "none"
        out.append(
            Option(
                f"{x}P{engines - x}D",
                base.with_(colocated=0, prefill=x, decode=engines - x, store=store),
            )
        )
    return out


def attains(
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    rate: float,
    duration_s: float,
    policy: str,
) -> bool:
    reqs = generate_requests(spec, rate=rate, duration_s=duration_s)
    run = simulate(cluster, spec, model, reqs, policy=policy, rate=rate, duration_s=duration_s)
    return run_metrics(run).overall.attainment >= ATTAINMENT_GOAL


def goodput(
    spec: WorkloadSpec,
    cluster: ClusterSpec,
    model: TimeModel,
    *,
    duration_s: float,
    policy: str,
    start: float,
) -> tuple[float, int]:
    """(highest attaining rate, simulations run), by doubling then bisection (bounded)."""
    runs = 0
    lo, hi = 0.0, start
    for _ in range(DOUBLINGS):
        runs += 1
        if not attains(spec, cluster, model, hi, duration_s, policy):
            break
        lo, hi = hi, hi * 2
    else:
        return lo, runs
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        runs += 1
        if attains(spec, cluster, model, mid, duration_s, policy):
            lo = mid
        else:
            hi = mid
    return lo, runs


def plan(
    spec: WorkloadSpec,
    base: ClusterSpec,
    model: TimeModel,
    gpus: int,
    *,
    chunks: Sequence[int] = (0, 512, 2048),
    duration_s: float = 30.0,
    policy: str = "strata",
    progress: bool = False,
) -> list[Ranked]:
    ranked = []
    for opt in options(base, gpus, chunks):
        rate, runs = goodput(
            spec,
            opt.cluster,
            model,
            duration_s=duration_s,
            policy=policy,
            start=0.25 * opt.cluster.engines,
        )
        ranked.append(Ranked(opt, rate, opt.cluster.gpus, runs))
        if progress:
            print(
                f"  {opt.name}: goodput {rate:.3g} req/s ({rate / opt.cluster.gpus:.3g} per GPU, {runs} runs)",
                flush=True,
            )
    return sorted(ranked, key=lambda r: (-r.per_gpu, r.option.name))


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="strata plan",
        description="In the simulator: the deployments of N GPUs ranked by goodput per GPU "
        "(--gpus), or the admission modes compared at one rate (--admission).",
    )
    ap.add_argument("workload")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to plan a deployment for")
    ap.add_argument(
        "--admission",
        type=float,
        default=None,
        metavar="RATE",
        help="compare the admission modes at this rate on --cluster (instead of --gpus)",
    )
    ap.add_argument(
        "--cluster", default=str(DEFAULT_CLUSTER), help="base cluster (time model, pools, store)"
    )
    ap.add_argument(
        "--chunks", default="0,512,2048", help="co-located chunk sizes to try (0 = none)"
    )
    ap.add_argument(
        "--duration", type=float, default=30.0, help="simulated seconds of arrivals per trial"
    )
    ap.add_argument("--policy", default="strata")
    ap.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    ap.add_argument("--json", default=None, help="also write the ranking here")
    args = ap.parse_args(argv)
    try:
        spec = load_workload(args.workload)
        if args.seed is not None:
            spec = dataclasses.replace(spec, seed=args.seed)
        base = load_cluster(args.cluster)
        model = TimeModel.load(base.time_model)
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
        if (args.gpus is None) == (args.admission is None):
            raise ValueError("give --gpus N (deployments) or --admission RATE (admission modes)")
        if args.admission is not None and not args.admission > 0:
            raise ValueError("--admission RATE must be > 0")
        if args.gpus is not None and not 2 <= args.gpus <= 64 * base.gpus_per_engine:
            raise ClusterError(f"--gpus must be 2..{64 * base.gpus_per_engine}")
    except (WorkloadError, ClusterError, ValueError, FileNotFoundError) as exc:
        print(f"strata plan: {exc}", file=sys.stderr)
        return 2
    if args.admission is not None:
        print(
            f"admission modes on {spec.name} at {args.admission:g}/s, {base.name} "
            f"({base.layout}), {args.duration:g} s of arrivals, policy {args.policy}:",
            flush=True,
        )
        points = compare_admission(
            spec, base, model, rate=args.admission, duration_s=args.duration, policy=args.policy
        )
        print_admission(points, args.admission)
        if args.json:
            Path(args.json).write_text(
                json.dumps([{f: getattr(p, f) for f in p.__slots__} for p in points], indent=2)
            )
        return 0
    print(
        f"planning {spec.name} on {args.gpus} GPUs ({base.name} time model, policy {args.policy}):",
        flush=True,
    )
    ranked = plan(
        spec,
        base,
        model,
        args.gpus,
        chunks=chunks,
        duration_s=args.duration,
        policy=args.policy,
        progress=True,
    )
    print("\n| rank | deployment | goodput req/s | per GPU | vs best |\n|---|---|---|---|---|")
    best = ranked[0].per_gpu if ranked else 0.0
    for i, r in enumerate(ranked, 1):
        rel = r.per_gpu / best if best else 0.0
        print(f"| {i} | {r.option.name} | {r.goodput_rps:.3g} | {r.per_gpu:.3g} | {rel:.2f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "deployment": r.option.name,
                        "goodput_rps": r.goodput_rps,
                        "per_gpu": r.per_gpu,
                        "gpus": r.gpus,
                    }
                    for r in ranked
                ],
                indent=2,
            )
        )
    return 0
