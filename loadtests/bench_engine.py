"""`strata bench engine`: time to first token with and without the store, and decode throughput.

A `small`-preset checkpoint (written to a temporary folder, or `--model PATH`) serves one long
prompt (2048 tokens by default) against a store daemon in its own process (DRAM + SSD tiers, on
loopback, port 0, in a temporary folder). In one run, each several times (median and p90):

1. TTFT with no cache: the whole prompt computed (`use_cache=False`, nothing published);
2. TTFT with a full prefix hit from DRAM: the pages a previous prefill published;
3. TTFT with a full prefix hit from SSD: the same payloads put with `tier=SSD` under a fresh
   namespace per repetition (a read promotes a page to DRAM, so a scope serves one cold read),
   then the daemon is restarted on the same folder (its DRAM is empty, RocksDB's memtables are
   flushed to blob files, the index is rebuilt from the SSD headers) and, where allowed, the OS
   page cache is dropped;
4. decode tokens/s at batch 1 and the larger batches (8 and 32 by default): a DecodeWorker
   pulls the prompt's pages and produces `--new-tokens` greedy tokens per request; interleaved
   with each repetition, at the same batch and the prompt's context, the reference steps of
   `loadtests.engine_steps`: the model's decode step alone (as the worker calls it), the same
   step gathering pages each step, and a dense-attention step over the same weights and GQA
   shapes (the memory-bound limit: weights and every sequence's K/V read once a step).

TTFT is the prefill's arrival to its first token sampled (`total_s - publish_wait_s`). Every hit
must give the no-cache first token and hit exactly the prompt's full pages, or the run fails.
Prints a table with ratios (hit / no-cache TTFT, batch N / batch 1 throughput, the worker against
the model step and the dense step) against the targets (a full DRAM hit at most 1/5 of
recomputation, and 1/31; the worker at batch 1 at least 0.8 of the model step; the worker at the
larger batches at least 0.7 of the dense step; the model step at batch 8 within 1.5x of the
dense step); `--json PATH` writes it all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from client import StoreClient, Tier, build_pages, page_keys, page_tokens
from engine.prefill import PrefillWorker
from engine.presets import PRESET_NAMES, init_checkpoint
from engine.requests import PrefillResult
from engine.runtime import ModelRuntime
from loadtests.bench_engine_decode import (
    BenchFailed,
    Decode,
    DecodeOptions,
    Stat,
    StepRates,
    measure_decode,
    progress,
)
from loadtests.bench_store import drop_page_cache
from loadtests.daemon import DaemonProcess

TARGET_DRAM_RATIO = 0.2  # a full DRAM hit: TTFT at most 1/5 of recomputing the prompt
TARGET_DRAM_RATIO_NOW = 1 / 31  # and no worse than it was when decode batching was built
TARGET_WORKER_TO_MODEL_STEP = 0.8  # batch 1: the worker's loop costs little over the model
TARGET_WORKER_TO_DENSE = 0.7  # larger batches: the worker near the memory-bound step
TARGET_MODEL_STEP_TO_DENSE = 1 / 1.5  # batch 8: paged attention within 1.5x of dense
DRAM_NAMESPACE = "bench-dram"
SSD_METHOD = (
    "pages put with tier=SSD under a fresh namespace per repetition, then the daemon restarted "
    "on the same folder (DRAM empty, memtables flushed, index rebuilt from SSD headers)"
)


@dataclass(frozen=True, slots=True)
class Ttft:
    """One TTFT measurement: where the prompt's KV came from, and how each phase went."""

    name: str
    source: str
    ttft: Stat
    lookup_pull_median_s: float
    compute_median_s: float
    hit_tokens: int
    computed_tokens: int
    first_token: int


@dataclass(frozen=True, slots=True)
class Target:
    """One target: `value` against `bound` (at least it, or at most it with `at_most`)."""

    name: str
    value: float
    bound: float
    at_most: bool
    met: bool

    @classmethod
    def at_least(cls, name: str, value: float, bound: float) -> Target:
        return cls(name, value, bound, False, value >= bound)

    @classmethod
    def no_more(cls, name: str, value: float, bound: float) -> Target:
        return cls(name, value, bound, True, value <= bound)


@dataclass(frozen=True, slots=True)
class Ratios:
    dram_hit_over_no_cache: float
    ssd_hit_over_no_cache: float
    batch_over_batch_1: float
    dram_target: float
    dram_target_met: bool


