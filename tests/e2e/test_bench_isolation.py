"""`strata bench isolation` with a tiny configuration: both measurements run, side by side with
their idle rounds, and the JSON has every field (latencies, ratios, the background cap check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_isolation_tiny_run_writes_both_measurements(tmp_path: Path) -> None:
    out = tmp_path / "isolation.json"
    done = subprocess.run(
        [sys.executable, "-m", "strata_cli.main", "bench", "isolation",
         "--seconds", "0.6", "--rounds", "2",
         "--max-calls", "300", "--flood-page-kib", "64", "--flood-batch", "4",
         "--dram", "32MiB", "--slow-dram", "16MiB", "--ssd", "256MiB", "--cap", "8MiB",
         "--dir", str(tmp_path / "state"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
    )
    text = done.stdout[-4000:] + done.stderr[-3000:]
    assert done.returncode == 0, text
    report = json.loads(out.read_text())
    paths = [r["name"].rsplit(", ", 1)[1] for r in report["critical"]]
    assert {"shm", "tcp", "grpc"} <= set(paths), text  # UCX only where ucxx works
    for row in report["critical"] + report["slow_disk"]:
        assert row["calls"] > 0, row
        for key in ("idle_p50_ms", "idle_p99_ms", "loaded_p50_ms", "loaded_p99_ms"):
            assert row[key] > 0, row
        assert row["idle_p99_ms"] >= row["idle_p50_ms"]
        # The ratio comes from the unrounded times; the ms fields are rounded to 3 decimals,
        # so the ratio must lie within what that rounding allows (plus its own 2 decimals).
        lo = (row["loaded_p50_ms"] - 0.0005) / (row["idle_p50_ms"] + 0.0005)
        hi = (row["loaded_p50_ms"] + 0.0005) / max(row["idle_p50_ms"] - 0.0005, 1e-9)
        assert lo - 0.006 <= row["p50_ratio"] <= hi + 0.006, row
    cap = report["cap"]
    assert cap["cap_bytes_per_s"] == 8 << 20 and cap["seconds"] > 0
    assert set(paths) <= set(cap["client_bytes_per_s"])
    assert all(v > 0 for v in cap["client_bytes_per_s"].values()), cap  # the flood ran
    assert cap["held"] == (max(cap["total_bytes_per_s"], cap["client_total_bytes_per_s"])
                           <= cap["allowed_bytes_per_s"] * 1.05)
    names = [r["name"] for r in report["slow_disk"]]
    assert names == ["DRAM get 4 x 64KiB, slow disk", "lookup 32 keys, slow disk",
                     "DRAM get 4 x 64KiB, normal disk", "lookup 32 keys, normal disk"], text
    assert "x p50" in done.stdout and "background cap" in done.stdout
