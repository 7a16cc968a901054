"""PNG plots of a report (matplotlib, Agg backend: no display needed).

- latency_cdf.png: TTFT and end-to-end CDFs per run and class;
- load.png: TTFT and TPOT p50/p99 against offered load, one line per policy (sweeps);
- goodput.png: SLO attainment and goodput against offered load;
- hits.png: hit tokens per tier over time (by first-token time), per run;
- queue.png: queued and running requests over time, per run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.report.metrics import run_metrics
from loadtests.report.records import TIER_NAMES, RunResult

_MAX_LINES = 24


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.plot(xs, ys, label=label)


def write_plots(runs: Sequence[RunResult], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdf(runs, out_dir), _hits(runs, out_dir), _queue(runs, out_dir)]
    if len({r.target_rate for r in runs}) > 1:
        paths += [_load(runs, out_dir), _goodput(runs, out_dir)]
    return paths


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def _latency_cdf(runs: Sequence[RunResult], out_dir: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lines = 0
    for run in runs:
        classes = sorted({r.slo_class for r in run.records})
        for cls in classes:
            if lines >= _MAX_LINES:
                break
            ok = [r for r in run.records if r.status == "ok" and r.slo_class == cls]
            label = run.label if len(classes) == 1 else f"{run.label} [{cls}]"
            _cdf(a, [r.ttft_s for r in ok], label)
            _cdf(b, [r.e2e_s for r in ok], label)
            lines += 1
    a.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    b.set(xlabel="end-to-end (s)", title="End-to-end CDF", xscale="log")
    a.legend(fontsize=6)
    return _save(fig, out_dir / "latency_cdf.png")


def _groups(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    groups: dict[str, list[RunResult]] = {}
    for r in runs:
        groups.setdefault(r.policy or r.kind, []).append(r)
    return {k: sorted(v, key=lambda r: r.target_rate) for k, v in groups.items()}


def _load(runs: Sequence[RunResult], out_dir: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, group in _groups(runs).items():
        rates = [r.target_rate for r in group]
        ms = [run_metrics(r).overall for r in group]
        a.plot(rates, [m.ttft.p50 for m in ms], marker="o", label=f"{name} p50")
        a.plot(rates, [m.ttft.p99 for m in ms], marker="x", linestyle="--", label=f"{name} p99")
        b.plot(rates, [m.tpot.p50 for m in ms], marker="o", label=f"{name} p50")
        b.plot(rates, [m.tpot.p99 for m in ms], marker="x", linestyle="--", label=f"{name} p99")
    a.set(xlabel="offered load (req/s)", ylabel="TTFT (s)", title="TTFT vs load", yscale="log")
    b.set(xlabel="offered load (req/s)", ylabel="TPOT (s)", title="TPOT vs load")
    a.legend(fontsize=6)
    return _save(fig, out_dir / "load.png")


def _goodput(runs: Sequence[RunResult], out_dir: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, group in _groups(runs).items():
        rates = [r.target_rate for r in group]
        ms = [run_metrics(r).overall for r in group]
        a.plot(rates, [m.attainment for m in ms], marker="o", label=name)
        b.plot(rates, [m.goodput_rps for m in ms], marker="o", label=name)
    a.axhline(0.9, color="grey", linestyle=":")
    a.set(xlabel="offered load (req/s)", ylabel="SLO attainment", title="Attainment (goal 90%)")
    b.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", title="Goodput")
    a.legend(fontsize=6)
    return _save(fig, out_dir / "goodput.png")


def _hits(runs: Sequence[RunResult], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4))
    for run in runs[: _MAX_LINES // 3]:
        ok = [r for r in run.records if r.status == "ok" and not math.isnan(r.first_token_s)]
        if not ok:
            continue
        end = max(r.first_token_s for r in ok)
        bins = 30
        width = max(end / bins, 1e-9)
        for tier in TIER_NAMES:
            counts = [0.0] * bins
            for r in ok:
                counts[min(bins - 1, int(r.first_token_s / width))] += r.hit(tier)
            if any(counts):
                ax.plot(
                    [(i + 0.5) * width for i in range(bins)],
                    [c / width for c in counts],
                    label=f"{run.label} {tier}",
                )
    ax.set(xlabel="time (s)", ylabel="hit tokens / s", title="Hit tokens per tier over time")
    ax.legend(fontsize=6)
    return _save(fig, out_dir / "hits.png")


def _queue(runs: Sequence[RunResult], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4))
    for run in runs[: _MAX_LINES // 2]:
        if run.samples:
            ax.plot(
                [s.t_s for s in run.samples],
                [s.queued for s in run.samples],
                label=f"{run.label} queued",
            )
            ax.plot(
                [s.t_s for s in run.samples],
                [s.running for s in run.samples],
                linestyle=":",
                label=f"{run.label} running",
            )
    ax.set(xlabel="time (s)", ylabel="requests", title="Queue length over time")
    ax.legend(fontsize=6)
    return _save(fig, out_dir / "queue.png")
