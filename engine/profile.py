"""`strata profile`: measure a worker's model on this machine and fit the router's time model.

    strata profile --model PATH [--store ADDR] [--out FILE] [--quick] [--device cpu]

Measures (engine/profile_measure.py) prefill time over a grid of new x cached tokens, decode step
time over batch x context, and, given a store, pull time per tier and path; fits the coefficients
(`TimeModel.fit`, least squares on relative error) and writes them as JSON with the machine (CPU
model, cores, torch device, host name), the checkpoint (path and fingerprint), the date and the
samples themselves, so a profile can be checked against what it was fitted on.

The default file is `$XDG_CACHE_HOME/strata/profiles/<checkpoint>-<machine>.json` (or
`~/.cache/strata/...`), keyed by the checkpoint's fingerprint and the machine, so `strata up` and
the router call `load_or_profile(model_path, store=..., progress=...)`: it loads the matching
profile, or measures one (progress on stderr) and saves it. `--quick` (the default for
`load_or_profile`) is a small grid that takes well under a minute for the small preset on two
cores.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from client import StrataError
from engine.checkpoint import Checkpoint, load_checkpoint
from engine.profile_measure import (
    FULL,
    MAX_REPS,
    QUICK,
    Grid,
    measure_decode,
    measure_prefill,
    measure_pulls,
)
from engine.router.core.fit import fit_quality
from engine.router.core.timemodel import Machine, Provenance, PullSample, Samples, TimeModel
from engine.runtime import ModelRuntime

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def cache_dir() -> Path:
    """The per-user cache folder: $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata"


def this_machine(device: str = "cpu") -> Machine:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch_device = str(torch.device(device))
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch_device += f" ({torch.cuda.get_device_name(torch.device(device))})"
    return Machine(
        cpu_model=cpu,
        cores=os.cpu_count() or 0,
        torch_device=torch_device,
        hostname=socket.gethostname(),
    )


def machine_key(machine: Machine) -> str:
    text = f"{machine.cpu_model}|{machine.cores}|{machine.torch_device}|{machine.hostname}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def checkpoint_fingerprint(checkpoint: Checkpoint) -> str:
    """The weights and config fingerprint (what changes every KV page also changes timings)."""
    return checkpoint.fingerprints.revision


