"""One chaos client process: a mixed put/get/lookup load at a fixed rate through the SDK.

Run as `python -m loadtests.chaos.worker --address HOST:PORT --namespace NS --result PATH ...`
(or `--etcd URL` for a `ClusterClient`). Every `1/rate` seconds it starts one call: a put of a
new prompt (`--pages` chained pages), a get of a prompt it was acknowledged for (mostly recent
ones), or a lookup of one; a call that overruns its slot delays the next, never bursts. Every
page a put acknowledged (STORED or ALREADY_PRESENT) is recorded with its payload digest; every
page a get serves is checked against its key-derived payload, and one with other bytes is
recorded as served wrong. Each call's start, end and outcome are recorded for availability.

It stops on SIGTERM (after the call in flight) or at `--duration`, and writes the record as JSON
to `--result`. It prints `ready` once connected, so its parent knows the load has started.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from client import ClusterClient, PutStatus, StoreClient, StrataError
from loadtests.chaos.pages import LAYOUTS, chaos_scope, digest, expected, is_intact, prompt

Client = StoreClient | ClusterClient


def _client(ns: argparse.Namespace) -> Client:
    if ns.etcd:
        return ClusterClient(
            etcd_endpoints=ns.etcd, cluster=ns.cluster, replicas=2, timeout_s=ns.timeout,
            down_s=1.0, shared_memory=False,
        )
    shm = {"shm": True, "tcp": False, "grpc": False}[ns.transport]
    tcp = {"shm": None, "tcp": True, "grpc": False}[ns.transport]
    client = StoreClient(ns.address, shared_memory=shm, tcp=tcp, ucx=False,
                         timeout_s=ns.timeout, retries=1)
    return client


class Record:
    """What this worker saw: acknowledged pages, wrong pages, and every call's outcome."""

    def __init__(self, worker_id: int, page_kib: int) -> None:
        self.worker_id = worker_id
        self.page_kib = page_kib
        self.acked: dict[str, int] = {}  # key hex -> payload digest
        self.wrong: dict[str, float] = {}  # key hex -> when first served wrong
        self.calls: list[tuple[float, float, bool, str]] = []  # start, end, ok, op
        self.errors: dict[str, int] = {}
        self.gets_pages = 0
        self.gets_hits = 0

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Record:
        """A record as `to_json` wrote it (read back by the phase that ran the worker)."""
        record = cls(int(doc["worker_id"]), int(doc["page_kib"]))
        record.acked = {str(k): int(v) for k, v in doc["acked"].items()}
        record.wrong = {str(k): float(v) for k, v in doc["wrong"].items()}
        record.calls = [(float(a), float(b), bool(ok), str(op)) for a, b, ok, op in doc["calls"]]
        record.errors = {str(k): int(v) for k, v in doc["errors"].items()}
        record.gets_pages, record.gets_hits = int(doc["gets_pages"]), int(doc["gets_hits"])
        return record

    def to_json(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "page_kib": self.page_kib,
            "acked": self.acked,
            "wrong": self.wrong,
            "calls": self.calls,
            "errors": self.errors,
            "gets_pages": self.gets_pages,
            "gets_hits": self.gets_hits,
        }


def run(ns: argparse.Namespace, stop: threading.Event) -> Record:
    """Two threads on one client: puts at `rate * put_share`, gets and lookups (2:1) at the rest
    of the rate, so a put that waits does not hold back the reads (each is timed on its own)."""
    scope = chaos_scope(ns.namespace, ns.page_kib)
    size = scope.page_payload_bytes
    record = Record(ns.worker_id, ns.page_kib)
    prompts: list[tuple[bytes, ...]] = []  # keys of acknowledged prompts, oldest first
    client = _client(ns)
    deadline = time.monotonic() + ns.duration
    ready = threading.Event()

    def paced(rate: float, call: Callable[[random.Random], str | None], seed: int) -> None:
        rng = random.Random(seed)
        period = 1.0 / rate
        slot = time.monotonic()
        while not stop.is_set() and time.monotonic() < deadline:
            slot = max(slot + period, time.monotonic() - period)  # late: no burst after
            wait = slot - time.monotonic()
            if wait > 0 and stop.wait(wait):
                break
            start = time.monotonic()
            try:
                op = call(rng)
                ok = True
            except StrataError as exc:
                op, ok = getattr(exc, "chaos_op", "?"), False
                record.error(exc)
            if op is None:
                continue
            record.calls.append((start, time.monotonic(), ok, op))
            if ok and not ready.is_set():
                ready.set()
                print("ready", flush=True)

    next_id = [ns.worker_id * 1_000_000_000]

    def put(rng: random.Random) -> str:
        p = prompt(scope, next_id[0], ns.pages)
        next_id[0] += 1
        try:
            result = client.put(scope, p.build(scope))
        except StrataError as exc:
            exc.chaos_op = "put"  # type: ignore[attr-defined]
            raise
        stored = False
        for key, status in zip(p.keys, result.statuses, strict=True):
            if status in (PutStatus.STORED, PutStatus.ALREADY_PRESENT):
                record.acked[key.hex()] = digest(expected(key, size))
                stored = True
        if stored:
            prompts.append(p.keys)
        return "put"

    into = [bytearray(size) for _ in range(ns.pages)]

    def read(rng: random.Random) -> str | None:
        if not prompts:
            return None
        keys = rng.choice(prompts[-20:] if rng.random() < 0.7 else prompts)
        op = "get" if rng.random() < 2 / 3 else "lookup"
        try:
            if op == "get":
                got = client.get(scope, keys, into, tokens=None)  # checked by key: `_check`
                _check(record, keys, got.entries, into)
            else:
                client.lookup(scope, keys)
        except StrataError as exc:
            exc.chaos_op = op  # type: ignore[attr-defined]
            raise
        return op

    reader = threading.Thread(
        target=paced, args=(ns.rate * (1 - ns.put_share), read, ns.seed + 1), daemon=True
    )
    reader.start()
    try:
        paced(ns.rate * ns.put_share, put, ns.seed)
    finally:
        stop.set()
        reader.join(ns.timeout * 4 + 5)
        client.close()
    return record


def _check(
    record: Record, keys: Sequence[bytes], entries: Sequence[object], into: Sequence[bytearray]
) -> None:
    for key, entry, buf in zip(keys, entries, into[: len(keys)], strict=True):
        record.gets_pages += 1
        if entry is None:
            continue
        record.gets_hits += 1
        if not is_intact(key, buf):
            record.wrong.setdefault(key.hex(), time.monotonic())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.chaos.worker", description=__doc__)
    p.add_argument("--address", default="")
    p.add_argument("--etcd", default="", help="etcd URL: use a ClusterClient instead")
    p.add_argument("--cluster", default="chaos")
    p.add_argument("--transport", choices=("shm", "tcp", "grpc"), default="shm")
    p.add_argument("--namespace", required=True)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=40.0, help="calls per second")
    p.add_argument("--pages", type=int, default=8, help="pages per prompt")
    p.add_argument("--page-kib", type=int, choices=sorted(LAYOUTS), default=32)
    p.add_argument("--put-share", type=float, default=0.4)
    p.add_argument("--duration", type=float, default=60.0, help="upper bound, seconds")
    p.add_argument("--timeout", type=float, default=2.0, help="deadline of each call")
    p.add_argument("--result", required=True)
    ns = p.parse_args(argv)
    if bool(ns.address) == bool(ns.etcd):
        p.error("give exactly one of --address or --etcd")
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    record = run(ns, stop)
    with open(ns.result, "w") as fh:
        json.dump(record.to_json(), fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
