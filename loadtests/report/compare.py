"""`strata report A.json [B.json ...] [--out DIR]`: runs of several reports side by side.

Prints one table with a column per run (TTFT, TPOT, end-to-end, attainment, goodput, refusals,
hit ratio, validity) and, with `--out`, writes the combined report (JSON, Markdown, plots).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtests.report.files import ReportError, load_runs, write_report
from loadtests.report.metrics import run_metrics
from loadtests.report.records import RunResult


def side_by_side(runs: Sequence[RunResult]) -> str:
    ms = [run_metrics(r) for r in runs]

    def f(x: float, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
        return "-" if math.isnan(x) else fmt.format(x * scale)

    rows: list[tuple[str, list[str]]] = [
        ("kind", [r.kind for r in runs]),
        ("offered /s", [f"{m.target_rate:.2f}" for m in ms]),
        ("achieved /s", [f"{m.achieved_rate:.2f}" for m in ms]),
        ("valid", ["yes" if m.valid else "NO" for m in ms]),
        ("requests", [str(m.overall.requests) for m in ms]),
        ("refused (429)", [str(m.overall.refused) for m in ms]),
        ("timed out", [str(m.overall.timed_out) for m in ms]),
        ("failed", [str(m.overall.failed) for m in ms]),
        ("TTFT mean ms", [f(m.overall.ttft.mean) for m in ms]),
        ("TTFT p50 ms", [f(m.overall.ttft.p50) for m in ms]),
        ("TTFT p99 ms", [f(m.overall.ttft.p99) for m in ms]),
        ("TPOT p50 ms", [f(m.overall.tpot.p50) for m in ms]),
        ("TPOT p99 ms", [f(m.overall.tpot.p99) for m in ms]),
        ("e2e mean ms", [f(m.overall.e2e.mean) for m in ms]),
        ("e2e p99 ms", [f(m.overall.e2e.p99) for m in ms]),
        ("SLO attainment", [f(m.overall.attainment, 100, "{:.1f}%") for m in ms]),
        ("goodput /s", [f"{m.overall.goodput_rps:.2f}" for m in ms]),
        ("hit ratio", [f(m.overall.hit_ratio, 100, "{:.1f}%") for m in ms]),
        ("fairness (Jain)", [f(m.fairness, 1, "{:.3f}") for m in ms]),
    ]
    header = ["metric", *(r.label for r in runs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *vals]) + " |" for name, vals in rows]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="strata report", description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="report.json files (or folders holding one)")
    ap.add_argument("--out", help="write the combined report (JSON, Markdown, plots) here")
    args = ap.parse_args(argv)
    runs: list[RunResult] = []
    try:
        loaded = [(path, load_runs(path)) for path in args.reports]
    except ReportError as exc:
        print(f"strata report: {exc}", file=sys.stderr)
        return 2
    labels = [r.label for _, group in loaded for r in group]
    for path, group in loaded:
        for r in group:
            # Runs of different reports with the same label are told apart by their report.
            label = r.label if labels.count(r.label) == 1 else f"{r.label} ({_name(path)})"
            runs.append(dataclasses.replace(r, label=label))
    print(side_by_side(runs))
    if args.out:
        paths = write_report(runs, args.out, "Runs side by side")
        print(f"wrote {paths['markdown']}")
    return 0


def _name(path: str) -> str:
    p = Path(path)
    return (p.parent.name if p.name == "report.json" else p.stem) or str(p)