def default_path(checkpoint: Checkpoint, machine: Machine) -> Path:
    digest = hashlib.sha256(checkpoint_fingerprint(checkpoint).encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{digest}-{machine_key(machine)}.json"


def _stderr(message: str) -> None:
    print(f"  profile: {message}", file=sys.stderr, flush=True)


def profile(
    model_path: str | Path,
    *,
    store: str | None = None,
    grid: Grid = QUICK,
    device: str = "cpu",
    progress: Progress = _stderr,
    checkpoint: Checkpoint | None = None,
) -> TimeModel:
    """Measure the model at `model_path` on this machine (and pulls from `store`), fit, return."""
    ckpt = checkpoint or load_checkpoint(model_path)
    began = time.perf_counter()
    runtime = ModelRuntime(ckpt, page_tokens=16, max_context=grid.max_context + 16, device=device)
    if runtime.max_context < grid.max_context:
        grid = _shrink(grid, runtime.max_context)
    progress(f"{ckpt.model_id} on {runtime.device}, {torch.get_num_threads()} threads")
    prefill = measure_prefill(runtime, grid, progress)
    decode = measure_decode(runtime, grid, progress)
    pulls: tuple[PullSample, ...] = ()
    note = f"grid {'quick' if grid == QUICK else 'full' if grid == FULL else 'custom'}"
    if store:
        pulls, paths = measure_pulls(runtime, store, grid, progress)
        note += (
            f"; pulls: tiers {', '.join(paths.tiers) or 'none'}, same-host "
            f"{'shm' if paths.same_host else 'unavailable'}, remote {paths.remote_transport or 'unavailable'}"
        )
    provenance = Provenance(
        machine=this_machine(device),
        checkpoint_path=str(Path(model_path).resolve()),
        checkpoint_fingerprint=checkpoint_fingerprint(ckpt),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        store=store or "",
        note=note,
    )
    model = TimeModel.fit(Samples(prefill, decode, pulls), provenance)
    progress(f"measured and fitted in {time.perf_counter() - began:.1f} s")
    return model


def _shrink(grid: Grid, limit: int) -> Grid:
    """The grid cut to a model whose context is shorter than the grid needs."""
    cached = tuple(c for c in grid.prefill_cached if c + max(grid.prefill_new) <= limit) or (0,)
    context = tuple(c for c in grid.decode_context if c + MAX_REPS + 2 <= limit)
    return replace(grid, prefill_cached=cached, decode_context=context or (limit // 2,))


def matches(model: TimeModel, checkpoint: Checkpoint, machine: Machine) -> bool:
    p = model.provenance
    return p.checkpoint_fingerprint == checkpoint_fingerprint(checkpoint) and p.machine == machine


def load_or_profile(
    model_path: str | Path,
    *,
    store: str | None = None,
    progress: Progress | None = None,
    quick: bool = True,
    device: str = "cpu",
    path: str | Path | None = None,
) -> TimeModel:
    """The time model of `model_path` on this machine: loaded from `path` (default: the cache
    folder's file for this checkpoint and machine) when it matches, else measured and saved.

    A saved profile without pull timings, asked for with a `store`, gets its pulls measured and
    is refitted (prefill and decode samples are kept). `progress` (default: lines on stderr)
    hears each step of a measurement; nothing is printed when the profile is reused.
    """
    say = progress or _stderr
    ckpt = load_checkpoint(model_path)
    machine = this_machine(device)
    target = Path(path) if path is not None else default_path(ckpt, machine)
    if target.exists():
        try:
            saved = TimeModel.load(target)
        except (OSError, ValueError) as exc:
            log.warning("profile %s unreadable (%s): measuring again", target, exc)
        else:
            if matches(saved, ckpt, machine):
                if not store or saved.samples.pull:
                    log.info("time model from %s", target)
                    return saved
                say(f"{target} has no pull timings: measuring pulls from {store}")
                runtime = ModelRuntime(ckpt, page_tokens=16, device=device)
                pulls, _ = measure_pulls(runtime, store, QUICK if quick else FULL, say)
                samples = replace(saved.samples, pull=pulls)
                model = TimeModel.fit(samples, replace(saved.provenance, store=store))
                model.save(target)
                return model
            log.info("profile %s is for another checkpoint or machine: measuring", target)
    say(f"no time model for this checkpoint on this machine yet: measuring ({target})")
    model = profile(
        model_path,
        store=store,
        grid=QUICK if quick else FULL,
        device=device,
        progress=say,
        checkpoint=ckpt,
    )
    model.save(target)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="strata profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, type=Path, help="checkpoint folder")
    p.add_argument("--store", help="store daemon address (host:port): also measure pulls")
    p.add_argument("--out", type=Path, help="JSON file (default: the per-user cache folder)")
    p.add_argument("--quick", action="store_true", help="a small grid (under a minute)")
    p.add_argument("--device", default="cpu", help="torch device of the model (default cpu)")
    p.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own, as the workers run)"
    )
    ns = p.parse_args(argv)
    if ns.threads is not None:
        if ns.threads < 1:
            p.error("--threads must be at least 1")
        torch.set_num_threads(ns.threads)
    try:
        ckpt = load_checkpoint(ns.model)
    except (OSError, ValueError) as exc:
        print(f"strata profile: cannot load {ns.model}: {exc}", file=sys.stderr)
        return 2
    try:
        model = profile(
            ns.model,
            store=ns.store,
            grid=QUICK if ns.quick else FULL,
            device=ns.device,
            checkpoint=ckpt,
        )
    except (StrataError, RuntimeError, ValueError, OSError) as exc:  # reported, not a traceback
        print(f"strata profile: FAILED: {exc}", file=sys.stderr)
        return 1
    out = ns.out or default_path(ckpt, this_machine(ns.device))
    model.save(out)
    q = fit_quality(model)
    print(f"wrote {out}")
    print(
        f"fit (relative error, median / max): prefill {q.prefill_median:.1%} / {q.prefill_max:.1%}"
        f", decode {q.decode_median:.1%} / {q.decode_max:.1%}"
        + (f", pull {q.pull_median:.1%} / {q.pull_max:.1%}" if model.samples.pull else "")
    )
    pre, dec = model.prefill, model.decode
    print(
        f"prefill: {pre.fixed_s * 1e3:.3f} ms + {pre.per_token_s * 1e6:.3f} us/token "
        f"+ {pre.per_cached_token_s * 1e9:.3f} ns/cached token "
        f"+ {pre.attention_s * 1e9:.4f} ns/token pair"
    )
    print(
        f"decode step: {dec.fixed_s * 1e3:.3f} ms + {dec.per_request_s * 1e6:.2f} us/request "
        f"+ {dec.per_context_token_s * 1e9:.3f} ns/context token"
    )
    for pull in model.pulls:
        where = "same host" if pull.same_host else "remote"
        print(
            f"pull {pull.tier} {where}: {pull.fixed_s * 1e3:.3f} ms + "
            f"{pull.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
