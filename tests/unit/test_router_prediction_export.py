"""The TTFT prediction error the router exports is the prediction it made (and sent in
`x-strata-predicted-ttft-ms`) against the TTFT from its receipt of the request to the first
token, through the real Dispatcher, RouterCore and RouterMetrics with fake workers and clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.router.core import (
    Admission,
    DecodeCoeffs,
    PrefillCoeffs,
    Role,
    RouterCore,
    TimeModel,
    WorkerView,
    build_policy,
)
from engine.router.core.calibration import PrefillCalibration
from engine.router.core.prediction import PredictionTracker
from engine.router.dispatch import Dispatcher, Job
from engine.router.lookup import StoreLookup
from engine.router.metrics import RouterMetrics
from engine.router.registry import Registry
from kvstore_pb import engine_pb2 as pb

pytestmark = pytest.mark.unit

PROMPT = (5, 6, 7, 8)
# 0.1 s to prefill any prompt, as profiled; decode 10 ms a step
MODEL = TimeModel(PrefillCoeffs(0.1, 0.0, 0.0, 0.0), DecodeCoeffs(0.01, 0.0, 0.0))


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class DecodeCall:
    """A finished Decode stream: one token with the finish reason."""

    events: list[pb.TokenEvent]
    cancelled: bool = False

    def __aiter__(self) -> AsyncIterator[pb.TokenEvent]:
        async def gen() -> AsyncIterator[pb.TokenEvent]:
            for event in self.events:
                yield event

        return gen()

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Workers:
    """The registry as the dispatcher reads it: one prefill and one decode worker. Prefill
    takes `prefill_s` of the fake clock."""

    clock: Clock
    prefill_s: float
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = {"p:1": self._handle("p:1"), "d:1": self._handle("d:1")}

    def _handle(self, address: str) -> SimpleNamespace:
        async def prefill(request: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
            self.calls.append(f"prefill {address}")
            self.clock.now += self.prefill_s
            return pb.PrefillResponse(first_token=42, first_text="a", prompt_tokens=len(PROMPT))

        def decode(request: pb.DecodeRequest, timeout: float) -> DecodeCall:
            self.calls.append(f"decode {address} from {list(request.output_token_ids)}")
            last = pb.TokenEvent(index=1, token_id=43, text="b", finish_reason="length")
            last.stats.CopyFrom(pb.DecodeStats(queue_s=0.0, pull_s=0.0))
            return DecodeCall([last])

        return SimpleNamespace(
            prefill_stub=lambda: SimpleNamespace(Prefill=prefill),
            decode_stub=lambda: SimpleNamespace(Decode=decode),
        )

    def views(self, model: str, now: float | None = None) -> tuple[WorkerView, ...]:
        return (
            WorkerView("p:1", Role.prefill, "h", model, 16),
            WorkerView("d:1", Role.decode, "h", model, 16),
        )

    def mark_failed(self, address: str, why: str) -> None:
        raise AssertionError(f"no worker fails here ({address}: {why})")


def serve(*, calibrated_scale: float | None) -> tuple[RouterMetrics, Workers, float]:
    """One request received at t=10.0, dispatched at 10.05 (its parsing and tokenizing), its
    prefill answered 0.2 s later; returns the metrics, the workers and the predicted TTFT."""
    clock = Clock(10.05)
    tracker = PredictionTracker()
    calibration = None
    if calibrated_scale is not None:
        calibration = PrefillCalibration(MODEL, min_samples=2)
        for _ in range(2):  # the workers prefill at `calibrated_scale` times the profile
            calibration.observe(len(PROMPT), 0, calibrated_scale * MODEL.prefill_s(len(PROMPT), 0))
    core = RouterCore(
        build_policy("round_robin"), Admission(), MODEL, tracker=tracker, calibration=calibration
    )
    if calibration is not None:
        core.model = calibration.model
    metrics = RouterMetrics(tracker=tracker, calibration=calibration, clock=clock)
    workers = Workers(clock, prefill_s=0.2)
    dispatcher = Dispatcher(
        cast(Registry, workers), StoreLookup(None), core, metrics=metrics, clock=clock
    )
    model = SimpleNamespace(model_id="m", scope=None, page_tokens=16, page_bytes=1024, text=None)
    job = Job("r1", cast(Any, model), PROMPT, pb.SamplingParams(max_tokens=2), 2, received_at=10.0)

    async def run() -> float:
        run = await dispatcher.start(job)
        assert [t.token_id async for t in run.tokens()] == [42, 43]
        await asyncio.sleep(0)  # the bookkeeping left to the loop's next turn
        await asyncio.sleep(0)
        return run.placement.predicted_ttft_s

    predicted = asyncio.run(run())
    return metrics, workers, predicted


def value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_the_exported_ttft_error_is_the_told_prediction_against_the_ttft_from_receipt() -> None:
    metrics, workers, predicted = serve(calibrated_scale=None)
    assert predicted == pytest.approx(0.1)  # the profile's, no queue, no hit
    # observed: 10.0 (received) to 10.25 (the first token), not from the decision at 10.05
    expected = (0.1 - 0.25) / 0.25  # -60%; from the decision it would read -50%
    got = value(metrics, "strata_router_prediction_median_relative_error", kind="ttft")
    assert got == pytest.approx(expected)
    err = "strata_router_prediction_relative_error"
    assert value(metrics, f"{err}_count", kind="ttft") == 1
    assert value(metrics, f"{err}_bucket", kind="ttft", le="-0.9") == 0
    assert value(metrics, f"{err}_bucket", kind="ttft", le="-0.5") == 1  # -0.6 falls here
    assert value(metrics, "strata_router_ttft_seconds_sum", slo_class="") == pytest.approx(0.25)
    # the Decode was opened from the prefill's token, the answer finished on its last event
    assert workers.calls == ["prefill p:1", "decode d:1 from [42]"]
    assert value(metrics, "strata_router_prefill_speed_scale") is None  # no calibration


def test_with_a_calibration_the_calibrated_prediction_is_scored_and_the_drift_shows() -> None:
    metrics, _, predicted = serve(calibrated_scale=2.5)
    assert predicted == pytest.approx(0.25)  # the profile's 0.1 s at the workers' live speed
    got = value(metrics, "strata_router_prediction_median_relative_error", kind="ttft")
    assert got == pytest.approx(0.0)  # on time, as the client saw it (the profile alone: -60%)
    assert value(metrics, "strata_router_prefill_speed_scale") == pytest.approx(2.5)
    assert value(metrics, "strata_router_profile_drift", kind="ttft") == 1
    assert value(metrics, "strata_router_profile_drift", kind="tpot") == 0
