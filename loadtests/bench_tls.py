"""`strata bench tls`: what TLS costs a remote caller of the store, plaintext vs TLS side by side.

Starts two daemons (`strata serve` child processes on loopback): one plaintext, one with a
throwaway certificate (made here with the `openssl` command). The same pages are stored in
each, then a remote `StoreClient` (shared memory off) times, on each daemon and each remote
path (the TCP data path, and gRPC streams with the TCP data path off), a get of a batch as an
engine pays for it (verified), and a put of fresh pages; rounds alternate between the daemons
so that whatever else the machine does falls on both alike. It also times a client's first
call on each (`node_info`: the gRPC connection with its TLS handshake, then NodeInfo). Prints medians, GB/s and the TLS / plaintext
ratios.

    strata bench tls [--shape 64KiB|1MiB] [--pages 32] [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from client import KVLayout, Page, Scope, StoreClient, build_pages, page_tokens
from client.transports.tls import TlsOptions
from loadtests.daemon import DaemonProcess

# head_dim 64, 2 KV heads, 16 tokens, fp16: 8 KiB per layer; 8 layers = 64 KiB, 128 = 1 MiB
_SHAPES = {"64KiB": 8, "1MiB": 128}
_PATHS = ("tcp", "grpc")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for 127.0.0.1, valid for a day."""
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr, ext = (folder / n for n in ("server.pem", "server.key", "s.csr", "s.ext"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out",
             str(ca), "-days", "1", "-subj", "/CN=strata-bench-ca")  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", "/CN=strata-bench")  # fmt: skip
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "1", "-out", str(cert), "-extfile", str(ext))  # fmt: skip
    return ca, cert, key


def _daemon(data: Path, tls: tuple[Path, Path] | None) -> DaemonProcess:
    sets = ["server.unix_socket=off", "server.ucx=false", "server.tcp=true"]
    if tls is not None:
        sets += [f"tls.cert={tls[0]}", f"tls.key={tls[1]}", "tls.require=true"]
    extra = [arg for item in sets for arg in ("--set", item)]
    return DaemonProcess(data, dram="1GiB", ssd="0", extra=extra)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pages(scope: Scope, count: int, seed: int) -> tuple[list[Page], list[list[int]]]:
    page = scope.layout.page_tokens
    tokens = [(seed * 7919 + t) % 50_000 for t in range(count * page)]
    tokens[0] = seed  # distinct prompts: distinct keys
    payloads = [bytes([seed % 251]) * scope.page_payload_bytes] * count
    return build_pages(scope, tokens, payloads), [list(t) for t in page_tokens(scope, tokens)]


def run(shape: str, pages: int, rounds: int) -> dict[str, float]:
    layout = KVLayout(num_layers=_SHAPES[shape], num_kv_heads=2, head_dim=64, page_tokens=16)
    scope = Scope("bench/tls", "w", "t", "float16", layout)
    batch, ids = _pages(scope, pages, seed=1)
    keys = [p.header.key for p in batch]
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-tls-") as tmp:
        root = Path(tmp)
        ca, cert, key = _certificates(root)
        daemons = {
            "plain": _daemon(root / "plain", None),
            "tls": _daemon(root / "tls", (cert, key)),
        }
        options: dict[str, TlsOptions | bool] = {"plain": False, "tls": TlsOptions(ca_file=str(ca))}
        clients: dict[tuple[str, str], StoreClient] = {}
        try:
            for name, daemon in daemons.items():
                daemon.start()
                for path in _PATHS:
                    first = StoreClient(
                        daemon.address, shared_memory=False, tcp=path == "tcp", tls=options[name]
                    )
                    times.setdefault(f"connect_{name}", []).append(_timed(first.node_info))
                    clients[(name, path)] = first
                    if first.transport != path:
                        raise RuntimeError(f"{name}/{path}: the client took {first.transport}")
                clients[(name, "tcp")].put(scope, batch)
            for _ in range(3):  # warm every channel and connection
                for client in clients.values():
                    client.get(scope, keys, into, tokens=ids, verify=True)
            for i in range(rounds):
                order = list(clients) if i % 2 == 0 else list(reversed(clients))
                for name, path in order:
                    client = clients[(name, path)]
                    get = partial(client.get, scope, keys, into, tokens=ids, verify=True)
                    times.setdefault(f"get_{path}_{name}", []).append(_timed(get))
                    fresh, _ = _pages(
                        scope, pages, seed=2 + i * 4 + _PATHS.index(path) * 2 + (name == "tls")
                    )
                    times.setdefault(f"put_{path}_{name}", []).append(
                        _timed(partial(client.put, scope, fresh))
                    )
                    client.delete(keys=[p.header.key for p in fresh])
            for client in clients.values():
                if client.get(scope, keys, into, tokens=ids).hit_count != pages:
                    raise RuntimeError("a get did not hit every page")
        finally:
            for client in clients.values():
                client.close()
            for daemon in daemons.values():
                daemon.stop()
    batch_bytes = pages * scope.page_payload_bytes
    out: dict[str, float] = {
        "pages": pages,
        "page_bytes": scope.page_payload_bytes,
        "rounds": rounds,
    }
    for kind in [f"{op}_{path}" for path in _PATHS for op in ("get", "put")] + ["connect"]:
        plain = statistics.median(times[f"{kind}_plain"])
        tls = statistics.median(times[f"{kind}_tls"])
        out[f"{kind}_plain_ms"] = plain * 1e3
        out[f"{kind}_tls_ms"] = tls * 1e3
        out[f"{kind}_tls_over_plain_ratio"] = tls / plain
        if kind != "connect":
            out[f"{kind}_plain_gbps"] = batch_bytes / plain / 1e9
            out[f"{kind}_tls_gbps"] = batch_bytes / tls / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench tls", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(_SHAPES), default="64KiB", help="page size")
    p.add_argument("--pages", type=int, default=32, help="pages per get and put (default 32)")
    p.add_argument("--rounds", type=int, default=40, help="timed calls of each kind")
    p.add_argument("--json", help="write the results here")
    ns = p.parse_args(argv)
    if ns.pages < 1 or ns.rounds < 1:
        print("strata bench tls: --pages and --rounds must be >= 1", file=sys.stderr)
        return 2
    r = run(ns.shape, ns.pages, ns.rounds)
    print(f"remote store calls, {ns.pages} pages of {ns.shape}, median of {ns.rounds} (loopback)")
    print(f"  {'call':12} {'plaintext':>20} {'TLS':>20} {'TLS/plain':>10}")
    for path in _PATHS:
        for op in ("get", "put"):
            kind = f"{op}_{path}"
            print(
                f"  {op + ' ' + path:12} {r[f'{kind}_plain_ms']:8.2f} ms {r[f'{kind}_plain_gbps']:5.2f} GB/s"
                f" {r[f'{kind}_tls_ms']:8.2f} ms {r[f'{kind}_tls_gbps']:5.2f} GB/s"
                f" {r[f'{kind}_tls_over_plain_ratio']:9.2f}x"
            )
    print(
        f"  {'first call':12} {r['connect_plain_ms']:8.2f} ms {'':9} {r['connect_tls_ms']:8.2f} ms"
        f" {'':9} {r['connect_tls_over_plain_ratio']:9.2f}x"
    )
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0
