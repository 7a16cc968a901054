"""`strata bench cluster`: aggregate put/get throughput and lookup latency, 1 node vs N nodes.

Starts `--nodes` daemons (children on loopback, port 0, in a temporary folder) and, in the same
run, times a `ClusterClient` over the first daemon alone (replicas 1) and over all of them (with
`--replicas`): puts of `--batch` pages of `--page-kib` KiB (fresh pages each call), gets of pages
already stored, and lookups of a `--chain`-page prompt that is fully cached. Membership is the
fixed address list (no etcd needed); placement is the same rendezvous hashing as with etcd.
Prints GB/s of payload the caller moved, p50/p99 per call and the N-node/1-node ratios;
`--json PATH` writes it all.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from client import ClusterClient, Page, Scope, build_pages
from loadtests.bench_store import scope_for
from loadtests.daemon import DaemonProcess


@dataclass(frozen=True, slots=True)
class Row:
    nodes: int
    replicas: int
    op: str
    p50_ms: float
    p99_ms: float
    gb_per_s: float  # payload bytes per second the caller moved (0 for lookups)


def _pages(scope: Scope, count: int, seed: int) -> list[Page]:
    rng = random.Random(seed)
    size = scope.page_payload_bytes
    tokens = [rng.randrange(50_000) for _ in range(count * scope.layout.page_tokens)]
    payloads = [rng.randbytes(size) for _ in range(count)]
    return build_pages(scope, tokens, payloads)


def _time(calls: int, fn: Callable[[int], None]) -> list[float]:
    out: list[float] = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
    return out


def _row(nodes: int, replicas: int, op: str, secs: list[float], bytes_per_call: int) -> Row:
    ordered = sorted(secs)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    total = sum(secs)
    return Row(nodes, replicas, op, statistics.median(secs) * 1e3, p99 * 1e3,
               bytes_per_call * len(secs) / total / 1e9 if bytes_per_call else 0.0)


def measure(addresses: list[str], replicas: int, args: argparse.Namespace, tag: str) -> list[Row]:
    scope = scope_for(args.page_kib << 10, tag)
    size = scope.page_payload_bytes
    batch_bytes = args.batch * size
    batches = [_pages(scope, args.batch, seed=1000 + i) for i in range(args.iters)]
    prompt = _pages(scope, args.chain, seed=7)
    n = len(addresses)
    rows: list[Row] = []
    with ClusterClient(addresses=addresses, replicas=replicas) as client:
        client.put(scope, prompt)
        secs = _time(args.iters, lambda i: client.put(scope, batches[i]))
        rows.append(_row(n, replicas, "put", secs, batch_bytes))
        into = [bytearray(size) for _ in range(args.batch)]
        keys = [[p.header.key for p in b] for b in batches]

        def get(i: int) -> None:
            if client.get(scope, keys[i], into, tokens=[p.header.tokens for p in batches[i]]).hit_count != args.batch:
                raise RuntimeError("bench get missed pages it had just put")

        rows.append(_row(n, replicas, "get", _time(args.iters, get), batch_bytes))
        chain_keys = [p.header.key for p in prompt]

        def lookup(i: int) -> None:
            if client.lookup(scope, chain_keys).hit_count != args.chain:
                raise RuntimeError("bench lookup missed a cached prompt")

        rows.append(_row(n, replicas, "lookup", _time(args.iters * 4, lookup), 0))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench cluster", description=__doc__)
    p.add_argument("--nodes", type=int, default=3, help="daemons in the multi-node run")
    p.add_argument("--replicas", type=int, default=2, help="replica count R of the multi-node run")
    p.add_argument("--batch", type=int, default=32, help="pages per put/get call")
    p.add_argument("--page-kib", type=int, default=256, help="page payload size (KiB)")
    p.add_argument("--chain", type=int, default=128, help="pages of the prompt looked up")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--dram", default="1GiB", help="DRAM budget of each daemon")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.nodes < 2 or not 1 <= args.replicas <= args.nodes:
        p.error("need --nodes >= 2 and 1 <= --replicas <= --nodes")
    with tempfile.TemporaryDirectory(prefix="strata-bench-cluster-") as tmp:
        procs = [
            DaemonProcess(Path(tmp) / f"n{i}", dram=args.dram, ssd="0") for i in range(args.nodes)
        ]
        try:
            for proc in procs:
                proc.start()
            addresses = [proc.address for proc in procs]
            rows = measure(addresses[:1], 1, args, "one")
            rows += measure(addresses, args.replicas, args, "many")
        finally:
            for proc in procs:
                proc.stop()
    print(f"{'nodes':>5} {'R':>2} {'op':<7} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r.nodes:>5} {r.replicas:>2} {r.op:<7} {r.p50_ms:>9.2f} {r.p99_ms:>9.2f} "
              f"{r.gb_per_s:>7.2f}")
    ratios: dict[str, float] = {}
    for op in ("put", "get", "lookup"):
        one = next(r for r in rows if r.nodes == 1 and r.op == op)
        many = next(r for r in rows if r.nodes == args.nodes and r.op == op)
        ratios[f"{op}_p50_{args.nodes}v1"] = many.p50_ms / one.p50_ms if one.p50_ms else 0.0
    print("ratios (N nodes / 1 node, p50 time per call; <1 is faster):")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}")
    if args.json:
        doc = {"args": {k: v for k, v in vars(args).items() if k != "json"},
               "rows": [asdict(r) for r in rows], "ratios": ratios}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0
