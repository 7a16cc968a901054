"""`strata bench store`: the store's put/get/lookup as an engine pays for them, side by side with
memcpy and, with `--against mooncake`, with Mooncake Store in the same run.

The daemon runs in its own process (started here on loopback, port 0, in a temporary folder).
For each batch shape (64 x 64 KiB, 64 x 1 MiB, 16 x 4 MiB by default) it times, in the same run,
on the same source and destination buffers:

- a plain memcpy of the same bytes;
- on each path (same-host shared memory, remote TCP, remote gRPC; UCX on a second daemon where
  ucxx works) a put and a get **as paid**, and the same **bare**. A put as paid builds its pages'
  headers inside the timed call (`build_pages`, as the engine's publisher does: the key chain,
  and on a remote path the xxh3 checksum of every payload, which `encode()` computes inside the
  put; a same-host put leaves the checksum to the daemon, which computes it when the page's
  bytes leave DRAM); bare, it puts headers built (and, after the first call, checksummed)
  beforehand. A get as paid asks for verification (`verify=True`, what `engine.store_link` asks
  for: on a remote path the payload checksum of every page received; on the same host the slot
  generation fence, no payload hash) and passes the pages' token ids (the SDK checks key, scope,
  KV format and exact tokens against each header, as the engine's pull does); bare, it only
  counts hits (`verify=False`). The gap between the two is integrity's cost;
- with `--against mooncake`: Mooncake's zero-copy batch API on the same buffers, with its
  storage in this process (same-host) and in another process over its TCP transport (remote),
  and the ratios of Strata as paid to Mooncake (see `loadtests.peers.mooncake_rows`).

Then a lookup of a 512-page chain (hit and miss) and a get that misses, per path; SSD-tier gets as
paid against `fio` (total bytes over total time, both); and a run into a full store: puts of
`--full-factor` times what its DRAM holds, timing the eviction and demotion they cause against
puts into the same store while it had room. Prints GB/s, p50/p99 per batch call and ratios;
`--json PATH` writes it all.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from client import (
    CapacityExhausted,
    KVLayout,
    Scope,
    StoreClient,
    build_pages,
    page_keys,
    page_tokens,
)
from client.contract.types import Tier
from loadtests.daemon import DaemonProcess
from loadtests.peers import mooncake

SHAPES = {"64KiB": (64, 64 << 10), "1MiB": (64, 1 << 20), "4MiB": (16, 4 << 20)}
PAGE_TOKENS = 16
AS_PAID, BARE = "as paid", "bare"


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured row. `cost` is "as paid" or "bare" for Strata's put/get rows, "" for the
    baselines, latencies and peers; `gb_per_s` is bytes over the p50 call, or over the total
    time where `note` says so."""

    name: str
    shape: str
    bytes_per_call: int
    p50_ms: float
    p99_ms: float
    gb_per_s: float
    ratio_to_memcpy: float | None
    cost: str = ""
    note: str = ""


