"""The live prefill calibration: the profile's shape at the speed the workers report."""

from __future__ import annotations

import random

import pytest

from engine.router.core import (
    Admission,
    AdmissionConfig,
    DecodeCoeffs,
    PrefillCoeffs,
    PrefixHit,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
)
from engine.router.core.calibration import PrefillCalibration

pytestmark = pytest.mark.unit

MODEL = TimeModel(
    prefill=PrefillCoeffs(
        fixed_s=0.01, per_token_s=1e-4, per_cached_token_s=1e-6, attention_s=1e-8
    ),
    decode=DecodeCoeffs(fixed_s=0.01, per_request_s=1e-3, per_context_token_s=1e-6),
)


def test_the_median_ratio_scales_every_prefill_coefficient() -> None:
    cal = PrefillCalibration(MODEL, window=16, min_samples=4)
    points = [(16, 0), (64, 512), (256, 0), (512, 1024), (128, 128)]
    for new, cached in points[:3]:
        assert not cal.observe(new, cached, 3.0 * MODEL.prefill_s(new, cached))
        assert cal.scale == 1.0 and cal.model is MODEL  # too few samples yet
    assert cal.observe(*points[3], 3.0 * MODEL.prefill_s(*points[3]))
    assert cal.scale == pytest.approx(3.0)
    for new, cached in points:
        assert cal.model.prefill_s(new, cached) == pytest.approx(3 * MODEL.prefill_s(new, cached))
    assert cal.model.decode == MODEL.decode and cal.model.pulls == MODEL.pulls
    # one outlier does not move the median; the window forgets old samples
    assert not cal.observe(16, 0, 100 * MODEL.prefill_s(16, 0))
    for _ in range(16):
        cal.observe(64, 0, 0.5 * MODEL.prefill_s(64, 0))
    assert cal.scale == pytest.approx(0.5)


def test_samples_without_work_are_ignored_and_the_scale_is_bounded() -> None:
    cal = PrefillCalibration(MODEL, window=4, min_samples=1, bounds=(0.5, 2.0))
    assert not cal.observe(0, 100, 1.0) and not cal.observe(16, 0, 0.0)
    assert cal.samples == 0
    cal.observe(16, 0, 1000.0)
    assert cal.scale == 2.0
    with pytest.raises(ValueError):
        PrefillCalibration(MODEL, window=4, min_samples=5)
    with pytest.raises(ValueError):
        PrefillCalibration(MODEL, bounds=(2.0, 4.0))


def test_the_core_prices_with_the_calibrated_model() -> None:
    config = AdmissionConfig(
        classes=(SloClass("s", ttft_s=100.0, tpot_s=100.0),), default_class="s"
    )
    workers = (
        WorkerView("p:1", Role.prefill, "A", "m", 16),
        WorkerView("d:1", Role.decode, "A", "m", 16),
    )
    request = RequestView("r", 1000, 8, page_tokens=16, page_bytes=1024, prefix=PrefixHit.none())
    plain = RouterCore(build_policy("strata"), Admission(config, model=MODEL), MODEL)
    core = RouterCore(
        build_policy("strata"),
        Admission(config, model=MODEL),
        MODEL,
        calibration=PrefillCalibration(MODEL, min_samples=2),
    )
    assert not plain.observe_prefill(1000, 0, 1.0)  # no calibration: as profiled
    before = core.decide(request, workers, 0.0, random.Random(0))
    core.on_failed("r", 0.0)
    for _ in range(2):
        core.observe_prefill(1000, 0, 2.0 * MODEL.prefill_s(1000, 0))
    after = core.decide(request, workers, 1.0, random.Random(0))
    assert before.predicted_ttft_s == pytest.approx(MODEL.prefill_s(1000, 0))  # type: ignore[union-attr]
    assert after.predicted_ttft_s == pytest.approx(2 * MODEL.prefill_s(1000, 0))  # type: ignore[union-attr]
    # the tracker scores the prediction the caller is told (the calibrated one): on time, 0%;
    # the profile's drift shows in the calibration instead (twice as slow: drifted)
    error = core.on_first_token("r", 1.0 + 2 * MODEL.prefill_s(1000, 0))
    assert error == pytest.approx(0.0)
    assert core.calibration is not None and core.calibration.drifted
    assert not PrefillCalibration(MODEL).drifted  # 1.0 until it has samples
