"""The measurements behind `strata profile`: a worker's prefill, decode steps and pulls, timed here.

Each measurement runs the engine's own code the way its workers do, on this machine:

- prefill: `DecoderModel.forward` over the new tokens in the worker's chunks, after `cached`
  tokens already in the pool (their K/V are whatever the pool holds: attention costs the same),
  one point per (new, cached) of the grid; the fastest of `reps` runs after a warm-up.
- decode: one step of a batch of `batch` sequences of `context` tokens each, through
  `decode_step` with the contiguous K/V rows the scheduler uses on the torch backend (paged
  attention where the scheduler would use it), including sampling the next tokens by argmax;
  the fastest of `steps` steps.
- pulls: `StoreLink.pull` (lookup, get, verify, into pool pages: what a prefill pays) of
  `pages` pages put beforehand, per tier the store has (DRAM; SSD when configured, fresh pages
  per repetition since a read promotes a page to DRAM) and per path (same host over shared
  memory, when the daemon is on this host; remote over the network data path the client picks).

Every point keeps the fastest of its repetitions: on a machine shared with other work, the
slower ones measure the neighbours, not the model (the router's prediction tracker shows how
far live timings drift from the profile). Nothing here fits: it returns samples
(engine/router/core/fit.py fits them).
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from client import IoClass, Scope, StoreClient, StrataError, Tier, build_pages, page_keys
from engine.kernels.backend import select_backend
from engine.kv_rows import KVRows
from engine.router.core.timemodel import DecodeSample, PrefillSample, PullSample
from engine.runtime import ModelRuntime
from engine.store_link import StoreLink

Progress = Callable[[str], None]
MIN_POINT_S = 0.1  # a point is repeated until this much time went into it (short ones get more)
MAX_REPS = 24


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure: prefill at each (new, cached), decode at each (batch, context per
    sequence), pulls of each page count; with repetitions (medians are kept)."""

    prefill_new: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    pull_pages: tuple[int, ...]
    reps: int
    decode_steps: int
    chunk_tokens: int = 256

    @property
    def max_context(self) -> int:
        return max(
            max(self.prefill_new) + max(self.prefill_cached),
            max(self.decode_context) + MAX_REPS + 2,
        )


QUICK = Grid(
    prefill_new=(16, 64, 256, 512),
    prefill_cached=(0, 512, 1536),
    decode_batch=(1, 4, 12),
    decode_context=(64, 512, 1536),
    pull_pages=(1, 8, 32),
    reps=3,
    decode_steps=4,
)
FULL = Grid(
    prefill_new=(16, 64, 256, 512, 1024, 2048),
    prefill_cached=(0, 512, 2048, 4096),
    decode_batch=(1, 2, 4, 8, 16, 32),
    decode_context=(64, 512, 2048),
    pull_pages=(1, 4, 16, 64, 128),
    reps=3,
    decode_steps=5,
)


def _quiet(message: str) -> None:
    del message


def _fastest(run: Callable[[], float], reps: int) -> float:
    """The fastest of at least `reps` runs, more while they add up to under MIN_POINT_S."""
    times = [run() for _ in range(reps)]
    while sum(times) < MIN_POINT_S and len(times) < MAX_REPS:
        times.append(run())
    return min(times)


