"""Decisions per second of a placement policy on synthetic workers: the router core alone, no I/O.

`strata bench router` reports two rates for a pool of N workers (16 by default: half prefill,
half decode, so the `strata` policy prices N/2 x N/2 pairs per request):

- the policy alone (`policy.place` on a snapshot): the issue's target, >= 2,000 decisions/s;
- a full `RouterCore.decide` (dispatch ledger applied, admission judged, the dispatch reserved,
  then released with `on_failed` so the ledger stays at its steady size), which is what the HTTP
  shell pays per request.

The inputs are built once from a seeded RNG before the clock starts, so only the core is timed:
`snapshots` sets of worker views (loads drawn per worker: queued prefill tokens and requests,
running batch and context, free pages, report age) spread over `hosts` hosts, and `requests`
requests (prompt 256-4096 tokens, max tokens 16-512, a prefix hit of 0 to all of the prompt's
full pages, each page in a drawn tier on a drawn store host). Decisions cycle through both.
The time model's coefficients are explicit (a model of the `small` preset's order of
magnitude); they change which worker wins, not what a decision costs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
)

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


@dataclass(frozen=True, slots=True)
class DecisionRate:
    """`decisions` made in `seconds`, and how many pairs each priced (candidates)."""

    name: str
    workers: int
    decisions: int
    seconds: float
    candidates_per_decision: float

    @property
    def per_s(self) -> float:
        return self.decisions / self.seconds if self.seconds > 0 else 0.0


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
    """(policy alone, full RouterCore.decide) for `policy` over `workers` synthetic workers.

    Each loop runs at least `min_seconds` (checking the clock every 64 decisions) and at most
    `max_decisions`."""
    if workers < 2:
        raise ValueError(f"need at least 2 workers (a prefill and a decode), got {workers}")
    rng = random.Random(seed)
    model = synthetic_model()
    views = [synthetic_workers(rng, workers, hosts, colocated=colocated) for _ in range(snapshots)]
    reqs = synthetic_requests(rng, requests, hosts)
    pol = build_policy(policy)
    layout = (
        "co-located" if colocated else f"{workers // 2} prefill + {workers - workers // 2} decode"
    )
    name = f"{policy}, {workers} workers ({layout})"

    def loop(
        fn: Callable[[RequestView, Sequence[WorkerView], float], object],
    ) -> tuple[int, float, int]:
        count = candidates = 0
        t0 = time.perf_counter()
        elapsed = 0.0
        while count < max_decisions:
            for _ in range(64):
                req = reqs[count % len(reqs)]
                decision = fn(req, views[count % len(views)], 1000.0 + count * 1e-3)
                candidates += len(getattr(decision, "candidates", ()))
                count += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        return count, elapsed, candidates

    place_rng = random.Random(seed + 1)
    n, secs, cands = loop(lambda r, v, now: pol.place(r, v, model, now, place_rng))
    alone = DecisionRate(f"{name}: policy alone", workers, n, secs, cands / max(n, 1))

    admission = Admission(
        AdmissionConfig(classes=(SloClass("standard", ttft_s=5.0, tpot_s=0.5),),
                        default_class="standard"),
        model=model,
    )  # fmt: skip
    core = RouterCore(build_policy(policy), admission, model)
    core_rng = random.Random(seed + 2)

    def decide(r: RequestView, v: Sequence[WorkerView], now: float) -> object:
        decision = core.decide(r, v, now, core_rng)
        core.on_failed(r.request_id, now)
        return decision

    n, secs, cands = loop(decide)
    full = DecisionRate(f"{name}: RouterCore.decide", workers, n, secs, cands / max(n, 1))
    return alone, full
