"""The time model: its forms, the least-squares fit (recovers known coefficients), JSON round trip."""

from __future__ import annotations

import json
import random

import pytest

from engine.router.core.fit import fit_quality
from engine.router.core.lstsq import SingularFit, nonnegative_least_squares
from engine.router.core.timemodel import (
    DecodeCoeffs,
    DecodeSample,
    Machine,
    PrefillCoeffs,
    PrefillSample,
    Provenance,
    PullCoeffs,
    PullSample,
    Samples,
    TimeModel,
)

pytestmark = pytest.mark.unit

TRUE = TimeModel(
    prefill=PrefillCoeffs(
        fixed_s=0.004, per_token_s=2e-5, per_cached_token_s=1e-6, attention_s=3e-9
    ),
    decode=DecodeCoeffs(fixed_s=0.006, per_request_s=4e-4, per_context_token_s=2e-7),
    pulls=(
        PullCoeffs("dram", True, 1e-4, 1 / 5e9),
        PullCoeffs("dram", False, 8e-4, 1 / 1e9),
        PullCoeffs("ssd", True, 3e-4, 1 / 1.5e9),
    ),
)


def synthetic(model: TimeModel, noise: float, rng: random.Random) -> Samples:
    def jitter(x: float) -> float:
        return x * (1.0 + rng.uniform(-noise, noise))

    prefill = tuple(
        PrefillSample(n, c, jitter(model.prefill_s(n, c)))
        for n in (16, 64, 256, 1024, 2048)
        for c in (0, 256, 1024, 4096)
    )
    decode = tuple(
        DecodeSample(b, b * ctx, jitter(model.decode_step_s(b, b * ctx)))
        for b in (1, 2, 4, 8, 16, 32)
        for ctx in (128, 1024, 4096)
    )
    pull = tuple(
        PullSample(p.tier, p.same_host, n, jitter(model.pull_s(n, p.tier, p.same_host)))
        for p in model.pulls
        for n in (1 << 16, 1 << 20, 1 << 24, 1 << 26)
    )
    return Samples(prefill, decode, pull)


def test_forms() -> None:
    assert TRUE.prefill_s(0, 500) == 0.0
    assert TRUE.decode_step_s(0, 0) == 0.0
    assert TRUE.pull_s(0, "dram", True) == 0.0
    # attention makes prefill superlinear in new tokens and dearer after a longer cached prefix
    fixed = TRUE.prefill.fixed_s
    assert TRUE.prefill_s(2000, 0) - fixed > 2 * (TRUE.prefill_s(1000, 0) - fixed)
    assert TRUE.prefill_s(1000, 4000) > TRUE.prefill_s(1000, 0)
    assert TRUE.decode_step_s(8, 8000) > TRUE.decode_step_s(4, 8000) > TRUE.decode_step_s(4, 4000)
    assert TRUE.pull_s(1 << 20, "dram", False) > TRUE.pull_s(1 << 20, "dram", True)


def test_unprofiled_path_priced_as_the_slowest_known() -> None:
    # ssd remote was never profiled: priced as the slowest path of that tier (ssd same-host)
    assert TRUE.pull_s(1 << 20, "ssd", False) == TRUE.pull_s(1 << 20, "ssd", True)
    # gpu was never profiled at all: priced as the slowest path of any tier (dram remote)
    assert TRUE.pull_s(1 << 20, "gpu", True) == TRUE.pull_s(1 << 20, "dram", False)
    bare = TimeModel(TRUE.prefill, TRUE.decode)
    assert bare.pull_s(1 << 20, "dram", False) == 0.0


def test_queue_drain_matches_equal_requests() -> None:
    one = TRUE.prefill_s(500, 0)
    assert TRUE.queue_drain_s(2000, 4) == pytest.approx(4 * one)
    assert TRUE.queue_drain_s(0, 0) == 0.0


