"""`strata bench router`: what the router costs and what its placement buys, in one run.

A store daemon, `--prefill` prefill and `--decode` decode workers on the `small` preset
(`--preset tiny` for a quick run) and a router, all child processes on loopback
(`loadtests.router_cluster`), then:

1. decisions per second of the `strata` policy alone for 16 synthetic workers (the pure core,
   no I/O; `loadtests.router_decisions`), and of a whole `RouterCore.decide`;
2. a time model, which the router is restarted with: `strata profile`'s (reused from the cache
   folder when this machine and checkpoint already have one, as `strata up` does), or one
   measured on the running workers' own timings (`--profile-source workers`,
   `loadtests.router_calibrate`), or `--profile PATH`;
3. the router's added latency (`loadtests.router_latency`): the same request (greedy,
   `--latency-tokens` output tokens, its prefix already in the store) through the router's HTTP
   API (a text prompt, with httpx and with a raw HTTP/1.1 client) and straight to the workers'
   gRPC services (Prefill, then Decode, with the same token ids), `--reps` interleaved rounds.
   The router of these rounds runs over the first prefill and decode worker (as `strata up`
   starts one; `--latency-workers all`: over every worker), so both sides run on the same two
   workers: over 2 + 2 workers on a 2-core machine the router spreads the rounds and which
   worker ran the request before weighs more on a request than the router does.
   Non-streamed: the whole response; streamed: TTFT, to the first SSE token through the router vs
   the Prefill answer direct. Reported as p50s and as the median of the paired per-round
   differences (and TTFT ratios) with 95% bootstrap intervals, and the router's CPU per request;
4. TTFT of `strata` vs `round_robin` vs `least_load` on a shared-prefix workload at a fixed rate
   (`loadtests/workloads/router_bench.toml` through the workload loader, or `--workload`): the
   router restarted with each policy, the same requests sent open loop (each at its arrival
   time, TTFT counted from that time), streamed. Each policy's run has its own first token, so
   its prefixes are cold in the store when it starts, as the others' were;
5. the TTFT prediction error during the `strata` run: (predicted - observed) / observed per
   request, predicted from the response's `x-strata-predicted-ttft-ms` header and observed as
   the client saw it; its median, and the router's own median from /metrics.

Prints a table with the ratios and targets; `--json PATH` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import httpx

from engine.router.core.fit import fit_quality
from engine.router.core.timemodel import TimeModel
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import WorkerStub
from loadtests import router_decisions, router_latency
from loadtests.router_calibrate import calibrate
from loadtests.router_cluster import ClusterSpec, RouterCluster
from loadtests.workload import generate_requests, load_workload, request_token_ids

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "router_bench.toml"
POLICIES = ("strata", "round_robin", "least_load")
TARGET_ADDED_MS = 2.0
TARGET_STREAM_RATIO = 1.1
TARGET_DECISIONS = 2000.0
TARGET_PREDICTION = 0.2
ADMISSION = """
[admission]
default_class = "bench"
[[admission.classes]]
name = "bench"
"""  # no targets: nothing is refused, so every policy serves every request


@dataclass(frozen=True, slots=True)
class Options:
    preset: str = "small"
    prefill: int = 2
    decode: int = 2
    reps: int = 100
    latency_prompt: int = 256
    latency_tokens: int = 2
    rate: float | None = None
    duration_s: float | None = None
    max_tokens: int = 16
    policies: tuple[str, ...] = POLICIES
    workload: Path = WORKLOAD
    decision_workers: int = 16
    decision_seconds: float = 2.0
    profile: Path | None = None
    drop_after_s: float = 3.0  # see --drop-after
    profile_source: str = "strata"  # strata (strata profile) | workers (router_calibrate)
    model: Path | None = None
    json_path: Path | None = None
    # the router of the added-latency rounds: over one prefill and one decode worker ("pair", as
    # strata up starts it), or over all of them ("all")
    latency_workers: str = "pair"


@dataclass(frozen=True, slots=True)
class Dist:
    """Latency samples in ms: p50/p90/p99 (nearest rank) and mean."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Dist:
        if not seconds:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        ms = sorted(s * 1e3 for s in seconds)

        def rank(q: float) -> float:
            return ms[max(0, math.ceil(q * len(ms)) - 1)]

        return cls(len(ms), statistics.median(ms), rank(0.9), rank(0.99), statistics.fmean(ms))