@dataclass(frozen=True, slots=True)
class EngineBench:
    model: str
    num_params: int
    device: str
    torch_threads: int
    prompt_tokens: int
    page_tokens: int
    full_pages: int
    repetitions: int
    ssd_method: str
    page_cache_dropped: bool
    ttft: tuple[Ttft, ...]
    decode: tuple[Decode, ...]
    steps: tuple[StepRates, ...]
    ratios: Ratios
    targets: tuple[Target, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class Options:
    prompt_tokens: int = 2048
    reps: int = 5
    decode_reps: int = 3
    new_tokens: int = 64
    batches: tuple[int, ...] = (8, 32)
    page_tokens: int = 16
    chunk_tokens: int = 256
    seed: int = 0
    reference_steps: int = 5  # calls of each reference step per decode repetition


DEFAULTS = Options()


def prompt_ids(vocab_size: int, count: int, seed: int) -> list[int]:
    """`count` deterministic pseudo-random token ids (a prompt with no repeated structure)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=gen).tolist()


def ttft_s(result: PrefillResult) -> float:
    """Arrival to first token sampled (the publish wait after it is not part of TTFT)."""
    return result.timings.total_s - result.timings.publish_wait_s


def _ttft(name: str, source: str, results: list[PrefillResult]) -> Ttft:
    last = results[-1]
    return Ttft(
        name=name,
        source=source,
        ttft=Stat.of([ttft_s(r) for r in results]),
        lookup_pull_median_s=statistics.median(
            r.timings.lookup_s + r.timings.pull_s for r in results
        ),
        compute_median_s=statistics.median(r.timings.compute_s for r in results),
        hit_tokens=last.hit_tokens.total,
        computed_tokens=last.computed_tokens,
        first_token=last.first_token,
    )


def _check_hit(what: str, result: PrefillResult, tier_tokens: int, want: int, first: int) -> None:
    if result.first_token != first:
        raise BenchFailed(
            f"{what}: first token {result.first_token} differs from the no-cache first token "
            f"{first}: the store served KV that is not the prompt's"
        )
    if tier_tokens != want or result.hit_tokens.total != want:
        raise BenchFailed(
            f"{what}: hit {result.hit_tokens} tokens; the prompt's full pages are {want} tokens"
        )


def measure_prefill(
    runtime: ModelRuntime, client: StoreClient, ids: list[int], opts: Options
) -> tuple[Ttft, Ttft]:
    """No-cache and DRAM-hit TTFT; leaves the prompt's pages published under DRAM_NAMESPACE."""
    full_tokens = len(ids) // opts.page_tokens * opts.page_tokens
    publisher = PrefillWorker(
        runtime, client, chunk_tokens=opts.chunk_tokens, publish_timeout_s=120
    )
    plain = PrefillWorker(runtime, client, chunk_tokens=opts.chunk_tokens, publish=False)
    try:
        progress(f"prefill {len(ids)} tokens, no cache, publishing (warm-up) …")
        first = publisher.prefill(ids, namespace=DRAM_NAMESPACE, use_cache=False)
        if first.published_pages != full_tokens // opts.page_tokens:
            raise BenchFailed(
                f"published {first.published_pages} of {full_tokens // opts.page_tokens} pages"
            )
        no_cache = []
        for rep in range(opts.reps):
            no_cache.append(plain.prefill(ids, use_cache=False))
            progress(f"no cache {rep + 1}/{opts.reps}: {ttft_s(no_cache[-1]) * 1e3:.0f} ms")
            if no_cache[-1].first_token != first.first_token:
                raise BenchFailed("the no-cache first token changed between repetitions")
        hits = []
        for rep in range(opts.reps):
            hit = publisher.prefill(ids, namespace=DRAM_NAMESPACE)
            _check_hit("DRAM hit", hit, hit.hit_tokens.dram, full_tokens, first.first_token)
            hits.append(hit)
            progress(f"DRAM hit {rep + 1}/{opts.reps}: {ttft_s(hit) * 1e3:.1f} ms")
    finally:
        publisher.close()
        plain.close()
    return (
        _ttft("TTFT no cache", "recomputed", no_cache),
        _ttft("TTFT full hit, DRAM", "DRAM tier", hits),
    )


def targets(ratios: Ratios, steps: Sequence[StepRates]) -> tuple[Target, ...]:
    """The targets of issue-level decode batching and TTFT, from the measured ratios."""
    out = [
        Target.no_more(
            "TTFT full DRAM hit / no cache", ratios.dram_hit_over_no_cache, TARGET_DRAM_RATIO_NOW
        )
    ]
    for s in steps:
        if s.batch == 1:
            out.append(
                Target.at_least(
                    "worker / model step, batch 1",
                    s.worker_to_model_step_ratio,
                    TARGET_WORKER_TO_MODEL_STEP,
                )
            )
            continue
        out.append(
            Target.at_least(
                f"worker / dense step, batch {s.batch}",
                s.worker_to_dense_ratio,
                TARGET_WORKER_TO_DENSE,
            )
        )
        out.append(
            Target.at_least(
                f"steady worker / dense step, batch {s.batch}",
                s.worker_steady_to_dense_ratio,
                TARGET_WORKER_TO_DENSE,
            )
        )
    paged = next((s for s in steps if s.batch == 8), None)
    paged = paged or next((s for s in steps if s.batch > 1), None)
    if paged is not None:
        out.append(
            Target.at_least(
                f"model step / dense step, batch {paged.batch}",
                paged.model_step_to_dense_ratio,
                TARGET_MODEL_STEP_TO_DENSE,
            )
        )
    return tuple(out)


def stage_ssd(client: StoreClient, runtime: ModelRuntime, ids: list[int], opts: Options) -> None:
    """Put the prompt's DRAM pages again, tier SSD, under one fresh namespace per repetition."""
    source = runtime.scope(DRAM_NAMESPACE)
    keys = page_keys(source, ids)
    size = runtime.new_pool(1).page_payload_bytes
    payloads = [bytearray(size) for _ in keys]
    got = client.get(source, keys, payloads, tokens=page_tokens(source, ids))
    if got.hit_count != len(keys):
        raise BenchFailed(f"the store gave {got.hit_count} of {len(keys)} published pages")
    for rep in range(opts.reps):
        scope = runtime.scope(f"bench-ssd-{rep}")
        pages = build_pages(scope, ids, payloads)
        client.put(scope, pages, tier=Tier.SSD)
        tiers = client.lookup(scope, [p.header.key for p in pages]).tiers
        if len(tiers) != len(pages) or any(t is not Tier.SSD for t in tiers):
            raise BenchFailed(f"SSD staging: pages landed in tiers {sorted(set(tiers))}")


def measure_ssd(
    runtime: ModelRuntime, client: StoreClient, ids: list[int], first: int, opts: Options
) -> Ttft:
    full_tokens = len(ids) // opts.page_tokens * opts.page_tokens
    worker = PrefillWorker(runtime, client, chunk_tokens=opts.chunk_tokens, publish=False)
    hits = []
    try:
        for rep in range(opts.reps):
            hit = worker.prefill(ids, namespace=f"bench-ssd-{rep}")
            _check_hit("SSD hit", hit, hit.hit_tokens.ssd, full_tokens, first)
            hits.append(hit)
            progress(f"SSD hit {rep + 1}/{opts.reps}: {ttft_s(hit) * 1e3:.1f} ms")
    finally:
        worker.close()
    return _ttft("TTFT full hit, SSD", "SSD tier (RocksDB), after restart", hits)


def run(
    model: Path,
    data_dir: Path,
    opts: Options,
    device: str = "cpu",
    *,
    label: str = "",
    num_params: int = 0,
) -> EngineBench:
    """Every measurement, against daemons on `data_dir` (started and stopped here). `label`
    names the model in the results (default: its folder)."""
    began = time.perf_counter()
    limit = opts.prompt_tokens + opts.new_tokens + opts.page_tokens
    runtime = ModelRuntime(model, page_tokens=opts.page_tokens, max_context=limit, device=device)
    if opts.prompt_tokens < opts.page_tokens or runtime.max_context < limit:
        raise ValueError(
            f"{opts.prompt_tokens} prompt tokens: need at least one page ({opts.page_tokens}) "
            f"and room for the new tokens in the model's context ({runtime.max_context})"
        )
    ids = prompt_ids(runtime.vocab_size, opts.prompt_tokens, opts.seed)
    with DaemonProcess(data_dir, dram="2GiB", ssd="4GiB") as daemon:
        progress(f"store daemon pid {daemon.pid} on {daemon.address}")
        with StoreClient(daemon.address, timeout_s=60) as client:
            no_cache, dram = measure_prefill(runtime, client, ids, opts)
            decode, steps = measure_decode(
                runtime,
                client,
                ids,
                no_cache.first_token,
                DecodeOptions(
                    namespace=DRAM_NAMESPACE,
                    batches=opts.batches,
                    new_tokens=opts.new_tokens,
                    decode_reps=opts.decode_reps,
                    reference_steps=opts.reference_steps,
                    chunk_tokens=opts.chunk_tokens,
                    seed=opts.seed,
                ),
            )
            progress(f"staging {opts.reps} SSD copies of the prompt's pages …")
            stage_ssd(client, runtime, ids, opts)
    with DaemonProcess(data_dir, dram="2GiB", ssd="4GiB") as daemon:
        dropped = drop_page_cache()
        progress(f"daemon restarted, pid {daemon.pid}; page cache dropped: {dropped}")
        with StoreClient(daemon.address, timeout_s=60) as client:
            ssd = measure_ssd(runtime, client, ids, no_cache.first_token, opts)
    base = no_cache.ttft.median_s
    by_batch = {d.batch: d.tokens_per_s_median for d in decode}
    ratios = Ratios(
        dram_hit_over_no_cache=dram.ttft.median_s / base,
        ssd_hit_over_no_cache=ssd.ttft.median_s / base,
        batch_over_batch_1=by_batch[max(by_batch)] / by_batch[1] if by_batch[1] else 0.0,
        dram_target=TARGET_DRAM_RATIO,
        dram_target_met=dram.ttft.median_s <= TARGET_DRAM_RATIO * base,
    )
    return EngineBench(
        model=label or str(model),
        num_params=num_params or sum(t.numel() for t in runtime.model.state_dict().values()),
        device=str(runtime.device),
        torch_threads=torch.get_num_threads(),
        prompt_tokens=len(ids),
        page_tokens=opts.page_tokens,
        full_pages=len(ids) // opts.page_tokens,
        repetitions=opts.reps,
        ssd_method=SSD_METHOD,
        page_cache_dropped=dropped,
        ttft=(no_cache, dram, ssd),
        decode=decode,
        steps=steps,
        ratios=ratios,
        targets=targets(ratios, steps),
        seconds=time.perf_counter() - began,
    )


def print_table(bench: EngineBench) -> None:
    r = bench.ratios
    print(
        f"{'measurement':<30} {'median':>11} {'p90':>11} {'x no-cache':>10} "
        f"{'hit tok':>8} {'computed':>8}"
    )
    ratios = (1.0, r.dram_hit_over_no_cache, r.ssd_hit_over_no_cache)
    for t, ratio in zip(bench.ttft, ratios, strict=True):
        print(
            f"{t.name:<30} {t.ttft.median_s * 1e3:>8.1f} ms {t.ttft.p90_s * 1e3:>8.1f} ms "
            f"{ratio:>10.3f} {t.hit_tokens:>8} {t.computed_tokens:>8}"
        )
    print(
        f"\n{'decode (greedy)':<30} {'tok/s':>11} {'p90 tok/s':>11} {'x batch 1':>10} "
        f"{'e2e tok/s':>10}"
    )
    one = next(d.tokens_per_s_median for d in bench.decode if d.batch == 1)
    for d in bench.decode:
        print(
            f"{f'batch {d.batch} x {d.new_tokens_per_request} tokens':<30} "
            f"{d.tokens_per_s_median:>11.1f} {d.tokens_per_s_p90:>11.1f} "
            f"{d.tokens_per_s_median / one if one else 0.0:>10.2f} "
            f"{d.end_to_end_tokens_per_s_median:>10.1f}"
        )
    verdict = "met" if r.dram_target_met else "NOT met"
    print(
        f"\ntarget: full DRAM hit TTFT <= {r.dram_target:.2f} x no-cache: {verdict} "
        f"({r.dram_hit_over_no_cache:.3f}, i.e. 1/{1 / r.dram_hit_over_no_cache:.1f})"
    )
    print(f"SSD hit: {bench.ssd_method}; OS page cache dropped: {bench.page_cache_dropped}")
    same = all(d.same_tokens_as_batch_1 for d in bench.decode)
    print(f"decode: every request gave the same tokens at every batch size: {same}")
    context = bench.steps[0].context_tokens if bench.steps else 0
    print(
        f"\n{f'decode tok/s, context {context}':<22} {'worker':>7} {'steady':>7} {'model':>7} "
        f"{'gathered':>8} {'dense':>7} {'w/model':>7} {'w/dense':>7} {'s/dense':>7} "
        f"{'m/dense':>7} {'g/dense':>7}"
    )
    for st in bench.steps:
        print(
            f"{f'batch {st.batch}':<22} {st.worker_tokens_per_s:>7.1f} "
            f"{st.worker_steady_tokens_per_s:>7.1f} {st.model_step_tokens_per_s:>7.1f} "
            f"{st.gathered_step_tokens_per_s:>8.1f} {st.dense_step_tokens_per_s:>7.1f} "
            f"{st.worker_to_model_step_ratio:>7.2f} {st.worker_to_dense_ratio:>7.2f} "
            f"{st.worker_steady_to_dense_ratio:>7.2f} {st.model_step_to_dense_ratio:>7.2f} "
            f"{st.gathered_step_to_dense_ratio:>7.2f}"
        )
    print(
        "worker: from the first request's first step (later requests' pulls included); steady: "
        "while the whole batch decoded;\nmodel: the model's decode_step alone, as the worker "
        "runs it; gathered: the same step gathering pages each step;\ndense: the same weights "
        "over contiguous K/V (the memory-bound limit); ratios of tokens/s, paired by repetition"
    )
    for target in bench.targets:
        sign = "<=" if target.at_most else ">="
        print(
            f"target: {target.name} {sign} {target.bound:.3f}: "
            f"{'met' if target.met else 'NOT met'} ({target.value:.3f})"
        )


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh --preset one)")
    p.add_argument("--preset", default="small", choices=PRESET_NAMES, help="default small")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULTS.prompt_tokens)
    p.add_argument("--reps", type=int, default=DEFAULTS.reps, help="repetitions per TTFT")
    p.add_argument("--decode-reps", type=int, default=DEFAULTS.decode_reps)
    p.add_argument("--new-tokens", type=int, default=DEFAULTS.new_tokens, help="per decode request")
    p.add_argument(
        "--batch",
        type=_batches,
        default=DEFAULTS.batches,
        help="the larger decode batches, comma-separated (default 8,32; batch 1 always runs)",
    )
    p.add_argument(
        "--reference-steps",
        type=int,
        default=DEFAULTS.reference_steps,
        help="calls of each reference step per decode repetition",
    )
    p.add_argument("--page-tokens", type=int, default=DEFAULTS.page_tokens)
    p.add_argument("--chunk-tokens", type=int, default=DEFAULTS.chunk_tokens)
    p.add_argument("--device", default="cpu", help="torch device of the model (default cpu)")
    p.add_argument("--dir", type=Path, help="daemon state folder (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the results here")
    ns = p.parse_args(argv)
    if min(ns.reps, ns.decode_reps, ns.new_tokens, ns.reference_steps, *ns.batch) < 1:
        p.error(
            "--reps, --decode-reps, --new-tokens, --reference-steps and --batch must be at least 1"
        )
    if ns.prompt_tokens < ns.page_tokens:
        p.error(f"--prompt-tokens must be at least one page ({ns.page_tokens} tokens)")
    opts = Options(
        prompt_tokens=ns.prompt_tokens, reps=ns.reps, decode_reps=ns.decode_reps,
        new_tokens=ns.new_tokens, batches=ns.batch, page_tokens=ns.page_tokens,
        reference_steps=ns.reference_steps,
        chunk_tokens=ns.chunk_tokens,
    )
    scratch = Path(tempfile.mkdtemp(prefix="strata-bench-engine-"))
    try:
        model, num_params, label = ns.model, 0, ""
        if model is None:
            label = f"{ns.preset} preset (seed 0)"
            model = scratch / f"model-{ns.preset}"
            print(f"strata bench engine: writing the {ns.preset} preset to {model}",
                  file=sys.stderr)
            num_params = init_checkpoint(model, ns.preset, seed=0).num_params
        data_dir = ns.dir or scratch / "store"
        print(f"strata bench engine: store daemon in its own process, state in {data_dir}",
              file=sys.stderr, flush=True)
        try:
            bench = run(model, data_dir, opts, ns.device, label=label, num_params=num_params)
        except BenchFailed as exc:
            print(f"strata bench engine: FAILED: {exc}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\n{bench.model}: {bench.num_params / 1e6:.1f}M params "
        f"on {bench.device} ({bench.torch_threads} threads); prompt {bench.prompt_tokens} tokens "
        f"= {bench.full_pages} full pages of {bench.page_tokens}; {bench.repetitions} reps; "
        f"{bench.seconds:.0f} s\n"
    )
    print_table(bench)
    if ns.json:
        args = list(argv) if argv is not None else sys.argv[1:]
        command = " ".join(["strata", "bench", "engine", *args])
        ns.json.write_text(json.dumps({"command": command, **asdict(bench)}, indent=2) + "\n")
        print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
