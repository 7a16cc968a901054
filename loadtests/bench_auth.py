"""`strata bench auth`: what store principals cost a caller, open vs tokens, side by side.

Starts two daemons (`strata serve` child processes on loopback), one open and one with a
tokens file, stores the same pages in each, and times the calls an engine and the router make,
through `StoreClient` over gRPC: a lookup of a chain of keys (unary) and a get of its pages
(streamed). Each round calls both daemons, in alternating order, so that whatever else the
machine does falls on both alike. Reported per kind: the median and the 10th percentile (the
calls least disturbed by other work) of each daemon's times, and the median of the rounds' own
tokens/open ratios. With tokens a call also carries its bearer token and its scope's canonical
encoding, and the daemon hashes the token, compares it with every principal's and decodes (once,
then cached) the scope to check its namespace.

    strata bench auth [--pages 8] [--rounds 400] [--principals 16] [--json PATH]

What a row leaves out: the same-host and TCP/UCX paths (their token travels once per
connection, not per call).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from client import KVLayout, Scope, StoreClient, Unauthenticated, build_pages, page_tokens
from loadtests.daemon import DaemonProcess

_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_tokens=16)
_TOKEN = "bench-token-0123456789abcdef"


def _daemon(data: Path, tokens_file: Path | None) -> DaemonProcess:
    sets = ["server.unix_socket=off", "server.ucx=false", "server.tcp=false"]
    if tokens_file is not None:
        sets.append(f"auth.tokens_file={tokens_file}")
    extra = [arg for item in sets for arg in ("--set", item)]
    return DaemonProcess(data, dram="64MiB", ssd="0", extra=extra)


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _tokens_file(path: Path, principals: int) -> Path:
    """`principals` entries (every one is compared on each call); the bench's token is last."""
    entries = [
        f'[[principal]]\nname = "p{i}"\ntoken_sha256 = "{_sha256(f"other-{i}-token")}"\n'
        f'read = ["t{i}"]\nwrite = ["t{i}"]\n'
        for i in range(principals - 1)
    ]
    entries.append(
        f'[[principal]]\nname = "bench"\ntoken_sha256 = "{_sha256(_TOKEN)}"\n'
        'read = ["bench"]\nwrite = ["bench"]\n'
    )
    path.write_text("\n".join(entries))
    path.chmod(0o600)
    return path


def _check_enforced(address: str, scope: Scope, keys: Sequence[bytes]) -> None:
    """The tokens daemon really refuses a call without a token (else the rows compare nothing)."""
    with StoreClient(address, shared_memory=False, token="", retries=0) as anonymous:
        try:
            anonymous.lookup(scope, keys)
        except Unauthenticated:
            return
    raise RuntimeError("the daemon with a tokens file served a call without a token")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(pages: int, rounds: int, principals: int) -> dict[str, float]:
    scope = Scope("bench/auth", "w", "t", "float16", _LAYOUT, namespace="bench")
    tokens = list(range(pages * _LAYOUT.page_tokens))
    payload = bytes(scope.page_payload_bytes)
    chain = build_pages(scope, tokens, [payload] * pages)
    keys = [p.header.key for p in chain]
    ids = page_tokens(scope, tokens)
    with tempfile.TemporaryDirectory(prefix="strata-bench-auth-") as tmp:
        root = Path(tmp)
        tokens_file = _tokens_file(root / "tokens.toml", principals)
        daemons = {
            "open": _daemon(root / "open", None),
            "tokens": _daemon(root / "auth", tokens_file),
        }
        clients: dict[str, StoreClient] = {}
        try:
            with ThreadPoolExecutor(len(daemons)) as pool:  # both start at once
                list(pool.map(DaemonProcess.start, daemons.values()))
            for name, daemon in daemons.items():
                token = _TOKEN if name == "tokens" else ""
                clients[name] = StoreClient(daemon.address, shared_memory=False, token=token)
                clients[name].put(scope, chain)
            _check_enforced(daemons["tokens"].address, scope, keys)
            into = [bytearray(scope.page_payload_bytes) for _ in keys]
            times: dict[str, list[float]] = {
                f"{kind}_{name}": [] for kind in ("lookup", "get") for name in clients
            }
            for _ in range(10):  # warm both channels and caches
                for client in clients.values():
                    client.lookup(scope, keys)
                    client.get(scope, keys, into, tokens=ids)
            for i in range(rounds):
                order = list(clients) if i % 2 == 0 else list(reversed(clients))
                for name in order:
                    client = clients[name]
                    times[f"lookup_{name}"].append(_timed(partial(client.lookup, scope, keys)))
                    times[f"get_{name}"].append(
                        _timed(partial(client.get, scope, keys, into, tokens=ids))
                    )
            paired = {
                kind: statistics.median(
                    t / o
                    for t, o in zip(times[f"{kind}_tokens"], times[f"{kind}_open"], strict=True)
                )
                for kind in ("lookup", "get")
            }
            hits = {name: c.lookup(scope, keys).hit_count for name, c in clients.items()}
            if set(hits.values()) != {pages}:
                raise RuntimeError(f"lookups did not hit every page: {hits}")
        finally:
            for client in clients.values():
                client.close()
            for daemon in daemons.values():
                daemon.stop()
    out: dict[str, float] = {"pages": pages, "rounds": rounds, "principals": principals}
    for kind in ("lookup", "get"):
        for stat, pick in (("", statistics.median), ("_p10", _p10)):
            open_s = pick(times[f"{kind}_open"])
            auth_s = pick(times[f"{kind}_tokens"])
            out[f"{kind}_open{stat}_us"] = open_s * 1e6
            out[f"{kind}_tokens{stat}_us"] = auth_s * 1e6
            out[f"{kind}_tokens_over_open{stat}_ratio"] = auth_s / open_s
        out[f"{kind}_paired_ratio"] = paired[kind]
    return out


def _p10(values: Sequence[float]) -> float:
    """The 10th percentile: the calls least disturbed by whatever else the machine runs."""
    return statistics.quantiles(values, n=10, method="inclusive")[0]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench auth", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=8, help="pages per lookup and get (default 8)")
    p.add_argument("--rounds", type=int, default=400, help="timed calls of each kind per daemon")
    p.add_argument("--principals", type=int, default=16, help="principals in the tokens file")
    p.add_argument("--json", help="write the results here")
    ns = p.parse_args(argv)
    if ns.pages < 1 or ns.rounds < 1 or ns.principals < 1:
        print("strata bench auth: --pages, --rounds and --principals must be >= 1", file=sys.stderr)
        return 2
    r = run(ns.pages, ns.rounds, ns.principals)
    page_kib = Scope("b", "w", "t", "float16", _LAYOUT).page_payload_bytes // 1024
    print(
        f"store calls over gRPC, {ns.pages} pages of {page_kib} KiB, {ns.rounds} of each, "
        f"{ns.principals} principals"
    )
    for kind in ("lookup", "get"):
        for stat, label in (("", "median"), ("_p10", "p10")):
            print(
                f"  {kind:6} {label:6}  open {r[f'{kind}_open{stat}_us']:8.1f} µs   tokens "
                f"{r[f'{kind}_tokens{stat}_us']:8.1f} µs   "
                f"ratio {r[f'{kind}_tokens_over_open{stat}_ratio']:.3f}x"
            )
        print(f"  {kind:6} paired  median of the rounds' ratios {r[f'{kind}_paired_ratio']:.3f}x")
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0
