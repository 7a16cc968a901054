"""Reports of live runs and simulations alike: records (`records.py`), metrics computed from them
at the end (`metrics.py`), the Markdown summary (`markdown.py`), PNG plots (`plots.py`), the JSON
file and its reader (`files.py`), and `strata report A.json B.json` (`compare.py`).
"""

from __future__ import annotations

from loadtests.report.files import load_runs, write_report
from loadtests.report.metrics import RunMetrics, goodput_rate, run_metrics
from loadtests.report.records import Breakdown, ClassTarget, RequestRecord, RunResult, Sample

__all__ = [
    "Breakdown",
    "ClassTarget",
    "RequestRecord",
    "RunMetrics",
    "RunResult",
    "Sample",
    "goodput_rate",
    "load_runs",
    "run_metrics",
    "write_report",
]
