"""`strata bench store` on tiny sizes: the JSON has the as-paid and the bare put/get rows of every
path, the SSD and full-store rows (and the full store really demoted pages); `--against mooncake`
without Mooncake prints how to get it and still compares with memcpy; with Mooncake installed,
the driver moves the right bytes and the ratios are oriented so that above 1 means Strata is
better. Timings are only checked to be positive: which store is faster is the benchmark's
answer, not something a loaded CI machine can promise.

Each run starts the store daemon as a subprocess (the benchmark's own path); a few seconds each.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench_store import AS_PAID, BARE, Timing, main
from loadtests.peers import mooncake
from loadtests.peers.mooncake_rows import mooncake_ratios

pytestmark = pytest.mark.e2e

TINY = [
    "--shapes", "64KiB", "--iters", "3", "--working-set-mib", "4", "--dram", "128MiB",
    "--no-ucx",
]
PATHS = ("same-host", "remote TCP", "remote gRPC")


def rows_named(report: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The rows called `name`, by cost."""
    return {r["cost"]: r for r in report["rows"] if r["name"] == name}


def test_bench_store_as_paid_and_bare_rows_and_the_missing_peer_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(mooncake.HIDE_ENV, "mooncake")  # as if the peers extra were not installed
    out = tmp_path / "bench.json"
    argv = [
        *TINY, "--ssd-pages", "16", "--full-dram-mib", "16", "--full-shape", "64KiB",
        "--against", "mooncake", "--json", str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert mooncake.INSTALL_HINT in printed
    assert ".venv/bin/pip install" in printed and "[peers]" in printed
    assert "Comparing with memcpy alone" in printed
    report = json.loads(out.read_text())
    assert report["mooncake"] == {"asked": True, "measured": False, "note": mooncake.INSTALL_HINT}
    assert report["mooncake_ratios"] == []
    assert not any(r["name"].startswith("mooncake") for r in report["rows"])
    memcpy = rows_named(report, "memcpy")[""]
    assert memcpy["gb_per_s"] > 0 and memcpy["bytes_per_call"] == 64 * (64 << 10)
    for path in PATHS:
        for op in ("put", "get"):
            by_cost = rows_named(report, f"{path} {op}")
            assert set(by_cost) == {AS_PAID, BARE}, (path, op)
            for row in by_cost.values():
                assert row["gb_per_s"] > 0 and row["p50_ms"] > 0
                assert row["ratio_to_memcpy"] == pytest.approx(row["gb_per_s"] / memcpy["gb_per_s"])
    for path in ("same-host", "remote TCP"):
        for name in ("lookup 512 hit", "lookup 512 miss", "get miss"):
            assert rows_named(report, f"{path} {name}")[""]["p50_ms"] > 0
    ssd = rows_named(report, "same-host get from SSD")[AS_PAID]
    assert ssd["gb_per_s"] > 0 and "total bytes / total time" in ssd["note"]
    room = rows_named(report, "same-host put into room")[AS_PAID]
    full = rows_named(report, "same-host put into a full store")[AS_PAID]
    assert full["ratio_to_memcpy"] == pytest.approx(full["gb_per_s"] / room["gb_per_s"])
    demoted = re.search(r"(\d+) pages demoted", full["note"])
    assert demoted is not None and int(demoted.group(1)) > 0, full["note"]


def timing(name: str, cost: str, gb_per_s: float = 0.0, p50_ms: float = 1.0) -> Timing:
    shape = "64KiB" if gb_per_s else "1 key"
    return Timing(name, shape, 1 if gb_per_s else 0, p50_ms, p50_ms, gb_per_s, None, cost)


def test_mooncake_ratios_above_one_mean_strata_is_better() -> None:
    rows = [
        timing("same-host put", AS_PAID, gb_per_s=2.0),
        timing("same-host put", BARE, gb_per_s=3.0),
        timing("mooncake same-host put", "", gb_per_s=4.0),
        timing("remote TCP get miss", "", p50_ms=0.5),
        timing("mooncake remote get miss", "", p50_ms=2.0),
        timing("remote TCP get", AS_PAID, gb_per_s=1.0),  # no Mooncake row: no ratio
    ]
    put, miss = mooncake_ratios(rows)
    assert (put.row, put.unit, put.strata, put.strata_bare, put.mooncake) == (
        "same-host put", "GB/s", 2.0, 3.0, 4.0
    )
    assert put.strata_over_mooncake_ratio == 0.5 and put.bare_over_mooncake_ratio == 0.75
    assert (miss.row, miss.unit) == ("remote missing get p50", "ms")
    assert miss.strata_over_mooncake_ratio == 4.0  # Mooncake's time over Strata's
    assert miss.bare_over_mooncake_ratio is None


needs_mooncake = pytest.mark.skipif(not mooncake.installed(), reason="mooncake extra not installed")


@needs_mooncake
def test_mooncake_driver_moves_the_right_bytes_same_host_and_remote(tmp_path: Path) -> None:
    assert mooncake.missing_reason() is None
    page = 64 << 10
    src = bytearray(os.urandom(4 * page))
    keys = [f"page-{j}" for j in range(4)]
    with (
        mooncake.native_log_to(tmp_path / "native.log"),
        mooncake.MooncakeMaster(tmp_path) as master,
        mooncake.MooncakeHolder(master.address, 16 << 20, tmp_path / "holder.log"),
    ):
        for segment_bytes in (16 << 20, 0):  # storage here, then none (the holder's)
            client = mooncake.MooncakeClient(master.address, segment_bytes)
            try:
                dst = bytearray(4 * page)
                s, d = client.register(src), client.register(dst)
                client.put(keys, [s + j * page for j in range(4)], [page] * 4)
                assert client.present(keys) == 4
                assert client.present(["absent", *keys[1:]]) == 0
                client.get(keys, [d + j * page for j in range(4)], [page] * 4)
                assert dst == src
                client.get_missing("absent", d, page)
                with pytest.raises(mooncake.PeerFailed):
                    client.get(["absent"], [d], [page])
                client.clear()
                assert client.present(keys) == 0
            finally:
                client.close()


@needs_mooncake
def test_bench_store_against_mooncake_prints_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(mooncake.HIDE_ENV, raising=False)
    out = tmp_path / "bench.json"
    argv = [*TINY, "--ssd-pages", "0", "--full-dram-mib", "0", "--against", "mooncake",
            "--json", str(out)]
    assert main(argv) == 0
    assert "Strata / Mooncake (above 1: Strata better)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["mooncake"]["measured"] is True
    ratios = {(m["row"], m["shape"]): m for m in report["mooncake_ratios"]}
    assert set(ratios) == {
        ("same-host put", "64KiB"), ("same-host get", "64KiB"),
        ("remote put", "64KiB"), ("remote get", "64KiB"),
        ("same-host missing get p50", "1 key"), ("remote missing get p50", "1 key"),
        ("same-host lookup 512 p50", "512 keys"), ("remote lookup 512 p50", "512 keys"),
    }
    put = ratios[("same-host put", "64KiB")]
    assert put["strata"] == rows_named(report, "same-host put")[AS_PAID]["gb_per_s"]
    assert put["mooncake"] == rows_named(report, "mooncake same-host put")[""]["gb_per_s"]
    assert put["strata_over_mooncake_ratio"] == pytest.approx(put["strata"] / put["mooncake"])
    miss = ratios[("remote missing get p50", "1 key")]
    assert miss["strata_over_mooncake_ratio"] == pytest.approx(miss["mooncake"] / miss["strata"])
    assert all(m["strata_over_mooncake_ratio"] > 0 for m in ratios.values())
    assert any("mooncake" in k and "ratio" in k for k in put)
