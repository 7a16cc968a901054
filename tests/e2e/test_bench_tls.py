"""`strata bench tls` on a tiny size: both daemons (subprocesses, one with a throwaway
certificate) serve every call on both remote paths, and the JSON has a time, a rate and a ratio
for each. The bench itself checks that each client took the path it names and that every get
hit. Timings are only checked to be positive: what TLS costs is the benchmark's answer, not
something a loaded CI machine can promise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench_tls import main

pytestmark = pytest.mark.e2e


def test_bench_tls_times_both_daemons(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tls.json"
    assert main(["--pages", "2", "--rounds", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["pages"], report["rounds"], report["page_bytes"]) == (2, 3, 64 << 10)
    for path in ("tcp", "grpc"):
        for op in ("get", "put"):
            kind = f"{op}_{path}"
            assert report[f"{kind}_plain_ms"] > 0 and report[f"{kind}_tls_ms"] > 0
            assert report[f"{kind}_plain_gbps"] > 0 and report[f"{kind}_tls_gbps"] > 0
            assert report[f"{kind}_tls_over_plain_ratio"] > 0
    assert report["connect_tls_ms"] > 0
    printed = capsys.readouterr().out
    assert "get tcp" in printed and "first call" in printed


def test_bench_tls_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pages", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
