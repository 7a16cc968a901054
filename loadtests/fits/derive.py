"""Regenerate the shipped time-model fits from published equations: `python -m loadtests.fits.derive`.

Each fit samples the published latency equations on a grid of (new, cached) prompt tokens and
(batch, context) decode shapes and fits Strata's time-model forms to them by least squares (the
router core's `TimeModel.fit`), so the fitted coefficients are derived, not copied, and the JSON
keeps the samples it was fitted on. Sources (equations in milliseconds):

- DistServe (Zhong et al., OSDI'24), repository LLMServe/DistServe,
  simdistserve/estimators/profile_data/profiler-a100-80g.json and
  simdistserve/estimators/time_estimator.py: OPT-13B, tensor parallel 1, A100-80GB:
  prefill = 16.457 + 0.092648 * sum(n) + 6.4748e-6 * sum(n^2) (+1 ms per pipeline stage);
  decode (batch < 95) = 19.935 + 0.00062694 * context + 0.038507 * batch (+1 ms).
  The same repository's profile of vLLM, the co-located system DistServe compares against, on
  the same GPU (simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json, OPT-13B TP1):
  prefill = 23.627 + 0.15055 * sum(n) + 8.6535e-6 * sum(n^2); decode (batch < 95) = 19.563 +
  0.00049411 * context + 0.050606 * batch; the +1 ms per stage kept as in DistServe's own fit.
- Preble (Srivatsa et al., ICLR'25), repository WukLab/preble,
  multi_node/benchmarks/exp_configs/model_equations_numpy.py: Mistral-7B on an A6000 under
  SGLang with FlashInfer: linear part 0.10843 * tokens + 4.21 (>= 384 tokens), a quadratic
  below, 22 ms under 192; attention 1.86e-4 * context + 0.159 (0.32 under 1024); long extends
  1.13e-3 * n + 1.75e-3 * seq + 2.19e-6 * n * seq; all divided by 0.9.
  Llama-3-70B, tensor parallel 2: the repository publishes the prefill equation for A100 (not
  H100): 28.93 + 0.18223 * n + 4.0037e-3 * seq + 2.5505e-6 * n * seq per request. It gives no
  decode equation; decode here is derived from weight reads: 140 GB of fp16 weights over two
  A100s' 2.0 TB/s each at 80% efficiency ≈ 44 ms a step, plus 2 x 80 layers x 8 KV heads x
  128 x 2 bytes = 320 KiB of KV read per context token (≈ 0.1 µs per token at 3.2 TB/s).
- Pulls (all three): not in the sources. Assumed: DRAM same host 20 GB/s (shared memory and a
  copy), remote 25 GB/s (one 200 Gb/s RDMA NIC, as Mooncake's deployments), SSD 3 GB/s same
  host and 2.5 GB/s remote, 0.2 ms fixed per pull.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.router.core import (
    DecodeSample,
    Machine,
    PrefillSample,
    Provenance,
    PullSample,
    Samples,
    TimeModel,
)

HERE = Path(__file__).resolve().parent
NEW = (16, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)
CACHED = (0, 512, 2048, 8192)
BATCH = (1, 2, 4, 8, 16, 32, 64, 90)
CONTEXT_PER_REQUEST = (128, 512, 1024, 2048)
PULL_BW = {("dram", True): 20e9, ("dram", False): 25e9, ("ssd", True): 3e9, ("ssd", False): 2.5e9}


def _distserve_prefill(n: int, c: int) -> float:
    # DistServe's estimator has no cached-prefix term: cached tokens cost nothing extra.
    return (16.456860 + 0.0926475 * n + 6.4747857e-6 * n * n + 1.0) / 1e3


def _distserve_decode(b: int, ctx: int) -> float:
    return (19.934703 + 0.00062694 * ctx + 0.038507 * b + 1.0) / 1e3


def _vllm_opt13b_prefill(n: int, c: int) -> float:
    # vLLM's profile has no cached-prefix term either.
    return (23.627362 + 0.15054561 * n + 8.65348374e-6 * n * n + 1.0) / 1e3


def _vllm_opt13b_decode(b: int, ctx: int) -> float:
    return (19.562534 + 0.00049411206 * ctx + 0.050605718 * b + 1.0) / 1e3


def _mistral_linear(tokens: int) -> float:
    if tokens >= 384:
        return 0.10842571 * tokens + 4.2097771
    if tokens >= 192:
        return -118 + 1.25 * tokens - 2.56e-3 * tokens * tokens
    return 22.0


def _mistral_attention(reqs: int, context: int) -> float:
    if context <= 1024:
        return 0.32
    t = 1.86e-4 * context + 0.159
    if context / reqs <= 1024 and reqs * context <= 32 * 256 * 2048:
        t /= 2
    return t


def _mistral_prefill(n: int, c: int) -> float:
    seq = n + c
    quad = 1.13e-3 * n + 1.75e-3 * seq + 2.19e-6 * n * seq if n * seq > 1024 * 1024 else 0.0
    return (_mistral_linear(n) + _mistral_attention(1, seq) + quad) / 0.9 / 1e3


def _mistral_decode(b: int, ctx: int) -> float:
    return (_mistral_linear(b) + _mistral_attention(b, ctx)) / 0.9 / 1e3


def _llama70_prefill(n: int, c: int) -> float:
    seq = n + c
    return (28.931389 + 0.182233 * n + 4.0036514e-3 * seq + 2.5505007e-6 * n * seq) / 1e3


def _llama70_decode(b: int, ctx: int) -> float:
    step = 140e9 / (2 * 2.0e12 * 0.8)
    kv = ctx * 2 * 80 * 8 * 128 * 2 / (2 * 2.0e12 * 0.8)
    return step + kv + 0.05e-3 * b


def derive(
    name: str,
    prefill: Callable[[int, int], float],
    decode: Callable[[int, int], float],
    note: str,
    device: str,
) -> TimeModel:
    samples = Samples(
        prefill=tuple(PrefillSample(n, c, prefill(n, c)) for n in NEW for c in CACHED),
        decode=tuple(
            DecodeSample(b, b * per, decode(b, b * per))
            for b in BATCH
            for per in CONTEXT_PER_REQUEST
        ),
        pull=tuple(
            PullSample(tier, same, nbytes, 2e-4 + nbytes / bw)
            for (tier, same), bw in PULL_BW.items()
            for nbytes in (1 << 20, 16 << 20, 256 << 20)
        ),
    )
    provenance = Provenance(
        machine=Machine(cpu_model="", cores=0, torch_device=device, hostname="published"),
        checkpoint_path=name,
        created="2026-12-01T00:00:00Z",
        note=note,
    )
    return TimeModel.fit(samples, provenance)


FITS = {
    "distserve_opt13b_a100.json": (
        "facebook/opt-13b",
        _distserve_prefill,
        _distserve_decode,
        "Fitted to DistServe's published OPT-13B TP1 A100-80GB latency equations "
        "(LLMServe/DistServe simdistserve/estimators/profile_data/profiler-a100-80g.json); "
        "pull bandwidths assumed (see loadtests/fits/derive.py).",
        "A100-80GB",
    ),
    "distserve_vllm_opt13b_a100.json": (
        "facebook/opt-13b",
        _vllm_opt13b_prefill,
        _vllm_opt13b_decode,
        "Fitted to DistServe's published profile of vLLM serving OPT-13B TP1 on an A100-80GB, "
        "the co-located baseline of DistServe's comparisons (LLMServe/DistServe "
        "simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json); pull bandwidths "
        "assumed (see loadtests/fits/derive.py).",
        "A100-80GB",
    ),
    "preble_mistral7b_a6000.json": (
        "mistralai/Mistral-7B",
        _mistral_prefill,
        _mistral_decode,
        "Fitted to Preble's published Mistral-7B A6000 SGLang/FlashInfer equations "
        "(WukLab/preble multi_node/benchmarks/exp_configs/model_equations_numpy.py); "
        "pull bandwidths assumed (see loadtests/fits/derive.py).",
        "RTX A6000",
    ),
    "preble_llama3_70b_tp2.json": (
        "meta-llama/Meta-Llama-3-70B",
        _llama70_prefill,
        _llama70_decode,
        "Prefill fitted to Preble's published Llama-3-70B TP2 equation, which the repository "
        "gives for A100 (WukLab/preble model_equations_numpy.py), not H100: an H100 fit was "
        "not found. Decode derived from weight and KV reads at 80% of 2x2.0 TB/s (not "
        "published). Pull bandwidths assumed (see loadtests/fits/derive.py).",
        "2x A100 (TP2)",
    ),
}


def main() -> int:
    for filename, (name, prefill, decode, note, device) in FITS.items():
        model = derive(name, prefill, decode, note, device)
        model.save(HERE / filename)
        print(
            f"{filename}: prefill(512, 0) = {model.prefill_s(512, 0) * 1e3:.1f} ms, "
            f"decode(16, 16k) = {model.decode_step_s(16, 16384) * 1e3:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