def measure_prefill(
    runtime: ModelRuntime, grid: Grid, progress: Progress = _quiet
) -> tuple[PrefillSample, ...]:
    page = runtime.page_tokens
    most = max(grid.prefill_new) + max(grid.prefill_cached)
    pool = runtime.new_pool(-(-most // page))
    table = list(range(pool.pages_for(most)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runtime.vocab_size, (most,), generator=gen)

    def once(new: int, cached: int) -> float:
        began = time.perf_counter()
        logits = None
        for start in range(cached, cached + new, grid.chunk_tokens):
            end = min(cached + new, start + grid.chunk_tokens)
            logits = runtime.model.forward(ids[start:end], None, pool, table, start)
        assert logits is not None
        int(torch.argmax(logits))
        runtime.synchronize()
        return time.perf_counter() - began

    once(min(grid.prefill_new), 0)  # warm-up
    out: list[PrefillSample] = []
    points = [(n, c) for c in grid.prefill_cached for n in grid.prefill_new]
    for i, (new, cached) in enumerate(points):
        seconds = _fastest(functools.partial(once, new, cached), grid.reps)
        out.append(PrefillSample(new, cached, seconds))
        progress(
            f"prefill {i + 1}/{len(points)}: {new} new after {cached} cached: {seconds * 1e3:.1f} ms"
        )
    return tuple(out)


class _DecodeBatch:
    """`batch` sequences of `context` tokens on a pool of their own, stepped as the scheduler
    steps them (through the contiguous rows on the torch backend)."""

    def __init__(self, runtime: ModelRuntime, batch: int, context: int, seed: int) -> None:
        page = runtime.page_tokens
        per_seq = -(-(context + MAX_REPS + 2) // page)
        self.runtime = runtime
        self.pool = runtime.new_pool(batch * per_seq)
        self.tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
        use_rows = select_backend(None, runtime.device) == "torch"
        self.rows = (
            KVRows(self.pool, max_rows=batch, max_tokens=per_seq * page) if use_rows else None
        )
        self.attached = (
            [self.rows.attach(per_seq * page) for _ in range(batch)] if self.rows else []
        )
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, runtime.vocab_size, (batch,), generator=gen)
        self.lengths = [context] * batch

    def step(self) -> float:
        """One decode step with argmax sampling; returns its seconds."""
        began = time.perf_counter()
        rows = self.rows
        plan = rows.prepare(self.attached, self.tables, self.lengths) if rows is not None else None
        logits = self.runtime.model.decode_step(
            self.tokens, None, self.pool, self.tables, self.lengths, rows=plan
        )
        self.tokens = torch.argmax(logits, dim=-1)
        self.runtime.synchronize()
        self.lengths = [n + 1 for n in self.lengths]
        return time.perf_counter() - began


def measure_decode(
    runtime: ModelRuntime, grid: Grid, progress: Progress = _quiet
) -> tuple[DecodeSample, ...]:
    out: list[DecodeSample] = []
    points = [(b, c) for c in grid.decode_context for b in grid.decode_batch]
    for i, (batch, context) in enumerate(points):
        bench = _DecodeBatch(runtime, batch, context, seed=i)
        bench.step()  # the warm-up: the rows copy their sequences' pages in
        seconds = _fastest(bench.step, grid.decode_steps)
        out.append(DecodeSample(batch, batch * context, seconds))
        progress(
            f"decode {i + 1}/{len(points)}: batch {batch} x {context} context: "
            f"{seconds * 1e3:.2f} ms/step"
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PullPaths:
    """How the pull measurements went: which paths and tiers were measured, over what."""

    same_host: bool
    remote_transport: str
    tiers: tuple[str, ...]


def _store_tiers(client: StoreClient) -> tuple[Tier, ...]:
    info = client.node_info()
    have = {t.tier for t in info.tiers if t.capacity_bytes > 0}
    return tuple(t for t in (Tier.DRAM, Tier.SSD) if t in have)


def measure_pulls(
    runtime: ModelRuntime, store: str, grid: Grid, progress: Progress = _quiet
) -> tuple[tuple[PullSample, ...], PullPaths]:
    """Pull timings from the daemon at `store`, same-host (if possible) and remote."""
    samples: list[PullSample] = []
    same_host_ok = False
    remote_transport = ""
    tiers: tuple[Tier, ...] = ()
    for same_host in (True, False):
        try:
            client = StoreClient(store, shared_memory=same_host, timeout_s=60)
            client.connect()
        except StrataError as exc:  # an unusable path is reported, not fatal
            progress(f"pull: {'same-host' if same_host else 'remote'} path unavailable: {exc}")
            continue
        with client:
            if same_host:
                same_host_ok = True
            else:
                remote_transport = client.transport
            tiers = _store_tiers(client)
            for tier in tiers:
                got = _pull_tier(runtime, client, tier, grid)
                size = runtime.new_pool(1).page_payload_bytes
                samples.extend(
                    PullSample(tier.name.lower(), same_host, n * size, s) for n, s in got
                )
                path = "same-host" if same_host else f"remote ({client.transport})"
                summary = ", ".join(f"{n} pages {s * 1e3:.2f} ms" for n, s in got)
                progress(f"pull {tier.name.lower()} {path}: {summary}")
    return tuple(samples), PullPaths(
        same_host_ok, remote_transport, tuple(t.name.lower() for t in tiers)
    )


def _pull_tier(
    runtime: ModelRuntime, client: StoreClient, tier: Tier, grid: Grid
) -> list[tuple[int, float]]:
    """(pages, fastest seconds) of StoreLink.pull for each page count of the grid."""
    page = runtime.page_tokens
    most = max(grid.pull_pages)
    rng = random.Random(0)
    ids = [rng.randrange(runtime.vocab_size) for _ in range(most * page)]
    pool = runtime.new_pool(most)
    table = list(range(most))
    size = pool.page_payload_bytes
    link = StoreLink(client)
    out: list[tuple[int, float]] = []
    try:
        shared = _put(runtime, client, ids, size, rng, tier) if tier is Tier.DRAM else None
        for count in grid.pull_pages:
            times: list[float] = []
            for _ in range(grid.reps + (1 if tier is Tier.DRAM else 0)):
                # SSD: fresh pages each time (a read promotes them to DRAM)
                scope = shared or _put(runtime, client, ids, size, rng, tier)
                keys = page_keys(scope, ids[: count * page])
                got = link.pull(scope, ids[: count * page], keys, pool, table, IoClass.NORMAL)
                if got.pages != count:
                    raise RuntimeError(
                        f"pull of {count} {tier.name} pages found {got.pages}: the store lost "
                        "pages the profile just put"
                    )
                times.append(got.lookup_s + got.pull_s)
                if shared is None:
                    client.delete(scope)
            if tier is Tier.DRAM:
                times = times[1:]  # the first read of a size warms the path
            out.append((count, min(times)))
        if shared is not None:
            client.delete(shared)
    finally:
        link.close()
    return out


def _put(
    runtime: ModelRuntime,
    client: StoreClient,
    ids: Sequence[int],
    size: int,
    rng: random.Random,
    tier: Tier,
) -> Scope:
    scope = runtime.scope(f"strata-profile-{uuid.uuid4().hex[:12]}")
    payloads = [rng.randbytes(size) for _ in range(len(ids) // runtime.page_tokens)]
    pages = build_pages(scope, list(ids), payloads)
    client.put(scope, pages, tier=tier)
    found = client.lookup(scope, [p.header.key for p in pages])
    if found.hit_count != len(pages) or any(t is not tier for t in found.tiers):
        raise RuntimeError(
            f"profile pages put to {tier.name} landed in {sorted({t.name for t in found.tiers})} "
            f"({found.hit_count} of {len(pages)} found)"
        )
    return scope
