"""RouterMetrics: each observation lands in the series the docs and the alert rules name, with
the values it was given; snapshot gauges follow the latest worker view; instances share
nothing."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.router.core.prediction import PredictionTracker
from engine.router.core.types import Placement, Refusal, RefusalReason, Role, WorkerView
from engine.router.metrics import FinishedRequest, RouterMetrics, bounding_tier
from kvstore_pb import engine_pb2 as pb

pytestmark = pytest.mark.unit


def view(worker: str, role: Role, **kw: object) -> WorkerView:
    fields: dict[str, object] = dict(
        worker_id=worker,
        role=role,
        host_id="h1",
        model="tiny",
        page_tokens=16,
        healthy=True,
        queued_prefill_tokens=0,
        queued_requests=0,
        running_requests=0,
        running_context_tokens=0,
        free_pages=100,
        max_batch=8,
        report_age_s=0.1,
    )
    fields.update(kw)
    return WorkerView(**fields)  # type: ignore[arg-type]


def placement(p: str = "p1", d: str = "d1", ttft: float = 0.1, tpot: float = 0.02) -> Placement:
    return Placement(
        prefill_id=p,
        decode_id=d,
        predicted_ttft_s=ttft,
        predicted_tpot_s=tpot,
        policy="strata",
        candidates=(),
    )


@dataclass(frozen=True, slots=True)
class Cls:
    name: str
    ttft_s: float
    tpot_s: float


def sample(m: RouterMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_decisions_count_by_class_outcome_and_reason() -> None:
    m = RouterMetrics()
    m.observe_decision(placement(), "gold", decide_s=0.0002)
    m.observe_decision(placement(), "gold")
    refusal = Refusal(
        reason=RefusalReason.ttft_slo, retry_after_s=1.5, detail="queue", slo_class="gold"
    )
    m.observe_decision(refusal, "gold", decide_s=0.0001)
    name = "strata_router_admission_decisions_total"
    assert sample(m, name, slo_class="gold", outcome="admitted", reason="none") == 2
    assert sample(m, name, slo_class="gold", outcome="refused", reason="ttft_slo") == 1
    assert sample(m, "strata_router_requests_total", slo_class="gold", outcome="refused") == 1
    assert sample(m, "strata_router_decision_seconds_count") == 2
    assert sample(m, "strata_router_decision_seconds_sum") == pytest.approx(0.0003)


def test_pool_gauges_follow_the_latest_snapshot() -> None:
    m = RouterMetrics(batch_sample_interval_s=1.0)
    views = [
        view("p1", Role.prefill, queued_requests=3, queued_prefill_tokens=900),
        view("p2", Role.prefill, healthy=False),
        view("d1", Role.decode, running_requests=6, max_batch=8, running_context_tokens=700),
        view("d2", Role.decode, running_requests=2, max_batch=8),
        view("c1", Role.colocated, running_requests=4, max_batch=4),
    ]
    m.observe_worker_loads(views, now=10.0)
    assert sample(m, "strata_router_workers", role="prefill", state="healthy") == 1
    assert sample(m, "strata_router_workers", role="prefill", state="unhealthy") == 1
    assert sample(m, "strata_router_pool_workers", pool="prefill") == 2  # p1 + c1
    assert sample(m, "strata_router_pool_workers", pool="decode") == 3
    assert sample(m, "strata_router_prefill_queue_requests", worker="p1") == 3
    assert sample(m, "strata_router_prefill_queue_tokens", worker="p1") == 900
    assert sample(m, "strata_router_prefill_queue_requests", worker="p2") is None
    assert sample(m, "strata_router_decode_utilization", worker="d1") == 0.75
    assert sample(m, "strata_router_decode_active_requests", worker="d2") == 2
    assert sample(m, "strata_router_decode_context_tokens", worker="d1") == 700
    assert sample(m, "strata_router_pool_utilization", pool="decode") == pytest.approx(
        (0.75 + 0.25 + 1.0) / 3
    )
    assert sample(m, "strata_router_decode_batch_size_count") == 3  # d1, d2, c1
    # Half a second later: no new batch samples; 1 s later: one per decode worker again.
    m.observe_worker_loads(views, now=10.5)
    assert sample(m, "strata_router_decode_batch_size_count") == 3
    m.observe_worker_loads(views[:3], now=11.0)
    assert sample(m, "strata_router_decode_batch_size_count") == 4
    # Samples so far: d1=6, d2=2, c1=4, then d1=6 again.
    assert sample(m, "strata_router_decode_batch_size_bucket", le="4.0") == 2
    # d2 and c1 left the snapshot: their gauges are gone.
    assert sample(m, "strata_router_decode_active_requests", worker="d2") is None
    assert sample(m, "strata_router_pool_workers", pool="decode") == 1
    m.observe_worker_loads([], now=12.0)
    assert sample(m, "strata_router_pool_workers", pool="prefill") == 0
    assert sample(m, "strata_router_pool_utilization", pool="prefill") == 0


def prefill_response(
    *, prompt: int, dram: int = 0, ssd: int = 0, queue: float, total: float, pull: float
) -> pb.PrefillResponse:
    return pb.PrefillResponse(
        prompt_tokens=prompt,
        hit_tokens=pb.TierTokens(dram=dram, ssd=ssd),
        timings=pb.PrefillTimings(queue_s=queue, total_s=total, pull_s=pull),
    )


def test_prefill_utilization_is_busy_time_in_the_window() -> None:
    clock = [100.0]
    m = RouterMetrics(utilization_window_s=10.0, clock=lambda: clock[0])
    m.observe_worker_loads([view("p1", Role.prefill), view("p2", Role.prefill)], now=90.0)
    # p1: 3 s of compute ending at 95 and 2 s ending at 99 (queue time is not busy time).
    m.observe_prefill("p1", 4.0, prefill_response(prompt=64, queue=1.0, total=4.0, pull=0.0),
                      now=95.0)  # fmt: skip
    m.observe_prefill("p1", 2.0, prefill_response(prompt=64, queue=0.0, total=2.0, pull=0.0),
                      now=99.0)  # fmt: skip
    assert sample(m, "strata_router_prefill_utilization", worker="p1") == pytest.approx(0.5)
    assert sample(m, "strata_router_prefill_utilization", worker="p2") == 0
    assert sample(m, "strata_router_pool_utilization", pool="prefill") == pytest.approx(0.25)
    # At 103 the window starts at 93: 2 s of the first prefill and all of the second remain.
    clock[0] = 103.0
    assert sample(m, "strata_router_prefill_utilization", worker="p1") == pytest.approx(0.4)
    clock[0] = 120.0
    assert sample(m, "strata_router_prefill_utilization", worker="p1") == 0
    assert sample(m, "strata_router_prefill_seconds_count", worker="p1") == 2
    assert sample(m, "strata_router_prefill_seconds_sum", worker="p1") == 6.0
    assert sample(m, "strata_router_prompt_tokens_total") == 128


def test_pulls_hits_bytes_and_shortfalls() -> None:
    m = RouterMetrics()
    resp = prefill_response(prompt=96, dram=32, ssd=16, queue=0, total=0.2, pull=0.03)
    m.observe_prefill("p1", 0.2, resp, now=1.0, expected_hit_tokens=64, bytes_per_token=1024)
    assert sample(m, "strata_router_hit_tokens_total", stage="prefill", tier="dram") == 32
    assert sample(m, "strata_router_hit_tokens_total", stage="prefill", tier="ssd") == 16
    assert sample(m, "strata_router_kv_pull_bytes_total", stage="prefill", tier="dram") == 32768
    # The pull is attributed to the slowest tier it touched.
    assert sample(m, "strata_router_kv_pull_seconds_count", stage="prefill", tier="ssd") == 1
    assert sample(m, "strata_router_kv_pull_seconds_count", stage="prefill", tier="dram") is None
    assert sample(m, "strata_router_kv_pull_failures_total", stage="prefill") == 1
    assert sample(m, "strata_router_kv_pull_shortfall_tokens_total", stage="prefill") == 16
    stats = pb.DecodeStats(hit_tokens=pb.TierTokens(dram=96), pull_s=0.004)
    m.observe_decode("d1", stats, expected_hit_tokens=96, bytes_per_token=0)
    assert sample(m, "strata_router_kv_pull_seconds_sum", stage="decode", tier="dram") == 0.004
    assert sample(m, "strata_router_kv_pull_failures_total", stage="decode") is None
    assert sample(m, "strata_router_kv_pull_bytes_total", stage="decode", tier="dram") is None
    m.observe_retry("decode", "stream_broken")
    assert sample(m, "strata_router_retries_total", stage="decode", reason="stream_broken") == 1
    assert bounding_tier({"gpu": 16}) == "gpu"
    assert bounding_tier({}) is None


def test_finished_requests_latency_attainment_and_prediction_error() -> None:
    tracker = PredictionTracker(min_samples=2, threshold=0.25)
    m = RouterMetrics(tracker=tracker)
    assert sample(m, "strata_router_prediction_median_relative_error", kind="ttft") is None
    assert sample(m, "strata_router_profile_drift", kind="ttft") == 0
    m.set_slo_classes([Cls("gold", ttft_s=0.5, tpot_s=0.05), Cls("bulk", 5.0, 0.5)])
    assert sample(m, "strata_router_slo_ttft_seconds", slo_class="gold") == 0.5
    assert sample(m, "strata_router_slo_tpot_seconds", slo_class="bulk") == 0.5
    good = FinishedRequest.of(
        placement(ttft=0.2, tpot=0.02), slo_class="gold", outcome="ok",
        ttft_s=0.25, e2e_s=0.25 + 9 * 0.03, output_tokens=10, queue_s=0.01,
    )  # fmt: skip
    assert good.tpot_s == pytest.approx(0.03)
    slow = replace(good, ttft_s=0.8, e2e_s=0.8 + 9 * 0.06, predicted_ttft_s=0.4)
    m.observe_finished(good, now=5.0)
    m.observe_finished(slow, now=6.0)
    assert sample(m, "strata_router_requests_total", slo_class="gold", outcome="ok") == 2
    assert sample(m, "strata_router_output_tokens_total", worker="d1") == 20
    assert sample(m, "strata_router_ttft_seconds_count", slo_class="gold") == 2
    assert sample(m, "strata_router_ttft_seconds_sum", slo_class="gold") == pytest.approx(1.05)
    assert sample(m, "strata_router_tpot_seconds_count", slo_class="gold") == 2
    assert sample(m, "strata_router_decode_tpot_seconds_count", worker="d1") == 2
    assert sample(m, "strata_router_e2e_seconds_count", slo_class="gold") == 2
    assert sample(m, "strata_router_queue_seconds_sum", slo_class="gold") == pytest.approx(0.02)
    assert sample(m, "strata_router_slo_met_total", slo_class="gold", target="ttft") == 1
    assert sample(m, "strata_router_slo_met_total", slo_class="gold", target="tpot") == 1
    assert sample(m, "strata_router_slo_met_total", slo_class="gold", target="both") == 1
    # (predicted - observed) / observed. TTFT: 0.2 vs 0.25 is -20%, 0.4 vs 0.8 is -50%;
    # TPOT: 0.02 vs 0.03 is -33%, 0.02 vs 0.06 is -67%. (Negative buckets: no _sum.)
    err = "strata_router_prediction_relative_error"
    assert sample(m, f"{err}_bucket", kind="ttft", le="-0.5") == 1
    assert sample(m, f"{err}_bucket", kind="ttft", le="-0.3") == 1
    assert sample(m, f"{err}_bucket", kind="ttft", le="-0.1") == 2
    assert sample(m, f"{err}_bucket", kind="tpot", le="-0.5") == 1
    assert sample(m, f"{err}_bucket", kind="tpot", le="-0.3") == 2
    assert sample(m, f"{err}_count", kind="tpot") == 2
    # The gauges read the tracker (which RouterCore feeds, not these calls).
    assert sample(m, "strata_router_prediction_median_relative_error", kind="ttft") is None
    tracker.record("ttft", 0.2, 0.4, now=5.0)
    tracker.record("ttft", 0.3, 0.6, now=6.0)
    assert sample(m, "strata_router_prediction_median_relative_error", kind="ttft") == -0.5
    assert sample(m, "strata_router_profile_drift", kind="ttft") == 1
    assert sample(m, "strata_router_profile_drift", kind="tpot") == 0
    # A cancelled request counts and credits its tokens, but no latency or attainment.
    cancelled = replace(good, outcome="cancelled", tokens_by_worker={"d1": 3, "d2": 2})
    m.observe_finished(cancelled, now=7.0)
    assert sample(m, "strata_router_requests_total", slo_class="gold", outcome="cancelled") == 1
    assert sample(m, "strata_router_output_tokens_total", worker="d2") == 2
    assert sample(m, "strata_router_e2e_seconds_count", slo_class="gold") == 2
    # A class without targets counts as met.
    m.observe_finished(replace(good, slo_class="adhoc"), now=8.0)
    assert sample(m, "strata_router_slo_met_total", slo_class="adhoc", target="both") == 1


def test_instances_share_nothing_and_render_parses() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.observe_error("no_worker")
    assert sample(a, "strata_router_errors_total", kind="no_worker") == 1
    assert sample(b, "strata_router_errors_total", kind="no_worker") is None
    body, content_type = a.render()
    assert content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"strata_router_errors", "strata_router_kv_pull_budget_seconds"} <= names
    assert all(n.startswith("strata_router_") for n in names)
    assert sample(a, "strata_router_kv_pull_budget_seconds", tier="ssd") == 0.5
    with pytest.raises(ValueError, match="unknown tiers"):
        RouterMetrics(pull_budget_s={"nvme": 1.0})