def layout_for(page_bytes: int) -> KVLayout:
    """A float16 layout whose page payload is exactly page_bytes (16 tokens a page)."""
    per_token = page_bytes // PAGE_TOKENS  # bytes per token across layers, K and V
    head_dim = 128
    per_layer = 2 * 2 * head_dim  # K+V, float16
    layers = max(1, min(32, per_token // per_layer))
    heads = per_token // (per_layer * layers)
    assert layers * heads * per_layer * PAGE_TOKENS == page_bytes, page_bytes
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, page_tokens=PAGE_TOKENS)


def scope_for(page_bytes: int, tag: str) -> Scope:
    return Scope(
        model_id=f"bench-{tag}", weights_revision="r0", tokenizer_fingerprint="t0",
        kv_dtype="float16", layout=layout_for(page_bytes),
    )


def round_indices(r: int, k: int) -> tuple[range, range]:
    """Call indices of round r of k timed calls: two untimed warm-up calls, then the k timed."""
    first = r * (k + 2)
    return range(first, first + 2), range(first + 2, first + 2 + k)


class Samples:
    """Seconds per call of every measurement, gathered over rounds that interleave all of them
    (so a machine whose load changes from one minute to the next slows each side alike)."""

    def __init__(self) -> None:
        self._secs: dict[tuple[str, str, int, str], list[float]] = {}

    def time(
        self,
        name: str,
        shape: str,
        nbytes: int,
        cost: str,
        fn: Callable[[int], None],
        timed: Sequence[int],
        warm: Sequence[int] = (),
    ) -> None:
        """Call fn(i) for each i of `warm` untimed, then of `timed`, timing each call."""
        for i in warm:
            fn(i)
        out = self._secs.setdefault((name, shape, nbytes, cost), [])
        for i in timed:
            t0 = time.perf_counter()
            fn(i)
            out.append(time.perf_counter() - t0)

    def rows(self) -> list[Timing]:
        """One row per measurement, in the order first timed; ratios to the same shape's memcpy."""
        memcpy = {
            shape: summarize(name, shape, n, secs, None).gb_per_s
            for (name, shape, n, _), secs in self._secs.items()
            if name == "memcpy"
        }
        return [
            summarize(name, shape, n, secs, None if name == "memcpy" else memcpy.get(shape), cost)
            for (name, shape, n, cost), secs in self._secs.items()
        ]


def summarize(
    name: str, shape: str, nbytes: int, secs: list[float], memcpy_gbs: float | None, cost: str = ""
) -> Timing:
    p50 = statistics.median(secs)
    p99 = sorted(secs)[min(len(secs) - 1, int(len(secs) * 0.99))]
    gbs = nbytes / p50 / 1e9 if nbytes else 0.0
    ratio = gbs / memcpy_gbs if memcpy_gbs and nbytes else None
    return Timing(name, shape, nbytes, p50 * 1e3, p99 * 1e3, gbs, ratio, cost)


def total_rate(
    name: str, shape: str, nbytes: int, secs: list[float], base_gbs: float | None, note: str
) -> Timing:
    """A row whose GB/s is all bytes over all the time (`nbytes` per call)."""
    row = summarize(name, shape, nbytes, secs, None)
    gbs = nbytes * len(secs) / sum(secs) / 1e9
    return dataclasses.replace(
        row, gb_per_s=gbs, ratio_to_memcpy=gbs / base_gbs if base_gbs else None, note=note
    )


class ShapeData:
    """The bytes of one batch shape: `sets` batches of `count` pages in one source and one
    destination arena, each at least `working_set_bytes`, so no timed copy runs from the CPU
    cache (KV pages being published or pulled are not cache-hot). Call i uses set i % sets and
    tokens of its own, so every put stores fresh pages."""

    def __init__(self, shape: str, count: int, page_bytes: int, working_set_bytes: int) -> None:
        self.shape, self.count, self.page_bytes = shape, count, page_bytes
        self.nbytes = count * page_bytes
        self.sets = max(1, -(-working_set_bytes // self.nbytes))
        self.src = bytearray(os.urandom(self.sets * self.nbytes))
        self.dst = bytearray(self.sets * self.nbytes)
        src, dst = memoryview(self.src), memoryview(self.dst)
        self._src = [self._pages(src, s) for s in range(self.sets)]
        self._dst = [self._pages(dst, s) for s in range(self.sets)]

    def _pages(self, arena: memoryview, s: int) -> list[memoryview]:
        return [arena[self.offset(s, j) : self.offset(s, j) + self.page_bytes] for j in range(self.count)]

    def offset(self, i: int, j: int) -> int:
        """Where page j of call i lies in either arena."""
        return (i % self.sets) * self.nbytes + j * self.page_bytes

    def src_pages(self, i: int) -> list[memoryview]:
        return self._src[i % self.sets]

    def dst_pages(self, i: int) -> list[memoryview]:
        return self._dst[i % self.sets]

    def tokens(self, i: int) -> list[int]:
        out = [(i * 7919 + t) % 50_000 for t in range(self.count * PAGE_TOKENS)]
        out[0] = (i + 3) % 50_000 + 50_000
        return out

    def same(self, i: int) -> bool:
        """The destination of call i holds the source bytes of call i."""
        a = self.offset(i, 0)
        return self.dst[a : a + self.nbytes] == self.src[a : a + self.nbytes]

    def clear_dst(self, i: int) -> None:
        a = self.offset(i, 0)
        self.dst[a : a + self.nbytes] = bytes(self.nbytes)


def bench_memcpy(data: ShapeData, timed: Sequence[int], samples: Samples) -> None:
    def memcpy(i: int) -> None:
        for s, d in zip(data.src_pages(i), data.dst_pages(i), strict=True):
            d[:] = s

    def memcpy_hot(_: int) -> None:
        for s, d in zip(data.src_pages(0), data.dst_pages(0), strict=True):
            d[:] = s

    samples.time("memcpy", data.shape, data.nbytes, "", memcpy, timed)
    samples.time("memcpy (cache-hot, reference)", data.shape, data.nbytes, "", memcpy_hot, timed)


def bench_strata_path(
    label: str,
    client: StoreClient,
    data: ShapeData,
    warm: Sequence[int],
    timed: Sequence[int],
    samples: Samples,
) -> None:
    """Put and get as paid and bare on one path, one round (see the module docstring)."""
    paid_scope = scope_for(data.page_bytes, f"{data.shape}-paid")
    bare_scope = scope_for(data.page_bytes, f"{data.shape}-bare")
    calls = [*warm, *timed]
    tokens = {i: data.tokens(i) for i in calls}
    paid_keys = {i: page_keys(paid_scope, tokens[i]) for i in calls}
    bare_pages = {i: build_pages(bare_scope, tokens[i], data.src_pages(i)) for i in calls}
    shape, n = data.shape, data.nbytes

    def put_paid(i: int) -> None:
        pages = build_pages(paid_scope, tokens[i], data.src_pages(i))
        if client.put(paid_scope, pages).stored != data.count:
            raise RuntimeError(f"{label} put stored fewer than {data.count} fresh pages")

    def put_bare(i: int) -> None:
        if client.put(bare_scope, bare_pages[i]).stored != data.count:
            raise RuntimeError(f"{label} put stored fewer than {data.count} fresh pages")

    def get_paid(i: int) -> None:
        keys = paid_keys[i]
        want = page_tokens(paid_scope, tokens[i])
        got = client.get(paid_scope, keys, data.dst_pages(i), tokens=want, verify=True)
        if got.prefix_hits != data.count:
            raise RuntimeError(f"{label} get: {got.prefix_hits} of {data.count} pages usable")

    def get_bare(i: int) -> None:
        got = client.get(paid_scope, paid_keys[i], data.dst_pages(i), tokens=None, verify=False)
        if got.hit_count != data.count:
            raise RuntimeError(f"{label} get found {got.hit_count} of {data.count} pages")

    last = timed[-1]
    samples.time(f"{label} put", shape, n, AS_PAID, put_paid, timed, warm)
    samples.time(f"{label} put", shape, n, BARE, put_bare, timed, warm)
    data.clear_dst(last)
    samples.time(f"{label} get", shape, n, AS_PAID, get_paid, timed, timed[:1])
    if not data.same(last):
        raise RuntimeError(f"{label} get returned wrong bytes")
    data.clear_dst(last)
    samples.time(f"{label} get", shape, n, BARE, get_bare, timed, timed[:1])
    if not data.same(last):
        raise RuntimeError(f"{label} bare get returned wrong bytes")
    client.delete(scope=paid_scope)
    client.delete(scope=bare_scope)


Call = tuple[str, str, Callable[[int], None]]  # (row name, batch, the call)


@contextlib.contextmanager
def lookup_calls(label: str, client: StoreClient) -> Iterator[list[Call]]:
    """A stored 512-page chain and the calls that time it: a lookup of it all, a lookup whose
    first page is missing, and a get of one missing page. Deleted on exit."""
    scope = scope_for(64 << 10, "lookup")
    payload = [bytearray(64 << 10)] * 512
    tokens = list(range(512 * PAGE_TOKENS))
    pages = build_pages(scope, tokens, payload)
    for start in range(0, 512, 64):
        client.put(scope, pages[start : start + 64])
    keys = [p.header.key for p in pages]
    miss_keys = [bytes(16), *keys[1:]]
    buf = [bytearray(64 << 10)]

    def hit(_: int) -> None:
        if client.lookup(scope, keys).hit_count != 512:
            raise RuntimeError("lookup missed a stored chain")

    def miss(_: int) -> None:
        if client.lookup(scope, miss_keys).hit_count != 0:
            raise RuntimeError("lookup hit a missing key")

    def get_miss(_: int) -> None:
        if client.get(scope, [bytes(16)], buf, tokens=None).hit_count:
            raise RuntimeError("get of a missing key hit")

    try:
        yield [
            (f"{label} lookup 512 hit", "512 keys", hit),
            (f"{label} lookup 512 miss", "512 keys", miss),
            (f"{label} get miss", "1 key", get_miss),
        ]
    finally:
        client.delete(scope=scope)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def fio_randread(folder: Path, size_mib: int) -> tuple[int, float] | None:
    """(bytes, seconds) `fio` reads at random in 1 MiB blocks, direct, one job: a file of
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
    return int(job["io_bytes"]), float(job["runtime"]) / 1e3


def bench_ssd(remote: StoreClient, shm: StoreClient, folder: Path, pages: int) -> list[Timing]:
    """Same-host gets as paid (verified, headers checked) of SSD pages, 16 a call in random
    order, page cache dropped, against `fio` random 1 MiB reads, interleaved in rounds (this
    virtual disk's speed changes by 2x from one minute to the next, so each round measures both
    on the same disk). Both rates are total bytes over total time."""
    scope = scope_for(1 << 20, "ssd")
    src = [bytearray(os.urandom(1 << 20)) for _ in range(pages)]
    tokens = list(range(pages * PAGE_TOKENS))
    batch = build_pages(scope, tokens, src)
    remote.put(scope, batch, tier=Tier.SSD)
    order = list(range(pages))
    random.Random(7).shuffle(order)
    dst = [bytearray(1 << 20) for _ in range(16)]
    rounds = max(1, min(4, pages // 64))
    per_round = pages // rounds // 16 * 16
    secs: list[float] = []
    fio_bytes, fio_secs = 0, 0.0
    dropped = True
    for r in range(rounds):
        fio = fio_randread(folder, per_round)
        if fio is not None:
            fio_bytes, fio_secs = fio_bytes + fio[0], fio_secs + fio[1]
        dropped = drop_page_cache() and dropped
        for start in range(r * per_round, (r + 1) * per_round, 16):
            chosen = order[start : start + 16]
            keys = [batch[p].header.key for p in chosen]
            want = [batch[p].header.tokens for p in chosen]
            t0 = time.perf_counter()
            got = shm.get(scope, keys, dst, tokens=want, verify=True)
            if got.hit_count != len(chosen) or got.rejected:
                raise RuntimeError("SSD get missed or served another page")
            secs.append(time.perf_counter() - t0)
    fio_gbs = fio_bytes / fio_secs / 1e9 if fio_secs else None
    note = "page cache dropped" if dropped else "page cache NOT dropped (not allowed here)"
    out = [
        total_rate(
            "same-host get from SSD", "16 x 1MiB", 16 << 20, secs, fio_gbs,
            f"total bytes / total time, {note}; ratio is to fio",
        )
    ]
    out[0] = dataclasses.replace(out[0], cost=AS_PAID)
    if fio_gbs is not None:
        out.append(
            Timing(
                f"fio randread 1MiB ({rounds} rounds)", "direct", 0, 0.0, 0.0, fio_gbs, None,
                note="total bytes / total time",
            )
        )
    remote.delete(scope=scope)
    return out


def bench_full_store(folder: Path, dram_mib: int, factor: int, shape: str, working_set_mib: int) -> list[Timing]:
    """Same-host puts as paid of `factor` times what the DRAM tier holds, into a daemon of its
    own (SSD twice as large as all of it): the puts made while DRAM had room against those made
    once it was full, where every reservation first evicts (demotes to SSD). Total bytes over
    total time, both; the note counts the demotions and any pages refused."""
    count, page_bytes = SHAPES[shape]
    data = ShapeData(shape, count, page_bytes, min(working_set_mib << 20, (dram_mib << 20) // 2))
    dram_bytes = dram_mib << 20
    calls = max(4, factor * dram_bytes // data.nbytes)
    scope = scope_for(page_bytes, "full")
    room: list[float] = []
    full: list[float] = []
    refused = 0
    ssd = f"{2 * factor * dram_mib}MiB"
    with DaemonProcess(folder, dram=f"{dram_mib}MiB", ssd=ssd) as daemon:
        client = StoreClient(daemon.address, shared_memory=True, ucx=False, timeout_s=60)
        try:
            before = client.stats()
            for c in range(calls):
                t0 = time.perf_counter()
                try:
                    client.put(scope, build_pages(scope, data.tokens(c), data.src_pages(c)))
                except CapacityExhausted:
                    refused += data.count
                dt = time.perf_counter() - t0
                put_before = c * data.nbytes
                if put_before + data.nbytes <= dram_bytes // 2:
                    room.append(dt)
                elif put_before >= dram_bytes:
                    full.append(dt)
            after = client.stats()
        finally:
            client.close()
    if not room or not full:
        raise RuntimeError("the full-store run needs puts both into room and into a full DRAM")
    demoted = after.demotions - before.demotions
    into_room = total_rate(
        "same-host put into room", data.shape, data.nbytes, room, None,
        f"total bytes / total time, DRAM {dram_mib} MiB less than half full",
    )
    into_full = total_rate(
        "same-host put into a full store", data.shape, data.nbytes, full, into_room.gb_per_s,
        f"total bytes / total time, DRAM full: {demoted} pages demoted to SSD, {refused} refused; "
        "ratio is to the puts into room",
    )
    return [dataclasses.replace(into_room, cost=AS_PAID), dataclasses.replace(into_full, cost=AS_PAID)]


def bench_ucx(folder: Path, ns: argparse.Namespace) -> list[Timing]:
    """The remote UCX path, on a daemon of its own with its UCX listener on (memcpy re-measured
    in the same run and rounds, so its ratios are side by side too)."""
    samples = Samples()
    # an open daemon serves UCX (which listens on every interface) only with allow_open
    ucx_on = ["--set", "server.ucx=true", "--set", "server.allow_open=true"]
    with DaemonProcess(folder, dram="2GiB", ssd="0", extra=ucx_on) as daemon:
        client = StoreClient(daemon.address, shared_memory=False, tcp=False, timeout_s=60)
        try:
            client.connect()
            if client.transport != "ucx":
                print("  (no UCX data path here: ucxx is missing or unusable)", flush=True)
                return []
            for shape in ns.shapes.split(","):
                count, page_bytes = SHAPES[shape]
                print(f"  UCX: {count} x {shape} pages ...", flush=True)
                data = ShapeData(shape, count, page_bytes, ns.working_set_mib << 20)
                for r in range(ns.rounds):
                    warm, timed = round_indices(r, per_round(ns))
                    bench_memcpy(data, timed, samples)
                    bench_strata_path("remote UCX", client, data, warm, timed, samples)
        finally:
            client.close()
    return [
        dataclasses.replace(r, name=f"{r.name} [UCX run]") if r.name.startswith("memcpy") else r
        for r in samples.rows()
    ]


def per_round(ns: argparse.Namespace) -> int:
    """Timed calls of each measurement in one round (`--iters` spread over `--rounds`)."""
    return max(1, -(-ns.iters // ns.rounds))


def print_table(rows: Sequence[Timing]) -> None:
    print(f"{'operation':<44} {'cost':<8} {'batch':<10} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>7} {'ratio':>6}")
    for r in rows:
        ratio = f"{r.ratio_to_memcpy:.2f}" if r.ratio_to_memcpy is not None else ""
        gbs = f"{r.gb_per_s:.2f}" if r.gb_per_s else ""
        print(f"{r.name:<44} {r.cost:<8} {r.shape:<10} {r.p50_ms:>9.3f} {r.p99_ms:>9.3f} {gbs:>7} {ratio:>6}")
        if r.note:
            print(f"{'':<6}({r.note})")
    print("ratio: to memcpy of the same bytes in the same run, unless the note says otherwise")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="strata bench store", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--iters", type=int, default=15, help="timed calls per measurement")
    p.add_argument(
        "--rounds", type=int, default=3,
        help="the timed calls are spread over this many rounds, each running every measurement",
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    p.add_argument(
        "--ssd-pages", type=int, default=128, help="1 MiB pages for the SSD read test (0 = skip)"
    )
    p.add_argument(
        "--working-set-mib", type=int, default=256,
        help="buffers rotate over at least this much memory per side, beyond the CPU cache",
    )
    p.add_argument("--dram", default="2GiB", help="the main daemon's DRAM tier")
    p.add_argument(
        "--full-dram-mib", type=int, default=512,
        help="DRAM of the full-store run's daemon (0 = skip that run)",
    )
    p.add_argument(
        "--full-factor", type=int, default=3, help="the full-store run puts this many times its DRAM"
    )
    p.add_argument(
        "--full-shape", default="1MiB", choices=list(SHAPES), help="pages of the full-store run"
    )
    p.add_argument(
        "--no-ucx", dest="ucx", action="store_false",
        help="skip the remote UCX rows (measured on a second daemon with its UCX listener on)",
    )
    p.add_argument(
        "--against", choices=[mooncake.NAME], action="append", default=[],
        help="also run the same batches through this store in the same run and print ratios",
    )
    p.add_argument(
        "--latency-only", action="store_true",
        help="only the per-call rows (lookups of a 512-page chain, a missing get): no batch shapes,"
        " SSD, full-store or UCX runs; each such row gets --iters timed calls (at least 50)",
    )
    p.add_argument("--dir", type=Path, help="daemon state folder (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the results here")
    ns = p.parse_args(argv)
    if ns.latency_only:
        ns.ssd_pages, ns.full_dram_mib, ns.ucx = 0, 0, False
    shapes = ns.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    if ns.iters < 1 or ns.rounds < 1:
        p.error("--iters and --rounds must be at least 1")
    folder = ns.dir or Path(tempfile.mkdtemp(prefix="strata-bench-"))
    peer_status: dict[str, object] = {"asked": bool(ns.against), "measured": False, "note": ""}
    if ns.against:
        reason = mooncake.missing_reason()
        if reason is not None:
            peer_status["note"] = reason
            print(f"strata bench store: {reason}\n  Comparing with memcpy alone.", flush=True)
    use_mooncake = bool(ns.against) and not peer_status["note"]
    k = per_round(ns)
    samples = Samples()
    rows: list[Timing] = []
    print(f"strata bench store: daemon in its own process, state in {folder}", flush=True)
    largest = max(SHAPES[s][0] * SHAPES[s][1] for s in shapes)
    segment_bytes = max(64 << 20, (k + 3) * largest * 5 // 4)
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(DaemonProcess(folder, dram=ns.dram, ssd="2GiB"))
        shm = StoreClient(daemon.address, shared_memory=True, ucx=False, timeout_s=60)
        grpc_client = StoreClient(
            daemon.address, shared_memory=False, ucx=False, tcp=False, timeout_s=60
        )
        tcp_client = StoreClient(
            daemon.address, shared_memory=False, ucx=False, tcp=True, timeout_s=60
        )
        paths = [("same-host", shm), ("remote TCP", tcp_client), ("remote gRPC", grpc_client)]
        for _, client in paths:
            stack.callback(client.close)
        peers: list[tuple[str, mooncake.MooncakeClient]] = []
        if use_mooncake:
            from loadtests.peers import mooncake_rows  # it imports this module's row types

            print("  starting Mooncake (master and storage process on loopback) ...", flush=True)
            local, remote = stack.enter_context(
                mooncake_rows.mooncake_peers(folder / "mooncake", segment_bytes)
            )
            peers = [("mooncake same-host", local), ("mooncake remote", remote)]
        for shape in [] if ns.latency_only else shapes:
            count, page_bytes = SHAPES[shape]
            print(f"  {count} x {shape} pages, {ns.rounds} rounds ...", flush=True)
            data = ShapeData(shape, count, page_bytes, ns.working_set_mib << 20)
            bases = {label: (peer.register(data.src), peer.register(data.dst)) for label, peer in peers}
            for r in range(ns.rounds):
                warm, timed = round_indices(r, k)
                bench_memcpy(data, timed, samples)
                for label, client in paths:
                    bench_strata_path(label, client, data, warm, timed, samples)
                for label, peer in peers:
                    mooncake_rows.bench_mooncake_path(
                        label, peer, bases[label], data, warm, timed, samples
                    )
            for _, peer in peers:
                peer.unregister_all()
            del data
        print("  lookups ...", flush=True)
        with contextlib.ExitStack() as lookups:
            calls = [
                call
                for label, client in paths[:2]
                for call in lookups.enter_context(lookup_calls(label, client))
            ] + [
                call
                for label, peer in peers
                for call in lookups.enter_context(mooncake_rows.mooncake_lookup_calls(label, peer))
            ]
            lookup_k = max(k, -(-50 // ns.rounds))  # per-call rows: at least 50 samples
            for _ in range(ns.rounds):
                for name, batch, fn in calls:
                    samples.time(name, batch, 0, "", fn, range(lookup_k), range(2))
        peer_status["measured"] = bool(peers)
        rows += samples.rows()
        if ns.ssd_pages:
            print("  SSD tier ...", flush=True)
            rows += bench_ssd(grpc_client, shm, folder, ns.ssd_pages)
    if ns.full_dram_mib:
        print("  a full store ...", flush=True)
        rows += bench_full_store(
            folder / "full", ns.full_dram_mib, ns.full_factor, ns.full_shape, ns.working_set_mib
        )
    if ns.ucx:
        rows += bench_ucx(folder / "ucx", ns)
    ratios = mooncake_rows.mooncake_ratios(rows) if use_mooncake else []
    print()
    print_table(rows)
    if ratios:
        mooncake_rows.print_ratios(ratios)
    elif ns.against:
        print(f"\nno Mooncake rows: {peer_status['note']}")
    if ns.json:
        report = {
            "command": ["strata", "bench", "store", *(argv if argv is not None else sys.argv[1:])],
            "rows": [asdict(r) for r in rows],
            "mooncake": peer_status,
            "mooncake_ratios": [asdict(m) for m in ratios],
        }
        ns.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {ns.json}")
    if ns.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
