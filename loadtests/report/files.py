"""The report on disk: `report.json` (every request of every run), `report.md`, `plots/*.png`.

    {"format": "strata-report", "version": 1, "title": ..., "runs": [RunResult.to_json(), ...]}

`write_report(runs, out_dir, title)` writes all three and returns the paths; `load_runs(path)`
reads the runs back from a report JSON (raises ReportError for anything else).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from loadtests.report.markdown import render_markdown
from loadtests.report.records import RunResult

FORMAT = "strata-report"
VERSION = 1


class ReportError(ValueError):
    """A file that is not a Strata report."""


def write_report(
    runs: Sequence[RunResult],
    out_dir: str | Path,
    title: str,
    *,
    plots: bool = True,
    extra_markdown: str = "",
) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "title": title,
        "runs": [r.to_json() for r in runs],
    }
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    tmp.replace(paths["json"])
    png: list[Path] = []
    if plots:
        from loadtests.report.plots import write_plots

        png = write_plots(runs, out / "plots")
    md = render_markdown(runs, title, plots=[p.relative_to(out) for p in png])
    paths["markdown"].write_text(md + (("\n" + extra_markdown) if extra_markdown else ""))
    for p in png:
        paths[p.stem] = p
    return paths


def load_runs(path: str | Path) -> list[RunResult]:
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ReportError(f"report {p} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{p} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ReportError(f"{p} is not a Strata report (format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise ReportError(f"{p}: report version {doc.get('version')!r}, this reads {VERSION}")
    try:
        return [RunResult.from_json(r) for r in doc["runs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{p}: malformed run: {exc}") from None