@dataclass(frozen=True, slots=True)
class PolicyRun:
    policy: str
    ttft: Dist
    requests: int
    ok: int
    failed: int
    prediction_errors: tuple[float, ...] = ()
    router_median_error: float | None = None
    placements: dict[str, int] = field(default_factory=dict)  # prefill worker -> requests
    failures: dict[str, int] = field(default_factory=dict)  # why -> requests


def progress(message: str) -> None:
    print(f"[bench router] {message}", file=sys.stderr, flush=True)


# ---- 4./5. policies on the shared-prefix workload -------------------------------------------


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, object], due: float, t0: float
) -> tuple[float | None, float | None, str, str]:
    """(TTFT from the due time, TTFT from the actual send, predicted TTFT s, prefill worker)."""
    await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return None, None, "", f"HTTP {r.status_code}: {text[:120]}"
            predicted = r.headers.get("x-strata-predicted-ttft-ms", "")
            worker = r.headers.get("x-strata-prefill", "")
            first = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
            if first is None:
                return None, None, predicted, worker
            return first - (t0 + due), first - sent, predicted, worker
    except httpx.HTTPError as exc:
        return None, None, "", f"error {type(exc).__name__}"


def run_policy(
    cluster: RouterCluster, policy: str, salt: int, model: str, opts: Options
) -> PolicyRun:
    spec = load_workload(opts.workload)
    requests = generate_requests(spec, rate=opts.rate, duration_s=opts.duration_s)
    cluster.start_router(policy)
    url = f"{cluster.base_url}/v1/completions"
    bodies = [
        {
            "model": model,
            "prompt": [3 + salt, *request_token_ids(r, spec.model)],
            "max_tokens": min(r.max_tokens, opts.max_tokens),
            "ignore_eos": True,
            "stream": True,
        }
        for r in requests
    ]

    async def drive() -> list[tuple[float | None, float | None, str, str]]:
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            t0 = time.perf_counter() + 0.2
            return await asyncio.gather(
                *(
                    _one(client, url, b, r.arrival_s, t0)
                    for b, r in zip(bodies, requests, strict=True)
                )
            )

    results = asyncio.run(drive())
    ttfts = [r[0] for r in results if r[0] is not None]
    errors: list[float] = []
    placements: dict[str, int] = {}
    failures: dict[str, int] = {}
    for ttft, observed, predicted, worker in results:
        into = placements if ttft is not None else failures
        into[worker] = into.get(worker, 0) + 1
        if observed and predicted:
            errors.append((float(predicted) / 1e3 - observed) / observed)
    tracker = _router_median_error(cluster)
    return PolicyRun(policy, Dist.of(ttfts), len(results), len(ttfts), len(results) - len(ttfts),
                     tuple(errors), tracker, placements, failures)  # fmt: skip


