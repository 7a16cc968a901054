"""`strata chaos`, short: kill -9 and restart, flipped SSD bytes, a client stalled past its
leases and a slow disk, each under a load from client processes. No page may be served wrong
and nothing may leak; the summary JSON has its fields per fault and in total. The pure parts
(page payloads, classification, availability) are checked on their own first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.chaos.pages import chaos_scope, classify, expected, is_intact, prompt
from loadtests.chaos.report import FaultResult, availability, failed, totals

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("acknowledged", "intact", "missing", "wrong", "leaks")


def test_payloads_follow_from_keys_and_any_other_bytes_are_wrong() -> None:
    scope = chaos_scope("t")
    a, b = prompt(scope, 1, 2), prompt(scope, 2, 2)
    assert len(set(a.keys) | set(b.keys)) == 4
    size = scope.page_payload_bytes
    pages = a.build(scope)
    assert [bytes(p.payload) for p in pages] == [expected(k, size) for k in a.keys]
    good = bytearray(expected(a.keys[0], size))
    assert is_intact(a.keys[0], good)
    flipped = bytearray(good)
    flipped[size - 1] ^= 1
    torn = bytearray(good[: size // 2] + expected(b.keys[0], size)[size // 2 :])
    assert not is_intact(a.keys[0], flipped) and not is_intact(a.keys[0], torn)
    keys = [a.keys[0]] * 3 + [a.keys[1]]
    hits = [True, True, True, False]
    intact, missing, wrong = classify(keys, hits, [good, flipped, torn, good])
    assert (len(intact), len(missing), len(wrong)) == (1, 1, 2)


def test_availability_counts_calls_and_the_longest_stretch_without_a_success() -> None:
    calls = [(0.5, 0.6, True, "get"), (1.0, 3.0, False, "put"), (3.2, 3.3, True, "get"),
             (9.0, 9.1, True, "get")]
    a = availability(calls, 0.0, 4.0)
    assert (a.calls, a.succeeded, a.longest_gap_s) == (3, 2, 2.7)
    assert a.by_op == {"get": [2, 2], "put": [1, 0]}
    assert a.fraction == pytest.approx(2 / 3)
    ok = FaultResult("x", acknowledged=5, intact=4, missing=1)
    bad = FaultResult("y", acknowledged=2, intact=1, wrong=1)
    skipped = FaultResult("z", skipped="no root", wrong=9)
    assert totals([ok, bad, skipped]) == {
        "acknowledged": 7, "intact": 5, "missing": 1, "wrong": 1, "leaks": 0}
    assert not failed([ok, skipped]) and failed([ok, bad])
    assert failed([ok, FaultResult("w", error="daemon did not restart")])


@pytest.mark.slow
def test_chaos_short_run_serves_nothing_wrong_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    faults = ("kill-9", "flip-bytes", "stall-client", "slow-disk")
    done = subprocess.run(
        [sys.executable, "-m", "strata_cli.main", "chaos", "--duration", "12",
         "--faults", ",".join(faults), "--clients", "2", "--rate", "30",
         "--dir", str(tmp_path / "state"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    table = done.stdout[-4000:]
    assert [f["fault"] for f in summary["faults"]] == list(faults), table
    for f in summary["faults"]:
        assert f["skipped"] == "" and f["error"] == "", table
        assert all(isinstance(f[k], int) for k in FIELDS), f
        assert f["acknowledged"] > 0, table
        assert f["intact"] + f["missing"] <= f["acknowledged"] and f["intact"] > 0, f
        assert f["wrong"] == 0, table
        assert f["leaks"] == 0, table
        assert f["availability"]["calls"] > 0, f
        assert f["details"]["check_integrity"] == "ok", f  # strata serve --check-integrity-on-exit
    by = {f["fault"]: f for f in summary["faults"]}
    assert by["kill-9"]["details"]["kills"] == 2
    assert by["flip-bytes"]["details"]["bytes_flipped"] > 0
    assert by["stall-client"]["details"]["stalls"] >= 2
    assert by["flip-bytes"]["availability"]["fraction"] > 0.9, table
    total = summary["total"]
    assert total == {k: sum(f[k] for f in summary["faults"]) for k in FIELDS}
    assert total["acknowledged"] > 0 and total["wrong"] == 0 and total["leaks"] == 0
    assert summary["passed"] is True and done.returncode == 0, table
    assert "total" in table and "wrong" in table
