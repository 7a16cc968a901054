"""`strata bench store`: store put/get/lookup throughput and latency, side by side with memcpy.

The daemon runs in its own process (started here on loopback, port 0, in a temporary folder).
For each batch shape (64 x 64 KiB, 64 x 1 MiB, 16 x 4 MiB by default) it times, in the same run:
a plain memcpy of the same bytes into the same destination buffers; put and get through the
same-host shared-memory path; and put and get through the remote paths, TCP and gRPC (and UCX, on
a second daemon, where ucxx is installed). Then a lookup of a
512-page chain (hit and miss), a get that misses, and SSD-tier reads against `fio` where it is
installed. Prints GB/s, p50/p99 per batch call and ratios to memcpy; `--json PATH` writes it all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from client import KVLayout, Scope, StoreClient, build_pages
from client.types import Tier
from loadtests.daemon import DaemonProcess

SHAPES = {"64KiB": (64, 64 << 10), "1MiB": (64, 1 << 20), "4MiB": (16, 4 << 20)}


@dataclass(frozen=True, slots=True)
class Timing:
    name: str
    shape: str
    bytes_per_call: int
    p50_ms: float
    p99_ms: float
    gb_per_s: float
    ratio_to_memcpy: float | None


def layout_for(page_bytes: int) -> KVLayout:
    """A float16 layout whose page payload is exactly page_bytes (16 tokens a page)."""
    per_token = page_bytes // 16  # bytes per token across layers, K and V
    head_dim = 128
    per_layer = 2 * 2 * head_dim  # K+V, float16
    layers = max(1, min(32, per_token // per_layer))
    heads = per_token // (per_layer * layers)
    assert layers * heads * per_layer * 16 == page_bytes, page_bytes
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, page_tokens=16)


def scope_for(page_bytes: int, tag: str) -> Scope:
    return Scope(
        model_id=f"bench-{tag}", weights_revision="r0", tokenizer_fingerprint="t0",
        kv_dtype="float16", layout=layout_for(page_bytes),
    )


def time_calls(fn: Callable[[int], None], iters: int, warmup: int = 1) -> list[float]:
    for i in range(warmup):
        fn(-1 - i)
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def summarize(name: str, shape: str, nbytes: int, secs: list[float], memcpy_gbs: float | None) -> Timing:
    p50 = statistics.median(secs)
    p99 = sorted(secs)[min(len(secs) - 1, int(len(secs) * 0.99))]
    gbs = nbytes / p50 / 1e9 if nbytes else 0.0
    ratio = gbs / memcpy_gbs if memcpy_gbs and nbytes else None
    return Timing(name, shape, nbytes, p50 * 1e3, p99 * 1e3, gbs, ratio)


def bench_shape(
    paths: list[tuple[str, StoreClient]],
    shape: str,
    count: int,
    page_bytes: int,
    iters: int,
    working_set_bytes: int,
) -> list[Timing]:
    """memcpy vs same-host vs remote put/get of `count` pages of `page_bytes`, side by side.

    Source and destination buffers rotate over sets whose total is at least `working_set_bytes`
    (per side), so no timed copy runs from the CPU cache, for memcpy as for the store: KV pages
    being published or pulled are not cache-hot. A cache-hot memcpy is printed for reference.
    """
    scope = scope_for(page_bytes, shape)
    nbytes = count * page_bytes
    sets = max(1, -(-working_set_bytes // nbytes))
    src = [[bytearray(os.urandom(page_bytes)) for _ in range(count)] for _ in range(sets)]
    dst = [[bytearray(page_bytes) for _ in range(count)] for _ in range(sets)]
    # distinct pages for every timed call (so each put really stores), with rotating payloads
    batches = {}
    for i in range(-2, iters):
        tokens = [(i * 7919 + t) % 50_000 for t in range(count * 16)]
        tokens[0] = (i + 3) % 50_000 + 50_000
        batches[i] = build_pages(scope, tokens, src[i % sets])

    def memcpy(i: int) -> None:
        for s, d in zip(src[i % sets], dst[i % sets], strict=True):
            memoryview(d)[:] = s

    def memcpy_hot(_: int) -> None:
        for s, d in zip(src[0], dst[0], strict=True):
            memoryview(d)[:] = s

    results: list[Timing] = []
    memcpy_t = summarize("memcpy", shape, nbytes, time_calls(memcpy, iters), None)
    results.append(memcpy_t)
    results.append(summarize("memcpy (cache-hot, reference)", shape, nbytes, time_calls(memcpy_hot, iters), None))
    base = memcpy_t.gb_per_s
    for label, client in paths:
        def put(i: int, client: StoreClient = client) -> None:
            client.put(scope, batches[i])

        put_t = time_calls(put, iters, warmup=2)
        results.append(summarize(f"{label} put", shape, nbytes, put_t, base))

        def get(i: int, client: StoreClient = client) -> None:
            batch = batches[i % iters] if i >= 0 else batches[i]
            keys = [p.header.key for p in batch]
            got = client.get(scope, keys, dst[i % sets])
            if got.hit_count != len(keys):
                raise RuntimeError(f"get found {got.hit_count} of {len(keys)} pages")

        results.append(summarize(f"{label} get", shape, nbytes, time_calls(get, iters), base))
        if dst[(iters - 1) % sets][0] != src[(iters - 1) % sets][0]:
            raise RuntimeError(f"{label} get returned wrong bytes")
        client.delete(scope=scope)
    return results


def bench_lookup(client: StoreClient, iters: int) -> list[Timing]:
    scope = scope_for(64 << 10, "lookup")
    payload = [bytearray(64 << 10)] * 512
    tokens = list(range(512 * 16))
    pages = build_pages(scope, tokens, payload)
    for start in range(0, 512, 64):
        client.put(scope, pages[start : start + 64])
    keys = [p.header.key for p in pages]
    miss_keys = [bytes(16), *keys[1:]]

    def hit(_: int) -> None:
        if client.lookup(scope, keys).hit_count != 512:
            raise RuntimeError("lookup missed a stored chain")

    def miss(_: int) -> None:
        if client.lookup(scope, miss_keys).hit_count != 0:
            raise RuntimeError("lookup hit a missing key")

    buf = [bytearray(64 << 10)]

    def get_miss(_: int) -> None:
        if client.get(scope, [bytes(16)], buf).hit_count:
            raise RuntimeError("get of a missing key hit")

    out = [
        summarize("lookup 512 hit", "512 keys", 0, time_calls(hit, iters, 5), None),
        summarize("lookup 512 miss", "512 keys", 0, time_calls(miss, iters, 5), None),
        summarize("get miss", "1 key", 0, time_calls(get_miss, iters, 5), None),
    ]
    client.delete(scope=scope)
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def fio_randread_gbs(folder: Path, size_mib: int) -> float | None:
    """What `fio` reads at random in 1 MiB blocks, direct, one job at a time: a file of
    `size_mib` freshly written, each block read once after the page cache is dropped, as the
    store's SSD test reads its pages (a time-based run re-reads the same blocks for seconds,
    which a host-side cache under a virtual disk then serves)."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    base = [
        fio, "--name=strata-bench", f"--directory={folder}", "--bs=1M", f"--size={size_mib}M",
        "--direct=1", "--ioengine=psync", "--numjobs=1", "--output-format=json",
    ]
    try:
        subprocess.run([*base, "--rw=write"], capture_output=True, check=True, timeout=300)
        drop_page_cache()
        out = subprocess.run(
            [*base, "--rw=randread"], capture_output=True, text=True, check=True, timeout=300
        )
    except (subprocess.SubprocessError, OSError):
        return None
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return float(job["bw_bytes"]) / 1e9