def _router_median_error(cluster: RouterCluster) -> float | None:
    for line in cluster.metrics_text().splitlines():
        if line.startswith('strata_router_prediction_median_relative_error{kind="ttft"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


# ---- the run ----------------------------------------------------------------------------


def _describe(address: str) -> pb.WorkerDescription:
    with grpc.insecure_channel(address) as ch:
        d: pb.WorkerDescription = WorkerStub(ch).Describe(pb.DescribeRequest(), timeout=30)
        return d


def run(opts: Options, workdir: Path) -> dict[str, object]:
    progress(f"decisions/s of the pure core, {opts.decision_workers} synthetic workers")
    alone, full = router_decisions.measure(
        workers=opts.decision_workers, min_seconds=opts.decision_seconds
    )
    colo_alone, _ = router_decisions.measure(
        workers=opts.decision_workers, min_seconds=opts.decision_seconds / 2, colocated=True
    )
    spec = ClusterSpec(
        preset=opts.preset, prefill=opts.prefill, decode=opts.decode, model=opts.model,
        profile=opts.profile, router_config=ADMISSION, drop_after_s=opts.drop_after_s,
    )  # fmt: skip
    progress(
        f"starting store, {opts.prefill} prefill + {opts.decode} decode ({opts.preset}), router"
    )
    with RouterCluster(spec, workdir) as cluster:
        desc = _describe(cluster.by_role("prefill")[0].address)
        model, vocab = desc.model_id, desc.vocab_size
        if opts.profile is None and opts.profile_source == "strata":
            from engine.profile import load_or_profile

            progress("time model: strata profile (reused when this machine has one)")
            assert cluster.store is not None
            # A fresh measurement each run (a file in the work folder, not the cache), so the
            # model matches the machine as it is now, load included.
            tm = load_or_profile(
                cluster.model_path, store=cluster.store.address, progress=progress,
                path=cluster.workdir / "strata-profile.json",
            )  # fmt: skip
            tm.save(cluster.profile_path)
            profile_source = f"strata profile (quick grid): {tm.provenance.note}"
        elif opts.profile is None:
            progress("measuring a time model on the workers")
            tm = calibrate(
                cluster.by_role("prefill")[0].address, cluster.by_role("decode")[0].address,
                vocab_size=vocab, page_tokens=desc.page_tokens,
                page_bytes=desc.page_payload_bytes,
            )  # fmt: skip
            tm.save(cluster.profile_path)
            profile_source = "measured in this run (loadtests/router_calibrate.py)"
        else:
            tm = TimeModel.load(opts.profile)
            profile_source = str(opts.profile)
        quality = fit_quality(tm)
        progress(f"router added latency (router vs direct gRPC, {opts.reps} rounds)")
        pair = [cluster.by_role("prefill")[0], cluster.by_role("decode")[0]]
        cluster.start_router("strata", workers=pair if opts.latency_workers == "pair" else None)
        assert cluster.router is not None
        endpoints = router_latency.Endpoints(
            cluster.base_url, cluster.by_role("prefill")[0].address,
            cluster.by_role("decode")[0].address, model, cluster.model_path, cluster.router.pid,
        )  # fmt: skip
        added = router_latency.measure(
            endpoints, reps=opts.reps, prompt_tokens=opts.latency_prompt,
            tokens=opts.latency_tokens,
        )  # fmt: skip
        added["router_workers"] = (
            "1 prefill + 1 decode (strata up's)" if opts.latency_workers == "pair"
            else f"all: {opts.prefill} prefill + {opts.decode} decode"
        )  # fmt: skip
        runs: list[PolicyRun] = []
        for salt, policy in enumerate(opts.policies):
            progress(f"policy {policy} on {opts.workload.name}")
            runs.append(run_policy(cluster, policy, salt, model, opts))
    spec_w = load_workload(opts.workload)
    baseline = next((r for r in runs if r.policy == "round_robin"), runs[0] if runs else None)
    strata = next((r for r in runs if r.policy == "strata"), None)
    pred = (
        statistics.median(strata.prediction_errors) if strata and strata.prediction_errors else None
    )
    by_client = added["added"]
    assert isinstance(by_client, dict)
    return {
        "config": {
            "preset": opts.preset,
            "prefill": opts.prefill,
            "decode": opts.decode,
            "reps": opts.reps,
            "max_tokens": opts.max_tokens,
            "drop_after_s": opts.drop_after_s,
            "latency_workers": opts.latency_workers,
        },
        "profile": {
            "source": profile_source,
            "prefill": asdict(tm.prefill),
            "decode": asdict(tm.decode),
            "pulls": [asdict(p) for p in tm.pulls],
            "fit_quality": asdict(quality),
        },
        "decisions": {
            "workers": opts.decision_workers,
            "policy_alone_per_s": alone.per_s,
            "policy_alone_per_cpu_s": alone.per_cpu_s,  # per CPU second of this process
            "policy_alone_cpu_us": alone.cpu_us,
            "policy_alone_candidates": alone.candidates_per_decision,
            "core_decide_per_s": full.per_s,
            "core_decide_per_cpu_s": full.per_cpu_s,
            "colocated_policy_alone_per_s": colo_alone.per_s,
            "colocated_policy_alone_per_cpu_s": colo_alone.per_cpu_s,
            "what": "strata policy on synthetic views; RouterCore.decide adds ledger + admission",
        },
        "added_latency": added,
        "workload": {
            "source": "workload loader (loadtests.workload)",
            "path": str(opts.workload),
            "name": spec_w.name,
            "rate": opts.rate or spec_w.arrival.rate,
            "duration_s": opts.duration_s or spec_w.duration_s,
        },
        "policies": {
            r.policy: {
                "ttft": asdict(r.ttft),
                "requests": r.requests,
                "ok": r.ok,
                "failed": r.failed,
                "placements": r.placements,
                "failures": r.failures,
                "ttft_p50_vs_round_robin": (
                    r.ttft.p50_ms / baseline.ttft.p50_ms if baseline else None
                ),
                "ttft_p90_vs_round_robin": (
                    r.ttft.p90_ms / baseline.ttft.p90_ms if baseline else None
                ),
            }
            for r in runs
        },
        "prediction": {
            "ttft_median_relative_error": pred,
            "router_tracker_median": strata.router_median_error if strata else None,
            "samples": len(strata.prediction_errors) if strata else 0,
            "definition": "(predicted - observed) / observed; observed TTFT at the client",
        },
        "targets": {
            **_latency_targets(by_client),
            "decisions_per_s": {
                "value": alone.per_s,
                "target": TARGET_DECISIONS,
                "met": alone.per_s >= TARGET_DECISIONS,
            },
            "prediction_median_abs": {
                "value": pred,
                "target": TARGET_PREDICTION,
                "met": pred is not None and abs(pred) <= TARGET_PREDICTION,
            },
        },
    }


# the added-latency targets, judged on the median of the paired differences (ratios), per client
LATENCY_TARGETS = {
    "": "router_httpx",  # the OpenAI SDK's HTTP client: what its users pay
    "_raw": "router_raw",  # without an HTTP client library's own work
}


def _latency_targets(by_client: dict[str, dict[str, dict[str, float]]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for suffix, client in LATENCY_TARGETS.items():
        full = by_client[client]["non_streamed_ms"]
        ratio = by_client[client]["streamed_ttft_ratio"]
        out[f"added_p50_ms_non_streamed{suffix}"] = {
            "value": full["median"],
            "interval": [full["low"], full["high"]],
            "client": client,
            "target": TARGET_ADDED_MS,
            "met": full["median"] <= TARGET_ADDED_MS,
        }
        out[f"ttft_ratio_streamed{suffix}"] = {
            "value": ratio["median"],
            "interval": [ratio["low"], ratio["high"]],
            "client": client,
            "target": TARGET_STREAM_RATIO,
            "met": ratio["median"] <= TARGET_STREAM_RATIO,
        }
    return out


def print_latency(add: dict[str, object], tgt: dict[str, object]) -> None:
    """The added-latency tables: each path's p50s and what it leaves out, then the paired
    differences with their intervals and the targets."""
    paths, added = add["paths"], add["added"]
    assert isinstance(paths, dict) and isinstance(added, dict)

    def met(key: str) -> str:
        t = tgt[key]
        assert isinstance(t, dict)
        return "met" if t["met"] else "NOT met"

    print(f"Added latency: {add['reps']} interleaved rounds, {add['prompt_tokens']}-token prompt "
          f"(in the store), {add['output_tokens']} output tokens, greedy; the router over "
          f"{add.get('router_workers', 'all workers')}\n")  # fmt: skip
    print("| path | non-streamed p50 | streamed TTFT p50 | leaves out |")
    print("|---|---|---|---|")
    for name, p in paths.items():
        print(f"| {name} | {p['full_p50_ms']:.2f} ms | {p['ttft_p50_ms']:.2f} ms "
              f"| {p['leaves_out']} |")  # fmt: skip
    print("\n| router - direct, paired per round: median [95% CI] | non-streamed | streamed TTFT "
          "| TTFT ratio | targets |")  # fmt: skip
    print("|---|---|---|---|---|")
    for suffix, client in LATENCY_TARGETS.items():
        a = added[client]
        ns, st, r = a["non_streamed_ms"], a["streamed_ttft_ms"], a["streamed_ttft_ratio"]
        print(f"| {client} | {ns['median']:+.2f} ms [{ns['low']:+.2f}, {ns['high']:+.2f}] "
              f"| {st['median']:+.2f} ms [{st['low']:+.2f}, {st['high']:+.2f}] "
              f"| {r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
              f"| <= {TARGET_ADDED_MS:g} ms: {met('added_p50_ms_non_streamed' + suffix)}; "
              f"<= {TARGET_STREAM_RATIO:g}x: {met('ttft_ratio_streamed' + suffix)} |")  # fmt: skip
    cpu = add.get("router_cpu_ms_per_request")
    if isinstance(cpu, float):
        print(f"\nrouter process CPU per request (idle load polls taken out): {cpu:.2f} ms")
    load = add.get("load_average")
    if isinstance(load, dict):
        start, end = (" / ".join(f"{x:.2f}" for x in load[k]) for k in ("start", "end"))
        print(f"load average (1 / 5 / 15 min) as the rounds started: {start}; as they ended: "
              f"{end} ({add.get('rounds_s', math.nan):.0f} s of rounds)")  # fmt: skip
    print()


def print_table(result: dict[str, object]) -> None:
    cfg = result["config"]
    dec = result["decisions"]
    add = result["added_latency"]
    pol = result["policies"]
    pred = result["prediction"]
    tgt = result["targets"]
    assert isinstance(cfg, dict) and isinstance(dec, dict) and isinstance(add, dict)
    assert isinstance(pol, dict) and isinstance(pred, dict) and isinstance(tgt, dict)

    def met(key: str) -> str:
        return "met" if tgt[key]["met"] else "NOT met"

    print(f"\nstrata bench router: {cfg['preset']} preset, {cfg['prefill']} prefill + "
          f"{cfg['decode']} decode workers\n")  # fmt: skip
    print_latency(add, tgt)
    print("| decisions/s, pure core | per second | per CPU second | candidates priced | target |")
    print("|---|---|---|---|---|")
    print(f"| strata policy alone, {dec['workers']} workers (half prefill, half decode) "
          f"| {dec['policy_alone_per_s']:,.0f} | {dec['policy_alone_per_cpu_s']:,.0f} "
          f"| {dec['policy_alone_candidates']:.0f} "
          f"| >= {TARGET_DECISIONS:,.0f}: {met('decisions_per_s')} |")  # fmt: skip
    print(f"| RouterCore.decide (ledger + admission), same workers | {dec['core_decide_per_s']:,.0f} "
          f"| {dec['core_decide_per_cpu_s']:,.0f} | | |")  # fmt: skip
    print(f"| strata policy alone, {dec['workers']} co-located workers "
          f"| {dec['colocated_policy_alone_per_s']:,.0f} "
          f"| {dec['colocated_policy_alone_per_cpu_s']:,.0f} | | |\n")  # fmt: skip
    print(
        "| policy | TTFT p50 | p90 | p99 | mean | ok / sent | p50 vs round_robin | p90 vs round_robin |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in pol.items():
        t = r["ttft"]
        rel50, rel90 = r["ttft_p50_vs_round_robin"], r["ttft_p90_vs_round_robin"]
        print(f"| {name} | {t['p50_ms']:.1f} ms | {t['p90_ms']:.1f} ms | {t['p99_ms']:.1f} ms "
              f"| {t['mean_ms']:.1f} ms | {r['ok']} / {r['requests']} "
              f"| {rel50:.3f} | {rel90:.3f} |")  # fmt: skip
    value = pred["ttft_median_relative_error"]
    router = pred["router_tracker_median"]
    print(f"\nTTFT prediction error (strata run, {pred['samples']} requests): median "
          f"{value * 100 if value is not None else math.nan:+.1f}% at the client, "
          f"{router * 100 if router is not None else math.nan:+.1f}% in the router's tracker; "
          f"target within +-{TARGET_PREDICTION * 100:.0f}%: {met('prediction_median_abs')}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench router", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", choices=("tiny", "small"))
    p.add_argument("--model", type=Path, help="a checkpoint instead of the preset")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--reps", type=int, default=100, help="added-latency rounds")
    p.add_argument("--latency-prompt", type=int, default=256)
    p.add_argument(
        "--latency-tokens",
        type=int,
        default=2,
        help="output tokens of the added-latency request (short: the decode's noise stays out)",
    )
    p.add_argument("--workload", type=Path, default=WORKLOAD, help="workload TOML")
    p.add_argument("--rate", type=float, help="requests/s (default: the workload's)")
    p.add_argument("--duration", type=float, dest="duration_s", help="seconds per policy")
    p.add_argument("--max-tokens", type=int, default=16, help="cap on output tokens")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--decision-workers", type=int, default=16)
    p.add_argument("--decision-seconds", type=float, default=2.0)
    p.add_argument("--profile", type=Path, help="time model JSON (default: measure one)")
    p.add_argument(
        "--profile-source",
        choices=("strata", "workers"),
        default="strata",
        help="without --profile: strata profile, as strata up does (default), or timings of the "
        "running workers over gRPC",
    )
    p.add_argument(
        "--drop-after",
        type=float,
        default=3.0,
        dest="drop_after_s",
        help="the router's silent-worker limit (default 3 s here, 1 s in strata up: on a "
        "loaded 2-core machine a busy worker's load report can be late by a second)",
    )
    p.add_argument(
        "--latency-workers",
        choices=("pair", "all"),
        default="pair",
        help="the router of the added-latency rounds: over one prefill and one decode worker, "
        "as strata up starts it (default), or over all of them (it then spreads the rounds over "
        "workers, and on a machine with fewer cores than worker threads which worker ran the "
        "request before weighs on each request's time)",
    )
    p.add_argument("--json", type=Path, dest="json_path")
    p.add_argument("--drills", action="store_true",
                   help="run the operator drills instead (see strata drill --help)")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--drills" in args:
        from loadtests.router_drills import main as drills_main

        return drills_main([a for a in args if a != "--drills"])
    ns = build_parser().parse_args(args)
    opts = Options(
        preset=ns.preset, prefill=ns.prefill, decode=ns.decode, reps=ns.reps,
        latency_prompt=ns.latency_prompt, latency_tokens=ns.latency_tokens, rate=ns.rate,
        duration_s=ns.duration_s, max_tokens=ns.max_tokens,
        policies=tuple(p for p in ns.policies.split(",") if p), workload=ns.workload,
        decision_workers=ns.decision_workers, decision_seconds=ns.decision_seconds,
        profile=ns.profile, profile_source=ns.profile_source, model=ns.model,
        drop_after_s=ns.drop_after_s,
        json_path=ns.json_path, latency_workers=ns.latency_workers,
    )  # fmt: skip
    if opts.prefill < 1 or opts.decode < 1 or opts.reps < 1:
        print("strata bench router: --prefill, --decode and --reps must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="strata-bench-router-") as tmp:
        result = run(opts, Path(tmp))
    print_table(result)
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {opts.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
