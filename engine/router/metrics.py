"""`RouterMetrics`: the router's Prometheus metrics, grouped as operators of disaggregated
serving watch them (docs/operations.md, "Router metrics", lists every series).

- prefill pool: prefill latency (histogram per worker), utilization, worker count, queue depth;
- decode pool: TPOT (histogram per worker), utilization, worker count, active requests per
  worker, batch-size distribution;
- KV movement: pull latency per tier and stage, bytes pulled, pull shortfalls (pages the store
  announced that a worker could not use), the router's retries;
- end to end, per SLO class: TTFT, TPOT, end-to-end and queue-time histograms, requests,
  output tokens per worker, SLO attainment, admission decisions by reason, hit tokens per tier,
  TTFT/TPOT prediction error, the profile drift flag, and the classes' targets as gauges (the
  alerting rules compare against those).

Each instance owns its own `CollectorRegistry` (no process-global metric state): the app
creates one and serves `render()` on GET /metrics. The shell feeds it plain values and the
core's records; nothing here decides anything. Methods are thread-safe (prometheus_client's
metrics lock themselves; the snapshot state here is guarded by one lock) and cheap (a few
dictionary updates each), so they can be called on the request path.

Time: `now` arguments are the shell's monotonic clock (the same one it gives the core);
`clock` (default `time.monotonic`) is read only at scrape time, for the windowed prefill
utilization. Tests pass both explicitly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from engine.router.core.types import TIERS, Placement, Refusal, WorkerView

STAGES = ("prefill", "decode")
OUTCOMES = ("ok", "failed", "cancelled", "refused")

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1.0,
)  # fmt: skip
PULL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
)  # fmt: skip
DECISION_BUCKETS = (
    0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip
BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RELATIVE_ERROR_BUCKETS = (
    -0.9, -0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip

DEFAULT_PULL_BUDGET_S: Mapping[str, float] = {"gpu": 0.05, "dram": 0.1, "ssd": 0.5}
"""Per-tier budget for one request's pull (all its hit pages), exported as
`strata_router_kv_pull_budget_seconds{tier}`; the KV pull alert compares the p99 with it."""


class SloTargets(Protocol):
    """What `set_slo_classes` reads of a class (the core's `SloClass` fits)."""

    @property
    def name(self) -> str: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def tpot_s(self) -> float: ...


class ErrorTracker(Protocol):
    """What a scrape reads of the core's `PredictionTracker` (RouterCore feeds it)."""

    def count(self, kind: str) -> int: ...
    def median_relative_error(self, kind: str) -> float: ...
    def drifted(self, kind: str) -> bool: ...


class SpeedCalibration(Protocol):
    """What a scrape reads of the core's `PrefillCalibration`."""

    @property
    def scale(self) -> float: ...
    @property
    def samples(self) -> int: ...
    @property
    def drifted(self) -> bool: ...


class TierTokenCounts(Protocol):
    """engine.proto `TierTokens` (or engine.requests.TierTokens)."""

    @property
    def gpu(self) -> int: ...
    @property
    def dram(self) -> int: ...
    @property
    def ssd(self) -> int: ...


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request that got a placement and then ended, as the shell saw it.

    `outcome`: "ok" (finished: stop or length), "failed" (no worker could complete it) or
    "cancelled" (the client went away). `ttft_s`: from the router receiving the request to the
    first token it sent (None if none was sent); `e2e_s`: to the last. `queue_s`: time spent
    queued on the workers (prefill queue_s + decode queue_s, as they report it).
    `tokens_by_worker`: output tokens each decode worker produced (more than one entry after a
    resumed decode). `predicted_*`: the placement's predictions (0 = none).
    """

    slo_class: str
    outcome: str
    prefill_id: str
    decode_id: str
    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    queue_s: float
    tokens_by_worker: Mapping[str, int]
    predicted_ttft_s: float = 0.0
    predicted_tpot_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return max(0.0, self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def of(
        cls,
        placement: Placement,
        *,
        slo_class: str,
        outcome: str,
        ttft_s: float | None,
        e2e_s: float,
        output_tokens: int,
        queue_s: float = 0.0,
        tokens_by_worker: Mapping[str, int] | None = None,
    ) -> FinishedRequest:
        """The record for a request placed by `placement` (tokens all credited to its decode
        worker unless `tokens_by_worker` says otherwise)."""
        return cls(
            slo_class=slo_class,
            outcome=outcome,
            prefill_id=placement.prefill_id,
            decode_id=placement.decode_id,
            ttft_s=ttft_s,
            e2e_s=e2e_s,
            output_tokens=output_tokens,
            queue_s=queue_s,
            tokens_by_worker=(
                dict(tokens_by_worker)
                if tokens_by_worker is not None
                else {placement.decode_id: output_tokens}
            ),
            predicted_ttft_s=placement.predicted_ttft_s,
            predicted_tpot_s=placement.predicted_tpot_s,
        )


@dataclass(frozen=True, slots=True)
class _LoadSnapshot:
    worker: str
    role: str
    healthy: bool
    queued_requests: int
    queued_prefill_tokens: int
    running_requests: int
    running_context_tokens: int
    free_pages: int
    max_batch: int
    report_age_s: float


def _tier_dict(tokens: TierTokenCounts) -> dict[str, int]:
    return {"gpu": int(tokens.gpu), "dram": int(tokens.dram), "ssd": int(tokens.ssd)}


def bounding_tier(hit_tokens: Mapping[str, int]) -> str | None:
    """The slowest tier that served any hit token (the one that bounds a pull), or None."""
    for tier in reversed(TIERS):
        if hit_tokens.get(tier, 0) > 0:
            return tier
    return None


class RouterMetrics:
    """The router's metrics over its own registry. See the module docstring for the groups.

    `pull_budget_s`: per-tier pull budget exported for the alert (default
    DEFAULT_PULL_BUDGET_S). `utilization_window_s`: the window of the prefill utilization
    (busy seconds in the window / window). `batch_sample_interval_s`: the decode batch-size
    histogram takes at most one sample per worker per interval, so its distribution is over
    time, not over how often the shell happens to look. `tracker`: the core's
    PredictionTracker (RouterCore records into it); scrapes read its median error and drift
    flag.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        pull_budget_s: Mapping[str, float] | None = None,
        utilization_window_s: float = 60.0,
        batch_sample_interval_s: float = 1.0,
        tracker: ErrorTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        calibration: SpeedCalibration | None = None,
    ) -> None:
        if utilization_window_s <= 0:
            raise ValueError(f"utilization_window_s must be > 0, got {utilization_window_s}")
        budget = dict(DEFAULT_PULL_BUDGET_S if pull_budget_s is None else pull_budget_s)
        unknown = sorted(set(budget) - set(TIERS))
        if unknown:
            raise ValueError(f"pull budget for unknown tiers {unknown} (tiers: {list(TIERS)})")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._pull_budget = budget
        self._window_s = utilization_window_s
        self._batch_interval_s = batch_sample_interval_s
        self._tracker = tracker
        self._calibration = calibration
        self._clock = clock
        self._lock = threading.Lock()
        # labelled children by (family, label values): a request's ~20 observations look
        # their child up here instead of through `labels()` (which validates and locks)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._loads: tuple[_LoadSnapshot, ...] = ()
        self._busy: dict[str, deque[tuple[float, float]]] = {}
        self._batch_sampled_at: dict[str, float] = {}
        self._slo: dict[str, tuple[float, float]] = {}
        r = self.registry

        # ---- prefill pool
        self.prefill_seconds = Histogram(
            "strata_router_prefill_seconds",
            "Prefill RPC time as the router saw it (dispatch to first token), by worker",
            ["worker"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        # ---- decode pool
        self.decode_tpot_seconds = Histogram(
            "strata_router_decode_tpot_seconds",
            "Mean time per output token of a finished request, by its decode worker",
            ["worker"], buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_batch_size = Histogram(
            "strata_router_decode_batch_size",
            "Decode batch size (running requests) sampled per worker over time",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        # ---- KV movement
        self.kv_pull_seconds = Histogram(
            "strata_router_kv_pull_seconds",
            "Time a worker spent pulling a request's hit pages, by stage and by the slowest "
            "tier among them",
            ["stage", "tier"], buckets=PULL_BUCKETS, registry=r,
        )  # fmt: skip
        self.kv_pull_bytes = Counter(
            "strata_router_kv_pull_bytes",
            "KV bytes workers pulled from the store, by stage and tier",
            ["stage", "tier"], registry=r,
        )  # fmt: skip
        self.kv_pull_failures = Counter(
            "strata_router_kv_pull_failures",
            "Requests whose worker used fewer cached tokens than the store had announced "
            "(evicted, failed verification, store down), by stage",
            ["stage"], registry=r,
        )  # fmt: skip
        self.kv_pull_shortfall_tokens = Counter(
            "strata_router_kv_pull_shortfall_tokens",
            "Announced cached tokens a worker recomputed instead, by stage",
            ["stage"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "strata_router_retries",
            "Requests retried on another worker (prefill) or resumed on another (decode)",
            ["stage", "reason"], registry=r,
        )  # fmt: skip
        # ---- end to end
        self.ttft_seconds = Histogram(
            "strata_router_ttft_seconds",
            "Time to first token, from the router receiving the request, by SLO class",
            ["slo_class"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot_seconds = Histogram(
            "strata_router_tpot_seconds",
            "Mean time per output token after the first, by SLO class",
            ["slo_class"], buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_seconds = Histogram(
            "strata_router_e2e_seconds",
            "Time from the router receiving a request to its last token, by SLO class",
            ["slo_class"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "strata_router_queue_seconds",
            "Time a request waited in worker queues (prefill + decode), by SLO class",
            ["slo_class"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "strata_router_requests",
            "Requests that reached placement, by SLO class and outcome (ok, failed, "
            "cancelled, refused)",
            ["slo_class", "outcome"], registry=r,
        )  # fmt: skip
        self.output_tokens = Counter(
            "strata_router_output_tokens",
            "Output tokens streamed to clients, by the decode worker that produced them",
            ["worker"], registry=r,
        )  # fmt: skip
        self.slo_met = Counter(
            "strata_router_slo_met",
            "Finished requests that met their class's target, by class and target (ttft, "
            "tpot, both); divide by strata_router_requests_total{outcome='ok'} for attainment",
            ["slo_class", "target"], registry=r,
        )  # fmt: skip
        self.admission_decisions = Counter(
            "strata_router_admission_decisions",
            "Routing decisions by SLO class, outcome (admitted, refused) and reason",
            ["slo_class", "outcome", "reason"], registry=r,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "strata_router_decision_seconds",
            "Time the router spent deciding one request (placement and admission)",
            buckets=DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "strata_router_errors",
            "Requests answered with an error, by error kind",
            ["kind"], registry=r,
        )  # fmt: skip
        self.hit_tokens = Counter(
            "strata_router_hit_tokens",
            "Prompt tokens served from the store, by stage and tier",
            ["stage", "tier"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "strata_router_prompt_tokens",
            "Prompt tokens prefilled (hit or computed); the denominator of the hit rate",
            registry=r,
        )  # fmt: skip
        self.prediction_relative_error = Histogram(
            "strata_router_prediction_relative_error",
            "(predicted - observed) / observed of finished requests, by kind (ttft, tpot): "
            "positive = the time model is pessimistic",
            ["kind"], buckets=RELATIVE_ERROR_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_SnapshotCollector(self))

    # ---- configuration

    def set_slo_classes(self, classes: Iterable[SloTargets]) -> None:
        """Export each class's targets (strata_router_slo_{ttft,tpot}_seconds{slo_class}) and
        use them for attainment. Replaces any earlier set. Mutates; never raises."""
        with self._lock:
            self._slo = {c.name: (float(c.ttft_s), float(c.tpot_s)) for c in classes}

    # ---- decisions and load

    def observe_decision(
        self, decision: Placement | Refusal, slo_class: str, *, decide_s: float | None = None
    ) -> None:
        """Count one routing decision (a core Placement or Refusal) for `slo_class`; a refusal
        also counts as a request with outcome "refused". `decide_s`: time spent deciding."""
        if isinstance(decision, Refusal):
            self._child(self.admission_decisions, slo_class, "refused", str(decision.reason)).inc()
            self._child(self.requests, slo_class, "refused").inc()
        else:
            self._child(self.admission_decisions, slo_class, "admitted", "none").inc()
        if decide_s is not None:
            self.decision_seconds.observe(decide_s)

    def observe_error(self, kind: str) -> None:
        """Count one request answered with an error of `kind` (the core's ErrorKind value)."""
        self._child(self.errors, str(kind)).inc()

    def observe_worker_loads(self, views: Sequence[WorkerView], now: float) -> None:
        """Take the registry's current snapshot (every known worker, healthy or not): it backs
        the pool gauges until the next call, so a worker absent from `views` disappears from
        them. Samples the decode batch-size histogram (at most once per worker per
        `batch_sample_interval_s` of `now`). Mutates; never raises."""
        snaps = tuple(
            _LoadSnapshot(
                worker=v.worker_id,
                role=str(v.role),
                healthy=bool(v.healthy),
                queued_requests=int(v.queued_requests),
                queued_prefill_tokens=int(v.queued_prefill_tokens),
                running_requests=int(v.running_requests),
                running_context_tokens=int(v.running_context_tokens),
                free_pages=int(v.free_pages),
                max_batch=int(v.max_batch),
                report_age_s=float(v.report_age_s),
            )
            for v in views
        )
        to_sample: list[int] = []
        with self._lock:
            self._loads = snaps
            known = {s.worker for s in snaps}
            for gone in [w for w in self._batch_sampled_at if w not in known]:
                del self._batch_sampled_at[gone]
            for s in snaps:
                if not s.healthy or s.role not in ("decode", "colocated"):
                    continue
                last = self._batch_sampled_at.get(s.worker)
                if last is None or now - last >= self._batch_interval_s:
                    self._batch_sampled_at[s.worker] = now
                    to_sample.append(s.running_requests)
        for batch in to_sample:
            self.decode_batch_size.observe(batch)

    # ---- worker responses

    def observe_prefill(
        self,
        worker: str,
        rpc_s: float,
        response: PrefillResponseLike,
        *,
        now: float,
        expected_hit_tokens: int = 0,
        bytes_per_token: int = 0,
    ) -> None:
        """One answered prefill: `response` is engine.proto's PrefillResponse (its `timings`,
        `hit_tokens`, `prompt_tokens`), `rpc_s` the RPC time the router measured, `now` when
        it ended. `expected_hit_tokens`: what the store announced at decision time (hit pages
        times page tokens), to count shortfalls; `bytes_per_token`: page bytes / page tokens, to
        turn hit tokens into pulled bytes (0 = unknown: no bytes counted). Never raises."""
        self._child(self.prefill_seconds, worker).observe(max(0.0, rpc_s))
        timings = response.timings
        busy = max(0.0, float(timings.total_s) - float(timings.queue_s))
        with self._lock:
            q = self._busy.setdefault(worker, deque())
            q.append((now, busy))
            self._prune(q, now)
        hits = _tier_dict(response.hit_tokens)
        self.prompt_tokens.inc(max(0, int(response.prompt_tokens)))
        self._observe_pull("prefill", hits, float(timings.pull_s), expected_hit_tokens,
                           bytes_per_token)  # fmt: skip

    def observe_decode(
        self,
        worker: str,
        stats: DecodeStatsLike,
        *,
        expected_hit_tokens: int = 0,
        bytes_per_token: int = 0,
    ) -> None:
        """One decode stream's last event: `stats` is engine.proto's DecodeStats (hit tokens
        per tier, pull_s). Arguments as in `observe_prefill`; `expected_hit_tokens` is
        usually the prompt's full pages published by prefill. Never raises."""
        hits = _tier_dict(stats.hit_tokens)
        self._observe_pull("decode", hits, float(stats.pull_s), expected_hit_tokens,
                           bytes_per_token)  # fmt: skip

    def observe_retry(self, stage: str, reason: str) -> None:
        """A prefill retried on another worker or a decode resumed on another (`stage`), and
        why (e.g. "unavailable", "deadline", "stream_broken")."""
        self._child(self.retries, stage, reason).inc()

    def observe_finished(self, done: FinishedRequest, *, now: float) -> None:
        """One placed request that ended: latency histograms of its class, its outcome, output
        tokens per worker, SLO attainment against the class targets (a class without targets
        counts as met), and, for an "ok" request, the prediction errors (predicted - observed)
        / observed, the tracker's convention. Never raises."""
        cls = done.slo_class
        self._child(self.requests, cls, done.outcome).inc()
        for worker, n in done.tokens_by_worker.items():
            if n > 0:
                self._child(self.output_tokens, worker).inc(n)
        if done.ttft_s is None:
            return
        self._child(self.ttft_seconds, cls).observe(done.ttft_s)
        if done.outcome != "ok":
            return
        self._child(self.e2e_seconds, cls).observe(done.e2e_s)
        self._child(self.queue_seconds, cls).observe(max(0.0, done.queue_s))
        tpot = done.tpot_s
        if tpot is not None:
            self._child(self.tpot_seconds, cls).observe(tpot)
            self._child(self.decode_tpot_seconds, done.decode_id).observe(tpot)
        with self._lock:
            ttft_target, tpot_target = self._slo.get(cls, (float("inf"), float("inf")))
        ttft_ok = done.ttft_s <= ttft_target
        tpot_ok = tpot is None or tpot <= tpot_target
        if ttft_ok:
            self._child(self.slo_met, cls, "ttft").inc()
        if tpot_ok:
            self._child(self.slo_met, cls, "tpot").inc()
        if ttft_ok and tpot_ok:
            self._child(self.slo_met, cls, "both").inc()
        for kind, predicted, observed in (
            ("ttft", done.predicted_ttft_s, done.ttft_s),
            ("tpot", done.predicted_tpot_s, tpot),
        ):
            if predicted > 0 and observed is not None and observed > 0:
                self._child(self.prediction_relative_error, kind).observe(
                    (predicted - observed) / observed
                )

    # ---- exposition

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every series and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- internals

    def _observe_pull(
        self, stage: str, hits: Mapping[str, int], pull_s: float, expected: int, bpt: int
    ) -> None:
        total = 0
        for tier in TIERS:
            n = hits.get(tier, 0)
            if n <= 0:
                continue
            total += n
            self._child(self.hit_tokens, stage, tier).inc(n)
            if bpt > 0:
                self._child(self.kv_pull_bytes, stage, tier).inc(n * bpt)
        slowest = bounding_tier(hits)
        if slowest is not None:
            self._child(self.kv_pull_seconds, stage, slowest).observe(max(0.0, pull_s))
        if expected > total:
            self._child(self.kv_pull_failures, stage).inc()
            self._child(self.kv_pull_shortfall_tokens, stage).inc(expected - total)

    def _child(self, family: Counter | Histogram, *values: str) -> Any:
        """`family.labels(*values)`, made once per label set and kept (a family's children
        are never removed here, so a kept child is the one `labels()` would return)."""
        key = (id(family), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return child

    def _prune(self, q: deque[tuple[float, float]], now: float) -> None:
        while q and q[0][0] < now - self._window_s:
            q.popleft()

    def _utilization(self, worker: str, now: float) -> float:
        """Busy seconds of `worker`'s prefills inside [now - window, now] / window (caller holds
        the lock)."""
        q = self._busy.get(worker)
        if not q:
            return 0.0
        self._prune(q, now)
        start = now - self._window_s
        busy = 0.0
        for end, seconds in q:
            busy += max(0.0, min(end, now) - max(end - seconds, start))
        return min(1.0, busy / self._window_s)

    def _snapshot_families(self) -> Iterator[Metric]:
        now = self._clock()
        with self._lock:
            loads = self._loads
            slo = dict(self._slo)
            known = {s.worker for s in loads}
            for gone in [w for w in self._busy if w not in known]:
                del self._busy[gone]
            prefill_util = {
                s.worker: self._utilization(s.worker, now)
                for s in loads
                if s.role == "prefill" and s.healthy
            }
        healthy = [s for s in loads if s.healthy]
        workers = GaugeMetricFamily(
            "strata_router_workers", "Workers the registry knows, by role and health",
            labels=["role", "state"],
        )  # fmt: skip
        for role in ("prefill", "decode", "colocated"):
            of_role = [s for s in loads if s.role == role]
            up = sum(1 for s in of_role if s.healthy)
            workers.add_metric([role, "healthy"], up)
            workers.add_metric([role, "unhealthy"], len(of_role) - up)
        yield workers
        prefill_pool = [s for s in healthy if s.role in ("prefill", "colocated")]
        decode_pool = [s for s in healthy if s.role in ("decode", "colocated")]
        pool_workers = GaugeMetricFamily(
            "strata_router_pool_workers",
            "Healthy workers serving each pool (a co-located worker serves both)",
            labels=["pool"],
        )
        pool_workers.add_metric(["prefill"], len(prefill_pool))
        pool_workers.add_metric(["decode"], len(decode_pool))
        yield pool_workers

        util = GaugeMetricFamily(
            "strata_router_prefill_utilization",
            f"Fraction of the last {self._window_s:g} s a prefill worker spent computing",
            labels=["worker"],
        )
        for worker, value in sorted(prefill_util.items()):
            util.add_metric([worker], value)
        yield util
        q_req = GaugeMetricFamily(
            "strata_router_prefill_queue_requests",
            "Prefills queued on a worker (its latest load report)", labels=["worker"],
        )  # fmt: skip
        q_tok = GaugeMetricFamily(
            "strata_router_prefill_queue_tokens",
            "Prompt tokens queued for prefill on a worker (its latest load report)",
            labels=["worker"],
        )
        for s in prefill_pool:
            q_req.add_metric([s.worker], s.queued_requests)
            q_tok.add_metric([s.worker], s.queued_prefill_tokens)
        yield q_req
        yield q_tok

        d_util = GaugeMetricFamily(
            "strata_router_decode_utilization",
            "Running requests / batch capacity of a decode worker (its latest load report)",
            labels=["worker"],
        )
        active = GaugeMetricFamily(
            "strata_router_decode_active_requests",
            "Requests in a decode worker's running batch", labels=["worker"],
        )  # fmt: skip
        ctx = GaugeMetricFamily(
            "strata_router_decode_context_tokens",
            "Context tokens of a decode worker's running batch", labels=["worker"],
        )  # fmt: skip
        free = GaugeMetricFamily(
            "strata_router_worker_free_pages",
            "Free KV pool pages of a worker", labels=["worker"],
        )  # fmt: skip
        age = GaugeMetricFamily(
            "strata_router_worker_report_age_seconds",
            "Age of a worker's latest load report", labels=["worker"],
        )  # fmt: skip
        for s in decode_pool:
            d_util.add_metric([s.worker], _decode_utilization(s))
            active.add_metric([s.worker], s.running_requests)
            ctx.add_metric([s.worker], s.running_context_tokens)
        for s in healthy:
            free.add_metric([s.worker], s.free_pages)
            age.add_metric([s.worker], s.report_age_s)
        yield d_util
        yield active
        yield ctx
        yield free
        yield age

        pool_util = GaugeMetricFamily(
            "strata_router_pool_utilization",
            "Mean utilization of a pool's healthy workers (0 with none)", labels=["pool"],
        )  # fmt: skip
        p_values = [prefill_util.get(s.worker, 0.0) for s in healthy if s.role == "prefill"]
        d_values = [_decode_utilization(s) for s in decode_pool]
        pool_util.add_metric(["prefill"], sum(p_values) / len(p_values) if p_values else 0.0)
        pool_util.add_metric(["decode"], sum(d_values) / len(d_values) if d_values else 0.0)
        yield pool_util

        budget = GaugeMetricFamily(
            "strata_router_kv_pull_budget_seconds",
            "Budget for one request's KV pull, by tier (the KV pull alert's threshold)",
            labels=["tier"],
        )
        for tier, seconds in sorted(self._pull_budget.items()):
            budget.add_metric([tier], seconds)
        yield budget
        ttft_t = GaugeMetricFamily(
            "strata_router_slo_ttft_seconds", "TTFT target of an SLO class",
            labels=["slo_class"],
        )  # fmt: skip
        tpot_t = GaugeMetricFamily(
            "strata_router_slo_tpot_seconds", "TPOT target of an SLO class",
            labels=["slo_class"],
        )  # fmt: skip
        for name, (ttft_s, tpot_s) in sorted(slo.items()):
            ttft_t.add_metric([name], ttft_s)
            tpot_t.add_metric([name], tpot_s)
        yield ttft_t
        yield tpot_t

        median = GaugeMetricFamily(
            "strata_router_prediction_median_relative_error",
            "Median (predicted - observed) / observed over the tracker's recent requests: the "
            "predictions the router made (and sent in x-strata-predicted-*), TTFT observed from "
            "its receipt of the request",
            labels=["kind"],
        )
        drift = GaugeMetricFamily(
            "strata_router_profile_drift",
            "1 when the time model's recent predictions have drifted past the threshold, or "
            "(ttft) the workers' live prefill speed has left the profile's",
            labels=["kind"],
        )
        cal = self._calibration
        speed_drifted = cal is not None and cal.drifted
        if self._tracker is not None:
            for kind in ("ttft", "tpot"):
                if self._tracker.count(kind) > 0:
                    median.add_metric([kind], self._tracker.median_relative_error(kind))
                drifted = self._tracker.drifted(kind) or (kind == "ttft" and speed_drifted)
                drift.add_metric([kind], 1.0 if drifted else 0.0)
        yield median
        yield drift
        if cal is not None:
            scale = GaugeMetricFamily(
                "strata_router_prefill_speed_scale",
                "Live prefill seconds per second the profile predicts (median of the workers' "
                "recent prefills; 1 until enough were seen): predictions follow it",
            )
            scale.add_metric([], cal.scale)
            yield scale


def _decode_utilization(s: _LoadSnapshot) -> float:
    return min(1.0, s.running_requests / s.max_batch) if s.max_batch > 0 else 0.0


class PrefillTimingsLike(Protocol):
    @property
    def queue_s(self) -> float: ...
    @property
    def pull_s(self) -> float: ...
    @property
    def total_s(self) -> float: ...


class PrefillResponseLike(Protocol):
    """What `observe_prefill` reads of engine.proto's PrefillResponse."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def hit_tokens(self) -> TierTokenCounts: ...
    @property
    def timings(self) -> PrefillTimingsLike: ...


class DecodeStatsLike(Protocol):
    """What `observe_decode` reads of engine.proto's DecodeStats."""

    @property
    def hit_tokens(self) -> TierTokenCounts: ...
    @property
    def pull_s(self) -> float: ...


class _SnapshotCollector:
    """Yields the gauges computed from the latest snapshot at scrape time."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        return self._m._snapshot_families()

    def describe(self) -> Iterator[Metric]:
        return self._m._snapshot_families()