def test_fit_recovers_exact_coefficients() -> None:
    fitted = TimeModel.fit(synthetic(TRUE, 0.0, random.Random(1)))
    for got, want in (
        (fitted.prefill.fixed_s, TRUE.prefill.fixed_s),
        (fitted.prefill.per_token_s, TRUE.prefill.per_token_s),
        (fitted.prefill.per_cached_token_s, TRUE.prefill.per_cached_token_s),
        (fitted.prefill.attention_s, TRUE.prefill.attention_s),
        (fitted.decode.fixed_s, TRUE.decode.fixed_s),
        (fitted.decode.per_request_s, TRUE.decode.per_request_s),
        (fitted.decode.per_context_token_s, TRUE.decode.per_context_token_s),
    ):
        assert got == pytest.approx(want, rel=1e-6)
    for want in TRUE.pulls:
        got = fitted.pull_coeffs(want.tier, want.same_host)
        assert got is not None and (got.tier, got.same_host) == (want.tier, want.same_host)
        assert got.fixed_s == pytest.approx(want.fixed_s, rel=1e-6)
        assert got.s_per_byte == pytest.approx(want.s_per_byte, rel=1e-6)


def test_fit_with_noise_predicts_within_the_noise() -> None:
    samples = synthetic(TRUE, 0.05, random.Random(2))
    fitted = TimeModel.fit(samples)
    quality = fit_quality(fitted)
    assert quality.prefill_median < 0.05 and quality.prefill_max < 0.15
    assert quality.decode_median < 0.05 and quality.decode_max < 0.15
    assert quality.pull_median < 0.05
    # and against the noise-free truth
    truth = fit_quality(fitted, synthetic(TRUE, 0.0, random.Random(3)))
    assert truth.prefill_max < 0.1 and truth.decode_max < 0.1


def test_fit_keeps_coefficients_non_negative() -> None:
    # a flat decode (no dependence on context) with noise would give a slightly negative slope
    rng = random.Random(4)
    samples = Samples(
        prefill=synthetic(TRUE, 0.0, rng).prefill,
        decode=tuple(
            DecodeSample(b, ctx, 0.01 * (1 + rng.uniform(-0.02, 0.02)))
            for b in (1, 2, 4)
            for ctx in (100, 1000, 10000)
        ),
    )
    fitted = TimeModel.fit(samples)
    assert (
        min(fitted.decode.fixed_s, fitted.decode.per_request_s, fitted.decode.per_context_token_s)
        >= 0
    )
    assert fitted.decode_step_s(2, 1000) == pytest.approx(0.01, rel=0.03)


def test_fit_needs_prefill_and_decode() -> None:
    with pytest.raises(ValueError, match="prefill"):
        TimeModel.fit(Samples(decode=synthetic(TRUE, 0, random.Random(5)).decode))
    with pytest.raises(SingularFit):
        nonnegative_least_squares([(1.0, 2.0)], [1.0])
    with pytest.raises(SingularFit):
        nonnegative_least_squares([(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)], [1.0, 2.0, 3.0])


def test_json_round_trip_keeps_provenance_and_samples(tmp_path) -> None:
    prov = Provenance(
        machine=Machine(cpu_model="Test CPU", cores=2, torch_device="cpu", hostname="h"),
        checkpoint_path="/models/tiny",
        checkpoint_fingerprint="abc123",
        created="2026-12-01T15:00:00Z",
        store="127.0.0.1:7000",
    )
    fitted = TimeModel.fit(synthetic(TRUE, 0.01, random.Random(6)), prov)
    path = tmp_path / "sub" / "model.json"
    fitted.save(path)
    loaded = TimeModel.load(path)
    assert loaded == fitted
    data = json.loads(path.read_text())
    assert data["format"] == "strata-timemodel" and data["version"] == 1
    assert data["provenance"]["machine"]["cpu_model"] == "Test CPU"
    assert data["provenance"]["checkpoint_fingerprint"] == "abc123"
    assert len(data["samples"]["prefill"]) == len(fitted.samples.prefill)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[]", "object"),
        ("not json", "not JSON"),
        ('{"format": "other"}', "not a time model"),
        ('{"format": "strata-timemodel", "version": 99}', "version"),
        ('{"format": "strata-timemodel", "version": 1, "prefill": {"fixed_s": 1}}', "malformed"),
        (
            '{"format": "strata-timemodel", "version": 1, "prefill": {"fixed_s": "fast", '
            '"per_token_s": 0, "per_cached_token_s": 0, "attention_s": 0}}',
            "expected float",
        ),
        (
            '{"format": "strata-timemodel", "version": 1, "prefill": {"fixed_s": 0, '
            '"per_token_s": 0, "per_cached_token_s": 0, "attention_s": 0, "extra": 1}}',
            "unknown keys",
        ),
    ],
)
def test_bad_json_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TimeModel.from_json(text)


def test_unknown_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="tier"):
        PullCoeffs("tape", True, 0.0, 1e-9)
