"""`strata serve` as a child process: it starts and says where it serves, serves both data paths,
survives `kill -9` with its SSD pages intact (and nothing corrupt served), and exits cleanly on
SIGTERM. Waiting across processes is bounded polling (`loadtests.daemon.wait_for`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import (
    PAGE_BYTES,
    assert_intact,
    buffers,
    chain,
    keys_of,
    make_scope,
    read_back,
    singles,
    tokens_of,
)

from client import StoreClient, Tier
from loadtests.daemon import DaemonProcess, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def ssd_pages(client: StoreClient) -> int:
    return next(t.pages for t in client.stats().tiers if t.tier is Tier.SSD)


def test_serve_starts_prints_and_serves_both_paths(tmp_path: Path) -> None:
    scope = make_scope()
    data = tmp_path / "data"
    with DaemonProcess(data, dram="32MiB", ssd="64MiB") as proc:
        text = "\n".join(proc.output)
        assert re.fullmatch(r"127\.0\.0\.1:\d+", proc.address), text
        assert f"tiers: dram 32MiB, ssd 64MiB at {data / 'ssd'}" in text
        assert proc.metrics_url.startswith("http://127.0.0.1:"), text
        assert proc.local_address, text
        assert os.path.exists(f"/dev/shm/{proc.segment}")
        assert re.search(r"tcp tcp://127\.0\.0\.1:\d+", text), text
        with (
            StoreClient(proc.address, shared_memory=True) as shm,
            StoreClient(proc.address, shared_memory=False, ucx=False) as tcp,
            StoreClient(proc.address, shared_memory=False, ucx=False, tcp=False) as rpc,
        ):
            for client in (shm, tcp, rpc):
                client.connect()
            assert (shm.transport, tcp.transport, rpc.transport) == ("shm", "tcp", "grpc")
            a, b = chain(scope, 4, seed=40), chain(scope, 4, seed=41)
            c = chain(scope, 4, seed=39)
            assert shm.put(scope, a).stored == 4
            assert rpc.put(scope, b).stored == 4
            assert tcp.put(scope, c).stored == 4
            for client in (shm, tcp, rpc):
                assert_intact(client, scope, a + b + c)
                assert client.lookup(scope, keys_of(a)).tiers == (Tier.DRAM,) * 4
            assert rpc.stats().pages == 12
        with urllib.request.urlopen(proc.metrics_url, timeout=10) as reply:
            metrics = reply.read().decode()
        assert 'strata_hits_total{tier="dram"} 36.0' in metrics  # 12 pages read by 3 clients
        assert f'strata_tier_used_bytes{{tier="dram"}} {12.0 * PAGE_BYTES}' in metrics


def test_kill_9_then_restart_serves_ssd_pages(tmp_path: Path) -> None:
    scope = make_scope()
    data = tmp_path / "data"
    flushed_wt = chain(scope, 6, seed=42)  # written through to SSD in the background
    flushed_ssd = singles(scope, 4, seed=43)  # put straight onto SSD
    burst = singles(scope, 24, seed=44)  # in flight (or not) when the daemon dies
    proc = DaemonProcess(data, dram="32MiB", ssd="64MiB", extra=["--write-through"]).start()
    try:
        with (
            StoreClient(proc.address, shared_memory=True) as shm,
            StoreClient(proc.address, shared_memory=False, ucx=False) as rpc,
        ):
            assert shm.put(scope, flushed_wt).stored == 6
            assert rpc.put(scope, flushed_ssd, tier=Tier.SSD).stored == 4
            assert wait_for(lambda: ssd_pages(rpc) == 10, timeout_s=30), rpc.stats()
            shm.put(scope, burst)
        segment = proc.segment
        proc.kill()  # SIGKILL: no flush, no cleanup
        assert not os.path.exists(f"/dev/shm/{segment}")  # DaemonProcess.kill unlinks it
    finally:
        proc.kill()

    with (
        DaemonProcess(data, dram="32MiB", ssd="64MiB") as again,
        StoreClient(again.address, shared_memory=True) as shm,
        StoreClient(again.address, shared_memory=False) as rpc,
    ):
        stats = rpc.stats()
        assert stats.corrupt_dropped == 0
        assert 10 <= stats.pages <= 10 + len(burst)  # rebuilt from the SSD pages' headers
        assert rpc.lookup(scope, keys_of(flushed_wt)).tiers == (Tier.SSD,) * 6
        for client in (shm, rpc):
            assert_intact(client, scope, flushed_wt + flushed_ssd)
        # every page is either served byte-identical or a miss: never other bytes
        for client in (shm, rpc):
            got = read_back(client, scope, burst)
            assert all(g is None or g == p.payload for g, p in zip(got, burst, strict=True))
            into = buffers(scope, len(burst))
            result = client.get(scope, keys_of(burst), into, tokens=tokens_of(burst), verify=True)
            assert all(
                h is None or h == p.header for h, p in zip(result.headers, burst, strict=True)
            )
            assert client.corrupt_pages == 0
        assert rpc.stats().corrupt_dropped == 0
        # and the restarted daemon takes new writes
        fresh = singles(scope, 2, seed=45)
        assert shm.put(scope, fresh).stored == 2
        assert_intact(rpc, scope, fresh)


def test_sigterm_exits_zero_and_removes_its_segment(tmp_path: Path) -> None:
    scope = make_scope()
    proc = DaemonProcess(tmp_path / "data", dram="32MiB", ssd="64MiB").start()
    try:
        segment, local = proc.segment, proc.local_address
        assert segment and os.path.exists(f"/dev/shm/{segment}")
        with StoreClient(proc.address, shared_memory=True) as shm:
            assert shm.put(scope, chain(scope, 2, seed=46)).stored == 2
    finally:
        code = proc.stop()  # SIGTERM
    assert code == 0
    assert not os.path.exists(f"/dev/shm/{segment}")
    sock = local.split(":", 1)[1] if ":" in local else local
    assert not sock or not os.path.exists(sock)
    assert "strata store stopping" in proc.output


def test_gevent_greenlets_share_a_client_on_the_same_host_path(tmp_path: Path) -> None:
    """A monkey-patched process (as locust runs) drives the real daemon over shared memory."""
    pytest.importorskip("gevent")
    script = f"""
