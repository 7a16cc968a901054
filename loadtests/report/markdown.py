"""The Markdown summary of one or more runs: the same tables for live runs and simulations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from loadtests.report.metrics import ClassMetrics, Dist, RunMetrics, goodput_rate, run_metrics
from loadtests.report.records import TIER_NAMES, RunResult


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def _dist(d: Dist) -> str:
    return f"{_ms(d.mean)} / {_ms(d.p50)} / {_ms(d.p90)} / {_ms(d.p99)}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _class_row(label: str, c: ClassMetrics) -> str:
    hits = " / ".join(str(c.hit_tokens.get(t, 0)) for t in TIER_NAMES)
    return (
        f"| {label} | {c.name} | {c.requests} | {c.ok} | {c.refused} | {c.timed_out} | {c.failed} "
        f"| {_dist(c.ttft)} | {_dist(c.tpot)} | {_dist(c.e2e)} | {_pct(c.attainment)} "
        f"| {c.goodput_rps:.2f} | {_pct(c.hit_ratio)} | {hits} |"
    )


def run_table(metrics: Sequence[RunMetrics]) -> list[str]:
    lines = [
        "| run | offered /s | achieved /s | valid | client lag p99 ms | attainment | goodput /s "
        "| fairness | bytes moved | evictions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        lines.append(
            f"| {m.label} | {m.target_rate:.2f} | {m.achieved_rate:.2f} | {'yes' if m.valid else 'NO'} "
            f"| {_ms(m.lag_p99_s)} | {_pct(m.overall.attainment)} | {m.overall.goodput_rps:.2f} "
            f"| {m.fairness:.3f} | {_bytes(m.bytes_moved)} | {m.evictions} |"
        )
    return lines


def class_table(metrics: Sequence[RunMetrics]) -> list[str]:
    lines = [
        "| run | class | requests | ok | refused (429) | timed out | failed "
        "| TTFT ms mean/p50/p90/p99 | TPOT ms mean/p50/p90/p99 | e2e ms mean/p50/p90/p99 "
        "| SLO attainment | goodput /s | hit ratio | hit tokens gpu/dram/ssd/unknown |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        lines.append(_class_row(m.label, m.overall))
        if len(m.classes) > 1:
            lines.extend(_class_row(m.label, c) for c in m.classes)
    return lines


def breakdown_table(metrics: Sequence[RunMetrics]) -> list[str]:
    parts = ("queue_s", "prefill_s", "pull_s", "decode_queue_s", "decode_s", "other_s")
    lines = [
        "| run | class | queue ms | prefill compute ms | KV pull ms | decode queue ms | decode ms "
        "| other ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        for c in (m.overall, *(m.classes if len(m.classes) > 1 else ())):
            lines.append(
                f"| {m.label} | {c.name} | " + " | ".join(_ms(c.breakdown[p]) for p in parts) + " |"
            )
    return lines


def goodput_lines(runs: Sequence[RunResult]) -> list[str]:
    """Per policy (or label group), the sweep's goodput when several rates were run."""
    groups: dict[str, list[RunResult]] = {}
    for r in runs:
        groups.setdefault(r.policy or r.kind, []).append(r)
    lines: list[str] = []
    for name, group in groups.items():
        if len({r.target_rate for r in group}) < 2:
            continue
        rate = goodput_rate(group)
        per_gpu = f" ({rate / group[0].gpus:.3f} /s per GPU)" if group[0].gpus else ""
        lines.append(
            f"- {name}: goodput {rate:.3g} req/s{per_gpu} (highest rate with ≥ 90% meeting both targets)"
        )
    return lines


def render_markdown(runs: Sequence[RunResult], title: str, plots: Sequence[Path] = ()) -> str:
    metrics = [run_metrics(r) for r in runs]
    out = [f"# {title}", ""]
    setups = sorted(
        {
            f"{r.kind}: workload {r.workload}" + (f", cluster {r.cluster}" if r.cluster else "")
            for r in runs
        }
    )
    out += [f"- {s}" for s in setups]
    invalid = [m.label for m in metrics if not m.valid]
    if invalid:
        out.append(f"- INVALID runs (the client fell behind its schedule): {', '.join(invalid)}")
    out += [
        "",
        "## Runs",
        "",
        *run_table(metrics),
        "",
        "## Latency and SLOs per class",
        "",
        *class_table(metrics),
        "",
        "## Where the time went (means of completed requests)",
        "",
        *breakdown_table(metrics),
    ]
    sweep = goodput_lines(runs)
    if sweep:
        out += ["", "## Goodput", "", *sweep]
    if plots:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.as_posix()})" for p in plots]
    return "\n".join(out) + "\n"
