"""Decisions per second of a placement policy on synthetic workers: the router core alone, no I/O.

`strata bench router` reports two rates for a pool of N workers (16 by default: half prefill,
half decode, so the `strata` policy prices N/2 x N/2 pairs per request):

- the policy alone (`policy.place` on a snapshot): the issue's target, >= 2,000 decisions/s;
- a full `RouterCore.decide` (dispatch ledger applied, admission judged, the dispatch reserved,
  then released with `on_failed` so the ledger stays at its steady size), which is what the HTTP
  shell pays per request.

Each rate is given per wall-clock second and per CPU second of this process
(`time.process_time`): on a shared machine the first falls with the load, the second is what a
decision costs. `strata bench decisions` (`main` below) runs only this part, for several policies
side by side in alternating rounds, with ratios to `round_robin` (one pair priced, the floor of
any policy that prices its pick) and, with `--explain`, the cost of building every decision's
explanation (each candidate's predicted cost and why it lost) as the HTTP shell does.

The inputs are built once from a seeded RNG before the clock starts, so only the core is timed:
`snapshots` sets of worker views (loads drawn per worker: queued prefill tokens and requests,
running batch and context, free pages, report age) spread over `hosts` hosts, and `requests`
requests (prompt 256-4096 tokens, max tokens 16-512, a prefix hit of 0 to all of the prompt's
full pages, each page in a drawn tier on a drawn store host). Decisions cycle through both.
The time model's coefficients are explicit (a model of the `small` preset's order of
magnitude); they change which worker wins, not what a decision costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.router.core import (
    TIERS,
    Admission,
    AdmissionConfig,
    DecodeCoeffs,
    PrefillCoeffs,
    PrefixHit,
    PullCoeffs,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
    explain,
)
from engine.router.core.policies import POLICY_NAMES

PAGE_TOKENS = 16
PAGE_BYTES = 16 * 2 * 2 * 12 * 4 * 64 * 2  # 16 tokens x K,V x 12 layers x 4 heads x 64 x fp16


def synthetic_model() -> TimeModel:
    """Explicit coefficients of a CPU-sized model (seconds); see the module doc."""
    return TimeModel(
        prefill=PrefillCoeffs(
            fixed_s=0.004, per_token_s=2.0e-5, per_cached_token_s=1.0e-7, attention_s=2.0e-9
        ),
        decode=DecodeCoeffs(fixed_s=0.01, per_request_s=5.0e-4, per_context_token_s=2.0e-7),
        pulls=(
            PullCoeffs("gpu", True, 1.0e-4, 1.0e-10),
            PullCoeffs("dram", True, 2.0e-4, 2.0e-10),
            PullCoeffs("dram", False, 1.0e-3, 1.0e-9),
            PullCoeffs("ssd", True, 5.0e-4, 5.0e-10),
            PullCoeffs("ssd", False, 1.5e-3, 1.5e-9),
        ),
    )


def synthetic_workers(
    rng: random.Random, workers: int, hosts: int, *, colocated: bool = False
) -> tuple[WorkerView, ...]:
    """`workers` views: all co-located, or the first half prefill and the rest decode."""
    out: list[WorkerView] = []
    for i in range(workers):
        split = Role.prefill if i < workers // 2 else Role.decode
        role = Role.colocated if colocated else split
        queued = rng.randint(0, 6)
        running = rng.randint(0, 48) if role is not Role.prefill else 0
        out.append(
            WorkerView(
                worker_id=f"10.0.{i % hosts}.{i}:9{i:03d}",
                role=role,
                host_id=f"host{i % hosts}",
                model="small",
                page_tokens=PAGE_TOKENS,
                queued_prefill_tokens=queued * rng.randint(128, 2048),
                queued_requests=queued,
                running_requests=running,
                running_context_tokens=running * rng.randint(256, 4096),
                free_pages=rng.randint(0, 8192),
                max_batch=64,
                report_age_s=rng.uniform(0.0, 0.5),
                running_remaining_tokens=tuple(rng.randint(1, 512) for _ in range(running)),
            )
        )
    return tuple(out)


def synthetic_requests(rng: random.Random, count: int, hosts: int) -> tuple[RequestView, ...]:
    out: list[RequestView] = []
    for i in range(count):
        prompt = rng.randint(256, 4096)
        hit = rng.randint(0, prompt // PAGE_TOKENS)
        prefix = PrefixHit(
            hit,
            tuple(rng.choice(TIERS) for _ in range(hit)),
            tuple(f"host{rng.randrange(hosts)}" for _ in range(hit)),
        )
        out.append(
            RequestView(
                request_id=f"r{i}",
                prompt_tokens=prompt,
                max_tokens=rng.randint(16, 512),
                slo_class="standard",
                prefix=prefix,
                page_tokens=PAGE_TOKENS,
                page_bytes=PAGE_BYTES,
                model="small",
            )
        )
    return tuple(out)


@functools.lru_cache(maxsize=8)
def synthetic_inputs(
    workers: int, hosts: int, colocated: bool, snapshots: int, requests: int, seed: int
) -> tuple[TimeModel, tuple[tuple[WorkerView, ...], ...], tuple[RequestView, ...]]:
    """The time model, `snapshots` worker snapshots and `requests` requests of a run, from
    `seed` (all frozen, so runs with the same arguments share them)."""
    rng = random.Random(seed)
    views = tuple(
        synthetic_workers(rng, workers, hosts, colocated=colocated) for _ in range(snapshots)
    )
    return synthetic_model(), views, synthetic_requests(rng, requests, hosts)


@dataclass(frozen=True, slots=True)
class DecisionRate:
    """`decisions` made in `seconds` of wall time and `cpu_seconds` of this process's CPU time,
    and how many pairs each priced (candidates)."""

    name: str
    workers: int
    decisions: int
    seconds: float
    candidates_per_decision: float
    cpu_seconds: float = 0.0

    @property
    def per_s(self) -> float:
        return self.decisions / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_cpu_s(self) -> float:
        return self.decisions / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        """CPU microseconds per decision."""
        return 1e6 * self.cpu_seconds / self.decisions if self.decisions else 0.0


MODES = ("alone", "explain", "decide")


def measure_one(
    *,
    policy: str = "strata",
    mode: str = "alone",
    workers: int = 16,
    hosts: int = 4,
    colocated: bool = False,
    min_seconds: float = 1.0,
    max_decisions: int = 1_000_000,
    snapshots: int = 32,
    requests: int = 256,
    seed: int = 7,
) -> DecisionRate:
    """The decision rate of `policy` over `workers` synthetic workers, timed as `mode`:

    - "alone": `policy.place` on a snapshot;
    - "explain": the same, and the decision turned into its explanation (`explain`: every
      candidate's predicted cost and why it lost), as the HTTP shell records each decision;
    - "decide": a whole `RouterCore.decide` (see the module doc).

    The loop runs at least `min_seconds` of wall time (checking the clock every 64 decisions)
    and at most `max_decisions`."""
    if workers < 2:
        raise ValueError(f"need at least 2 workers (a prefill and a decode), got {workers}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    model, views, reqs = synthetic_inputs(workers, hosts, colocated, snapshots, requests, seed)
    layout = (
        "co-located" if colocated else f"{workers // 2} prefill + {workers - workers // 2} decode"
    )
    name = (
        f"{policy}, {workers} workers ({layout}): "
        + {
            "alone": "policy alone",
            "explain": "policy + explanation",
            "decide": "RouterCore.decide",
        }[mode]
    )
    fn: Callable[[RequestView, Sequence[WorkerView], float], object]
    if mode == "decide":
        admission = Admission(
            AdmissionConfig(classes=(SloClass("standard", ttft_s=5.0, tpot_s=0.5),),
                            default_class="standard"),
            model=model,
        )  # fmt: skip
        core = RouterCore(build_policy(policy), admission, model)
        core_rng = random.Random(seed + 2)

        def fn(r: RequestView, v: Sequence[WorkerView], now: float) -> object:
            decision = core.decide(r, v, now, core_rng)
            core.on_failed(r.request_id, now)
            return decision

    else:
        pol = build_policy(policy)
        place_rng = random.Random(seed + 1)
        if mode == "alone":

            def fn(r: RequestView, v: Sequence[WorkerView], now: float) -> object:
                return pol.place(r, v, model, now, place_rng)

        else:

            def fn(r: RequestView, v: Sequence[WorkerView], now: float) -> object:
                decision = pol.place(r, v, model, now, place_rng)
                explain(decision)
                return decision

    count = candidates = 0
    t0, c0 = time.perf_counter(), time.process_time()
    elapsed = 0.0
    while count < max_decisions:
        for _ in range(64):
            decision = fn(reqs[count % len(reqs)], views[count % len(views)], 1000.0 + count * 1e-3)
            candidates += len(getattr(decision, "candidates", ()))
            count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            break
    cpu = time.process_time() - c0
    return DecisionRate(name, workers, count, elapsed, candidates / max(count, 1), cpu)


def measure(
    *,
    policy: str = "strata",
    workers: int = 16,
    hosts: int = 4,
    colocated: bool = False,
    min_seconds: float = 1.0,
    max_decisions: int = 1_000_000,
    snapshots: int = 32,
    requests: int = 256,
    seed: int = 7,
) -> tuple[DecisionRate, DecisionRate]:
    """(policy alone, full RouterCore.decide) for `policy` over `workers` synthetic workers (see
    `measure_one`)."""
    rates = [
        measure_one(
            policy=policy, mode=mode, workers=workers, hosts=hosts, colocated=colocated,
            min_seconds=min_seconds, max_decisions=max_decisions, snapshots=snapshots,
            requests=requests, seed=seed,
        )
        for mode in ("alone", "decide")
    ]  # fmt: skip
    return rates[0], rates[1]


# ---- strata bench decisions -------------------------------------------------------------------

TARGET_PER_S = 2000.0  # the target, wall clock
TARGET_PER_CPU_S = 10000.0  # what a decision should cost so the target holds on a loaded machine
BASELINE = "round_robin"


@dataclass(frozen=True, slots=True)
class Row:
    """One measured configuration: its rounds, and the medians over them."""

    key: str
    policy: str
    mode: str
    colocated: bool
    rounds: tuple[DecisionRate, ...]

    @property
    def per_s(self) -> float:
        return statistics.median(r.per_s for r in self.rounds)

    @property
    def per_cpu_s(self) -> float:
        return statistics.median(r.per_cpu_s for r in self.rounds)

    @property
    def cpu_us(self) -> float:
        return statistics.median(r.cpu_us for r in self.rounds)


def configurations(policies: Sequence[str]) -> list[tuple[str, str, str, bool]]:
    """(key, policy, mode, co-located) measured by `strata bench decisions`: every policy alone
    on split workers; `strata` also with its explanation, as RouterCore.decide, and co-located."""
    out = [(f"{p}/alone", p, "alone", False) for p in policies]
    if "strata" in policies:
        out += [
            ("strata/explain", "strata", "explain", False),
            ("strata/decide", "strata", "decide", False),
            ("strata/colocated", "strata", "alone", True),
        ]
    return out


def run_bench(
    *, policies: Sequence[str], workers: int, seconds: float, rounds: int
) -> dict[str, object]:
    """Every configuration, `rounds` times in alternation (so a change in the machine's load
    falls on all of them alike), as a JSON-ready dict."""
    configs = configurations(policies)
    measured: dict[str, list[DecisionRate]] = {key: [] for key, _, _, _ in configs}
    for _ in range(rounds):
        for key, policy, mode, colocated in configs:
            rate = measure_one(
                policy=policy, mode=mode, workers=workers, colocated=colocated, min_seconds=seconds
            )
            measured[key].append(rate)
    rows = [Row(key, p, m, c, tuple(measured[key])) for key, p, m, c in configs]
    base = next((r for r in rows if r.key == f"{BASELINE}/alone"), None)
    strata = next((r for r in rows if r.key == "strata/alone"), None)
    return {
        "config": {
            "workers": workers,
            "seconds_per_round": seconds,
            "rounds": rounds,
            "layout": f"{workers // 2} prefill + {workers - workers // 2} decode "
            "(co-located: all co-located)",
            "statistic": "median over rounds",
        },
        "rows": {
            r.key: {
                "name": r.rounds[0].name,
                "per_s": r.per_s,
                "per_cpu_s": r.per_cpu_s,
                "cpu_us_per_decision": r.cpu_us,
                "candidates_per_decision": r.rounds[0].candidates_per_decision,
                "cpu_vs_round_robin": r.cpu_us / base.cpu_us if base and base.cpu_us else None,
                "rounds": [asdict(x) for x in r.rounds],
            }
            for r in rows
        },
        "targets": {
            "strata_per_s": {
                "value": strata.per_s if strata else None,
                "target": TARGET_PER_S,
                "met": bool(strata and strata.per_s >= TARGET_PER_S),
            },
            "strata_per_cpu_s": {
                "value": strata.per_cpu_s if strata else None,
                "target": TARGET_PER_CPU_S,
                "met": bool(strata and strata.per_cpu_s >= TARGET_PER_CPU_S),
            },
        },
    }


def print_table(result: dict[str, object]) -> None:
    cfg, rows, tgt = result["config"], result["rows"], result["targets"]
    assert isinstance(cfg, dict) and isinstance(rows, dict) and isinstance(tgt, dict)
    print(f"\nstrata bench decisions: {cfg['workers']} synthetic workers, {cfg['rounds']} rounds "
          f"of >= {cfg['seconds_per_round']:g} s each, medians\n")  # fmt: skip
    print("| configuration | decisions/s (wall) | per CPU second | CPU us / decision "
          "| vs round_robin (CPU) | candidates |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows.values():
        ratio = row["cpu_vs_round_robin"]
        print(f"| {row['name']} | {row['per_s']:,.0f} | {row['per_cpu_s']:,.0f} "
              f"| {row['cpu_us_per_decision']:.1f} | {f'{ratio:.2f}x' if ratio else '-'} "
              f"| {row['candidates_per_decision']:.1f} |")  # fmt: skip
    for key, label in (("strata_per_s", "wall"), ("strata_per_cpu_s", "per CPU second")):
        t = tgt[key]
        value = t["value"] if t["value"] is not None else math.nan
        print(f"\nstrata policy alone, {label}: {value:,.0f} decisions/s, target >= "
              f"{t['target']:,.0f}: {'met' if t['met'] else 'NOT met'}", end="")  # fmt: skip
    print()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata bench decisions",
        description="decisions per second of the placement policies on synthetic workers "
        "(the pure router core, no I/O), wall clock and per CPU second",
    )
    p.add_argument("--workers", type=int, default=16, help="synthetic workers (default 16)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="wall seconds per configuration and round (default 1)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--policies", default="strata,round_robin,least_load",
                   help="comma-separated policies (default strata,round_robin,least_load)")  # fmt: skip
    p.add_argument("--json", type=Path, dest="json_path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    policies = tuple(p for p in ns.policies.split(",") if p)
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown or not policies:
        print(f"strata bench decisions: unknown policy {', '.join(unknown) or '(none)'} "
              f"(known: {', '.join(POLICY_NAMES)})", file=sys.stderr)  # fmt: skip
        return 2
    if ns.workers < 2 or ns.rounds < 1 or ns.seconds <= 0:
        print("strata bench decisions: --workers >= 2, --rounds >= 1, --seconds > 0",
              file=sys.stderr)  # fmt: skip
        return 2
    result = run_bench(policies=policies, workers=ns.workers, seconds=ns.seconds, rounds=ns.rounds)
    print_table(result)
    if ns.json_path is not None:
        ns.json_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {ns.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
