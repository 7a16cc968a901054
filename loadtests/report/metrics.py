"""Metrics of a run, computed at the end from its records (the same code for live and simulated runs).

- Latencies of completed requests: TTFT and end-to-end from the intended send time, TPOT as the
  mean gap after the first token; mean, p50, p90, p99 (nearest-rank percentiles). Non-streamed
  requests (no first token seen) count in end-to-end only.
- SLO attainment: the fraction of all requests of the class (refused, timed out and failed
  included) that completed with TTFT ≤ its target and TPOT ≤ its target. Goodput: such requests
  per second of run. A sweep's goodput is the highest offered rate with attainment ≥ 90%.
- Refused (429), timed out and failed are counted apart. Hit tokens per tier and the hit ratio
  (hit tokens over prompt tokens of completed requests). Jain's fairness index over the classes'
  attainments: 1 when every class is served alike, 1/n when one class gets everything.
- The client's lag (actual minus intended send time): a run whose p99 lag exceeds `MAX_LAG_S`
  or whose achieved send rate is under 95% of the target is marked invalid (the client fell
  behind, so it measured itself, not the server).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtests.report.records import TIER_NAMES, RequestRecord, RunResult

ATTAINMENT_GOAL = 0.9
MAX_LAG_S = 0.05
MIN_RATE_FRACTION = 0.95


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True, slots=True)
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


@dataclass(frozen=True, slots=True)
class ClassMetrics:
    name: str
    requests: int
    ok: int
    refused: int
    timed_out: int
    failed: int
    ttft: Dist
    tpot: Dist
    e2e: Dist
    attainment: float
    goodput_rps: float
    prompt_tokens: int
    hit_tokens: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)  # mean seconds per part

    @property
    def hit_ratio(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class RunMetrics:
    label: str
    overall: ClassMetrics
    classes: tuple[ClassMetrics, ...]
    target_rate: float
    achieved_rate: float  # requests sent per second
    lag_p99_s: float
    valid: bool
    fairness: float
    bytes_moved: int
    evictions: int


def meets(record: RequestRecord, ttft_s: float, tpot_s: float) -> bool:
    """Both targets met. A non-streamed request (no first token seen) is judged on its end to
    end time against the two budgets together: ttft + tpot x (tokens - 1)."""
    if record.status != "ok":
        return False
    if math.isnan(record.first_token_s):
        return record.e2e_s <= ttft_s + tpot_s * max(record.output_tokens - 1, 0)
    return record.ttft_s <= ttft_s and record.tpot_s <= tpot_s


def class_metrics(
    name: str,
    records: Sequence[RequestRecord],
    targets: dict[str, tuple[float, float]],
    duration_s: float,
) -> ClassMetrics:
    ok = [r for r in records if r.status == "ok"]
    good = sum(1 for r in records if meets(r, *targets.get(r.slo_class, (math.inf, math.inf))))
    hits = {t: sum(r.hit(t) for r in ok) for t in TIER_NAMES}
    parts = ("queue_s", "prefill_s", "pull_s", "decode_queue_s", "decode_s", "other_s")
    breakdown = {
        p: (sum(getattr(r.breakdown, p) for r in ok) / len(ok) if ok else math.nan) for p in parts
    }
    return ClassMetrics(
        name=name,
        requests=len(records),
        ok=len(ok),
        refused=sum(1 for r in records if r.status == "refused"),
        timed_out=sum(1 for r in records if r.status == "timeout"),
        failed=sum(1 for r in records if r.status == "failed"),
        # non-streamed requests have no first token: no TTFT or TPOT (their end-to-end counts)
        ttft=Dist.of([r.ttft_s for r in ok if not math.isnan(r.first_token_s)]),
        tpot=Dist.of(
            [r.tpot_s for r in ok if r.output_tokens > 1 and not math.isnan(r.first_token_s)]
        ),
        e2e=Dist.of([r.e2e_s for r in ok]),
        attainment=good / len(records) if records else math.nan,
        goodput_rps=good / duration_s if duration_s > 0 else math.nan,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        hit_tokens=hits,
        breakdown=breakdown,
    )


def jain(values: Sequence[float]) -> float:
    xs = [v for v in values if not math.isnan(v)]
    if not xs or sum(x * x for x in xs) == 0:
        return math.nan if not xs else 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def run_metrics(run: RunResult) -> RunMetrics:
    targets = {c.name: (c.ttft_s, c.tpot_s) for c in run.classes}
    names = [c.name for c in run.classes] or sorted({r.slo_class for r in run.records})
    per_class = tuple(
        class_metrics(n, [r for r in run.records if r.slo_class == n], targets, run.duration_s)
        for n in names
    )
    overall = class_metrics("all", run.records, targets, run.duration_s)
    span = run.duration_s
    in_time = sum(1 for r in run.records if r.sent_s <= span)
    achieved = in_time / span if span > 0 else 0.0
    lag = percentile([max(0.0, r.lag_s) for r in run.records], 99) if run.records else 0.0
    valid = lag <= MAX_LAG_S and (
        run.target_rate <= 0 or achieved >= MIN_RATE_FRACTION * _expected_rate(run)
    )
    return RunMetrics(
        label=run.label,
        overall=overall,
        classes=per_class,
        target_rate=run.target_rate,
        achieved_rate=achieved,
        lag_p99_s=lag,
        valid=valid,
        fairness=jain([c.attainment for c in per_class if c.requests]),
        bytes_moved=run.bytes_moved,
        evictions=run.evictions,
    )


def _expected_rate(run: RunResult) -> float:
    """The rate the schedule itself had (the intended times), which a seeded process may miss
    the nominal target by chance; the client is judged against the schedule it was given."""
    if not run.records or run.duration_s <= 0:
        return 0.0
    return sum(1 for r in run.records if r.intended_s <= run.duration_s) / run.duration_s


def goodput_rate(runs: Sequence[RunResult], goal: float = ATTAINMENT_GOAL) -> float:
    """The highest offered rate among `runs` (a sweep) whose attainment is ≥ `goal` (0 if none)."""
    best = 0.0
    for run in runs:
        m = run_metrics(run)
        if m.overall.attainment >= goal and m.valid:
            best = max(best, run.target_rate)
    return best