def bench_ssd(remote: StoreClient, shm: StoreClient, folder: Path, pages: int) -> list[Timing]:
    """Store gets of SSD pages (16 a call, in random order, page cache dropped) against `fio`
    random 1 MiB reads, interleaved in rounds: this virtual disk's speed changes by 2x from one
    minute to the next, so each round measures both on the same disk."""
    scope = scope_for(1 << 20, "ssd")
    src = [bytearray(os.urandom(1 << 20)) for _ in range(pages)]
    batch = build_pages(scope, list(range(pages * 16)), src)
    remote.put(scope, batch, tier=Tier.SSD)
    keys = [p.header.key for p in batch]
    random.Random(7).shuffle(keys)
    dst = [bytearray(1 << 20) for _ in range(16)]
    rounds = max(1, min(4, pages // 64))
    per_round = len(keys) // rounds // 16 * 16
    secs: list[float] = []
    fio_secs: list[float] = []  # seconds per MiB, each round
    dropped = True
    for r in range(rounds):
        fio = fio_randread_gbs(folder, per_round)
        if fio is not None:
            fio_secs.append((1 << 20) / (fio * 1e9))
        dropped = drop_page_cache() and dropped
        for start in range(r * per_round, (r + 1) * per_round, 16):
            t0 = time.perf_counter()
            got = shm.get(scope, keys[start : start + 16], dst)
            secs.append(time.perf_counter() - t0)
            if got.hit_count != 16:
                raise RuntimeError("SSD get missed")
    fio_gbs = (1 << 20) / (statistics.mean(fio_secs) * 1e9) if fio_secs else None
    note = "page cache dropped" if dropped else "page cache NOT dropped (not allowed here)"
    out = [summarize(f"ssd get ({note})", "16 x 1MiB", 16 << 20, secs, fio_gbs)]
    if fio_gbs is not None:
        out.append(Timing(f"fio randread 1MiB ({rounds} rounds)", "direct", 0, 0.0, 0.0, fio_gbs, None))
    remote.delete(scope=scope)
    return out


def bench_ucx(folder: Path, ns: argparse.Namespace) -> list[Timing]:
    """The remote UCX path, on a daemon of its own with its UCX listener on (memcpy re-measured
    in the same run, so its ratios are side by side too)."""
    rows: list[Timing] = []
    with DaemonProcess(folder, dram="2GiB", ssd="0", extra=["--set", "server.ucx=true"]) as daemon:
        client = StoreClient(daemon.address, shared_memory=False, tcp=False, timeout_s=60)
        try:
            client.connect()
            if client.transport != "ucx":
                print("  (no UCX data path here: ucxx is missing or unusable)", flush=True)
                return rows
            for shape in ns.shapes.split(","):
                count, page_bytes = SHAPES[shape]
                print(f"  UCX: {count} x {shape} pages ...", flush=True)
                part = bench_shape(
                    [("remote UCX", client)], shape, count, page_bytes, ns.iters,
                    ns.working_set_mib << 20,
                )
                rows += [
                    dataclasses.replace(r, name=f"{r.name} [UCX run]")
                    if r.name.startswith("memcpy") else r
                    for r in part
                ]
        finally:
            client.close()
    return rows


def print_table(rows: list[Timing]) -> None:
    print(f"{'operation':<44} {'batch':<10} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>7} {'xmemcpy':>8}")
    for r in rows:
        ratio = f"{r.ratio_to_memcpy:.2f}" if r.ratio_to_memcpy is not None else ""
        gbs = f"{r.gb_per_s:.2f}" if r.gb_per_s else ""
        print(f"{r.name:<44} {r.shape:<10} {r.p50_ms:>9.3f} {r.p99_ms:>9.3f} {gbs:>7} {ratio:>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench store", description=__doc__)
    p.add_argument("--iters", type=int, default=15, help="timed calls per measurement")
    p.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    p.add_argument("--ssd-pages", type=int, default=128, help="1 MiB pages for the SSD read test (0 = skip)")
    p.add_argument(
        "--working-set-mib", type=int, default=256,
        help="buffers rotate over at least this much memory per side, beyond the CPU cache",
    )
    p.add_argument(
        "--no-ucx", dest="ucx", action="store_false",
        help="skip the remote UCX rows (measured on a second daemon with its UCX listener on)",
    )
    p.add_argument("--dir", type=Path, help="daemon state folder (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the results here")
    ns = p.parse_args(argv)
    folder = ns.dir or Path(tempfile.mkdtemp(prefix="strata-bench-"))
    rows: list[Timing] = []
    print(f"strata bench store: daemon in its own process, state in {folder}", flush=True)
    with DaemonProcess(folder, dram="2GiB", ssd="2GiB") as daemon:
        shm = StoreClient(daemon.address, shared_memory=True, ucx=False, timeout_s=60)
        grpc_client = StoreClient(
            daemon.address, shared_memory=False, ucx=False, tcp=False, timeout_s=60
        )
        tcp_client = StoreClient(
            daemon.address, shared_memory=False, ucx=False, tcp=True, timeout_s=60
        )
        paths = [("same-host", shm), ("remote TCP", tcp_client), ("remote gRPC", grpc_client)]
        try:
            for shape in ns.shapes.split(","):
                count, page_bytes = SHAPES[shape]
                print(f"  {count} x {shape} pages ...", flush=True)
                rows += bench_shape(
                    paths, shape, count, page_bytes, ns.iters, ns.working_set_mib << 20
                )
            print("  lookups ...", flush=True)
            rows += bench_lookup(shm, max(ns.iters, 50))
            if ns.ssd_pages:
                print("  SSD tier ...", flush=True)
                rows += bench_ssd(grpc_client, shm, folder, ns.ssd_pages)
        finally:
            for _, client in paths:
                client.close()
    if ns.ucx:
        rows += bench_ucx(folder / "ucx", ns)
    print()
    print_table(rows)
    if ns.json:
        ns.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
        print(f"\nwrote {ns.json}")
    if ns.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