from gevent import monkey
monkey.patch_all()
import random, sys
sys.path.insert(0, {str(REPO)!r})
from client.transports import gevent_support
gevent_support.init()
import gevent
from client import KVLayout, Scope, StoreClient, build_pages
scope = Scope(model_id="test/tiny", weights_revision="w1", tokenizer_fingerprint="tok1",
              kv_dtype="float16", layout=KVLayout(2, 2, 64, 16))
client = StoreClient(sys.argv[1], shared_memory=True, timeout_s=20)
client.connect()
assert client.transport == "shm", client.transport
def work(i):
    payloads = [random.Random(i * 10 + j).randbytes(scope.page_payload_bytes) for j in range(3)]
    pages = build_pages(scope, [i] * 48, payloads)
    keys = [p.header.key for p in pages]
    stored = client.put(scope, pages).stored
    gevent.sleep(0)  # let the other greenlets interleave
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    got = client.get(scope, keys, into, tokens=[p.header.tokens for p in pages])
    same = got.hit_count == 3 and [bytes(b) for b in into] == payloads
    return stored, same, client.lookup(scope, keys).hit_count
jobs = [gevent.spawn(work, i) for i in range(8)]
gevent.joinall(jobs, timeout=60, raise_error=True)
print("results", sorted(job.value for job in jobs))
client.close()
"""
    with DaemonProcess(tmp_path / "data", dram="32MiB", ssd="64MiB") as proc:
        done = subprocess.run(
            [sys.executable, "-c", script, proc.address],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "results " + str([(3, True, 3)] * 8) in done.stdout
        with StoreClient(proc.address, shared_memory=False) as rpc:
            assert rpc.stats().pages == 24


def _serve_processes_for(data_dir: Path) -> list[int]:
    """PIDs of `strata serve` processes whose command line names `data_dir`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(data_dir).encode() in args:
            found.append(int(entry))
    return found


def test_a_started_daemon_used_as_a_context_manager_runs_once_and_is_stopped(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "store"
    with DaemonProcess(data_dir, dram="16MiB", ssd="0").start() as daemon:
        assert _serve_processes_for(data_dir) == [daemon.pid]
    assert wait_for(lambda: not _serve_processes_for(data_dir), 20)
