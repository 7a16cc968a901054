"""The chaos summary: per fault and in total, pages acknowledged / intact / missing / wrong,
leaks, and the daemon's availability while the fault was on. Pure: built from worker records
and the checks' counts, printed as one table, written as JSON."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Availability:
    """Calls started while the fault was on (the stalled client itself excluded)."""

    calls: int
    succeeded: int
    longest_gap_s: float  # longest stretch of the fault window with no call succeeding
    by_op: dict[str, list[int]] = field(default_factory=dict)  # op -> [calls, succeeded]

    @property
    def fraction(self) -> float:
        return self.succeeded / self.calls if self.calls else 0.0


@dataclass(frozen=True, slots=True)
class FaultResult:
    fault: str
    acknowledged: int = 0
    intact: int = 0
    missing: int = 0
    wrong: int = 0
    leaks: int = 0
    availability: Availability | None = None
    skipped: str = ""  # why the fault could not be injected here ("" = it ran)
    error: str = ""  # the harness could not finish the phase (a finding, not a skip)
    notes: tuple[str, ...] = ()
    details: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        if self.availability is not None:
            a = self.availability
            out["availability"] = {**asdict(a), "fraction": a.fraction}
        return out


def availability(
    calls: Sequence[tuple[float, float, bool, str]], start: float, end: float
) -> Availability:
    """Availability over [start, end] from (start, end, ok, op) call records of many processes
    (one monotonic clock: CLOCK_MONOTONIC is system-wide)."""
    inside = [c for c in calls if start <= c[0] <= end]
    done = sorted(c[1] for c in calls if c[2] and start <= c[1] <= end)
    marks = [start, *done, end]
    gap = max(b - a for a, b in itertools.pairwise(marks)) if end > start else 0.0
    by_op: dict[str, list[int]] = {}
    for c in inside:
        counts = by_op.setdefault(c[3], [0, 0])
        counts[0] += 1
        counts[1] += int(c[2])
    return Availability(len(inside), sum(1 for c in inside if c[2]), round(gap, 3), by_op)


def totals(results: Sequence[FaultResult]) -> dict[str, int]:
    ran = [r for r in results if not r.skipped]
    return {
        name: sum(int(getattr(r, name)) for r in ran)
        for name in ("acknowledged", "intact", "missing", "wrong", "leaks")
    }


def failed(results: Sequence[FaultResult]) -> bool:
    """The run fails on any wrong page, any leak, or a phase the harness could not finish."""
    t = totals(results)
    return t["wrong"] > 0 or t["leaks"] > 0 or any(r.error for r in results)


def table(results: Sequence[FaultResult]) -> str:
    head = (
        f"{'fault':<14} {'acked':>7} {'intact':>7} {'missing':>7} {'wrong':>5} {'leaks':>5} "
        f"{'avail':>6} {'gap s':>6}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.fault:<14} {'skipped: ' + r.skipped}")
            continue
        a = r.availability
        avail = f"{a.fraction:6.1%}" if a and a.calls else f"{'-':>6}"
        gap = f"{a.longest_gap_s:6.2f}" if a else f"{'-':>6}"
        notes = "; ".join(([f"ERROR: {r.error}"] if r.error else []) + list(r.notes))
        lines.append(
            f"{r.fault:<14} {r.acknowledged:>7} {r.intact:>7} {r.missing:>7} {r.wrong:>5} "
            f"{r.leaks:>5} {avail} {gap}  {notes}"
        )
    t = totals(results)
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<14} {t['acknowledged']:>7} {t['intact']:>7} {t['missing']:>7} "
        f"{t['wrong']:>5} {t['leaks']:>5}"
    )
    return "\n".join(lines)


def write_json(path: Path, results: Sequence[FaultResult], config: dict[str, object]) -> None:
    doc = {
        "config": config,
        "faults": [r.to_json() for r in results],
        "total": totals(results),
        "passed": not failed(results),
    }
    path.write_text(json.dumps(doc, indent=2))
