"""`strata bench isolation`: does one kind of traffic keep its latency while another floods?

Two measurements, each side by side with an idle run in the same process and printed as ratios:

(a) Critical gets under a background flood. One daemon (child process on loopback) with a
    background cap (`io.background_bytes_per_s`, `--cap`). A critical-class client per data path
    (same-host shm, TCP, UCX where ucxx works, gRPC) times gets of a few DRAM pages: idle, then
    while flood processes (one per path, io class background) put and get big batches as fast as
    they can with DRAM small enough that the mover demotes to SSD all along. Then whether the cap
    held: background bytes per second on every path as the daemon counts them
    (`strata_bytes_total{io_class="background"}` from its metrics endpoint, demotions to SSD
    included), as the flood clients counted them, and their sum against the cap (plus the one
    second of burst the token bucket starts with).
(b) DRAM gets and lookups with a slow disk. A daemon whose every SSD payload write takes
    `--disk-delay-ms` (the SSD fault hook `ssd.fault_write_delay_ms`), idle, then under a put
    load that fills DRAM and so forces demotion through that disk; a daemon with the same
    settings and a normal disk under the same load is the control.

`--json PATH` writes every number. Rounds are short and noisy on a shared machine, which is why
each ratio is taken within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType

from client import CapacityExhausted, IoClass, StoreClient, StrataError, build_pages
from loadtests.bench_store import scope_for
from loadtests.daemon import DaemonProcess

PATHS = ("shm", "tcp", "ucx", "grpc")
_BYTES_RE = re.compile(r"^strata_bytes_total\{([^}]*)\} (\S+)$", re.M)
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class Latency:
    name: str
    idle_p50_ms: float
    idle_p99_ms: float
    loaded_p50_ms: float
    loaded_p99_ms: float
    p50_ratio: float
    p99_ratio: float
    calls: int


@dataclass(frozen=True, slots=True)
class CapCheck:
    cap_bytes_per_s: int
    seconds: float
    daemon_bytes_per_s: dict[str, float]  # by path, background class, both directions
    client_bytes_per_s: dict[str, float]  # what each path's flood clients moved
    total_bytes_per_s: float  # the daemon's count over every path
    client_total_bytes_per_s: float  # the flood clients' count over every path
    allowed_bytes_per_s: float  # cap plus the bucket's starting burst spread over the window
    held: bool


@dataclass
class Report:
    critical: list[Latency] = field(default_factory=list)
    cap: CapCheck | None = None
    slow_disk: list[Latency] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def size_arg(text: str) -> int:
    """`64MiB` -> 67108864 (what `strata serve` takes, for the command line)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text, re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 64MiB)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]


def _client(address: str, path: str, io_class: IoClass, timeout_s: float = 30.0) -> StoreClient:
    return StoreClient(
        address, shared_memory=path == "shm", tcp=path == "tcp", ucx=path == "ucx",
        io_class=io_class, timeout_s=timeout_s,
    )


def percentiles(secs: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(secs)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def latency(name: str, idle: Sequence[float], loaded: Sequence[float]) -> Latency:
    i50, i99 = percentiles(idle)
    l50, l99 = percentiles(loaded)
    return Latency(name, round(i50, 3), round(i99, 3), round(l50, 3), round(l99, 3),
                   round(l50 / i50, 2), round(l99 / i99, 2), len(loaded))


def time_for(fn: Callable[[], None], seconds: float, max_calls: int) -> list[float]:
    """Call `fn` back to back for `seconds` (at most `max_calls` times); each call's duration."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and len(out) < max_calls:
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def background_bytes(metrics_url: str) -> dict[str, float]:
    """Background-class payload bytes moved so far, by path, from the daemon's metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for labels, value in _BYTES_RE.findall(text):
        tags = dict(_LABEL_RE.findall(labels))
        if tags.get("io_class") == "background":
            path = tags.get("path", "?")
            out[path] = out.get(path, 0.0) + float(value)
    return out


# ---- the load processes ---------------------------------------------------------------------


class LoadProcess:
    """`python -m loadtests.bench_isolation load ...` as a child. It prints `ready` after its
    first call; SIGUSR1 pauses it and SIGUSR2 resumes it (it answers `paused BYTES` once the
    call in flight is done, and `running`), SIGTERM ends it with a JSON line of totals."""

    def __init__(self, address: str, path: str, io_class: str, page_kib: int, batch: int,
                 seed: int, reads: bool) -> None:
        args = [sys.executable, "-m", "loadtests.bench_isolation", "load", "--address", address,
                "--path", path, "--io-class", io_class, "--page-kib", str(page_kib),
                "--batch", str(batch), "--seed", str(seed)]
        self.proc = subprocess.Popen(
            [*args, *(["--reads"] if reads else [])], stdout=subprocess.PIPE, text=True
        )
        self.ready = threading.Event()
        self._state = threading.Condition()
        self._paused: int | None = None  # bytes moved when it last said "paused"
        self.result: dict[str, float] = {}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word = line.split()
            if word == ["ready"]:
                self.ready.set()
            elif word[:1] == ["paused"]:
                with self._state:
                    self._paused = int(word[1])
                    self._state.notify_all()
            elif word == ["running"]:
                with self._state:
                    self._paused = None
                    self._state.notify_all()
            elif line.startswith("{"):
                self.result = json.loads(line)

    def pause(self, timeout_s: float = 60.0) -> int:
        """Pause it and wait until it is idle; the bytes it has moved so far."""
        self._signal_until(signal.SIGUSR1, lambda: self._paused is not None, timeout_s, "pause")
        assert self._paused is not None
        return self._paused

    def resume(self, timeout_s: float = 60.0) -> None:
        self._signal_until(signal.SIGUSR2, lambda: self._paused is None, timeout_s, "resume")

    def _signal_until(
        self, sig: int, done: Callable[[], bool], timeout_s: float, what: str
    ) -> None:
        """Send `sig` until `done()` (pausing and resuming are idempotent, so a repeat is
        harmless); a clear error when the process has died or does not answer in time."""
        deadline = time.monotonic() + timeout_s
        with self._state:
            while not done():
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(f"a load process exited with {code} before it would {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"a load process did not {what}")
                os.kill(self.proc.pid, sig)
                self._state.wait_for(done, min(left, 2.0))

    def stop(self) -> dict[str, float]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        deadline = time.monotonic() + 5
        while not self.result and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        return self.result


def run_load(ns: argparse.Namespace) -> int:
    """The body of a load process: put fresh batches (and read each back with --reads)."""
    stop = threading.Event()
    running = threading.Event()
    running.set()
    wake = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()
        wake.set()

    def on_pause(signum: int, frame: FrameType | None) -> None:
        running.clear()

    def on_resume(signum: int, frame: FrameType | None) -> None:
        running.set()
        wake.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_pause)
    signal.signal(signal.SIGUSR2, on_resume)
    scope = scope_for(ns.page_kib << 10, f"load-{ns.seed}")
    size = scope.page_payload_bytes
    payloads = [bytes([ns.seed % 251 + 1]) * size] * ns.batch
    into = [bytearray(size) for _ in range(ns.batch)]
    io = IoClass[ns.io_class.upper()]
    moved = refused = 0
    start = time.monotonic()
    with _client(ns.address, ns.path, io) as client:
        i = 0
        while not stop.is_set():
            if not running.is_set():
                print(f"paused {moved}", flush=True)
                while not running.is_set() and not stop.is_set():
                    wake.wait(0.5)
                    wake.clear()
                print("running", flush=True)
                continue
            tokens = [(ns.seed << 40) + i * 1_000_003 + t for t in range(ns.batch * 16)]
            pages = build_pages(scope, [t % 4_000_000_000 for t in tokens], payloads)
            try:
                client.put(scope, pages)
                moved += size * ns.batch
                if ns.reads:
                    got = client.get(scope, [p.header.key for p in pages], into, tokens=[p.header.tokens for p in pages])
                    moved += size * got.hit_count
            except CapacityExhausted as exc:
                refused += 1
                stop.wait(min(exc.retry_after_s or 0.05, 0.2))
            except StrataError:
                refused += 1
            if i == 0:
                print("ready", flush=True)
            i += 1
    elapsed = time.monotonic() - start
    print(json.dumps({"bytes": moved, "seconds": elapsed, "refused": refused}), flush=True)
    return 0


class Rounds:
    """Idle and loaded rounds, interleaved: `loads` paused for the idle ones. Collects each
    round's timings per name, the loads' bytes during loaded rounds and their total time."""

    def __init__(self, loads: Sequence[LoadProcess]) -> None:
        self.loads = list(loads)
        self.idle: dict[str, list[float]] = {}
        self.loaded: dict[str, list[float]] = {}
        self.load_bytes = [0] * len(self.loads)
        self.loaded_s = 0.0

    def run(self, rounds: int, measure: Callable[[], dict[str, list[float]]],
            on_loaded: Callable[[float], None] | None = None) -> None:
        for lp in self.loads:
            if not lp.ready.wait(120):
                raise RuntimeError("a load process did not start")
        for _ in range(rounds):
            for lp in self.loads:
                lp.pause()
            for name, secs in measure().items():
                self.idle.setdefault(name, []).extend(secs)
            before = [lp.pause() for lp in self.loads]
            for lp in self.loads:
                lp.resume()
            t0 = time.monotonic()
            for name, secs in measure().items():
                self.loaded.setdefault(name, []).extend(secs)
            elapsed = time.monotonic() - t0
            self.loaded_s += elapsed
            if on_loaded is not None:
                on_loaded(elapsed)
            after = [lp.pause() for lp in self.loads]  # the round's bytes, then idle again
            for i, (a, b) in enumerate(zip(after, before, strict=True)):
                self.load_bytes[i] += a - b


# ---- (a) critical gets under a background flood ---------------------------------------------


def bench_critical(ns: argparse.Namespace, folder: Path, report: Report) -> None:
    extra = ["--set", f"io.background_bytes_per_s={ns.cap}", "--set", "server.ucx=true",
             "--set", "server.allow_open=true"]  # an open daemon's UCX listens on every NIC
    with DaemonProcess(folder / "flood", dram=ns.dram, ssd=ns.ssd, extra=extra) as daemon:
        scope = scope_for(64 << 10, "critical")
        size = scope.page_payload_bytes
        hot = build_pages(scope, list(range(ns.get_pages * 16)), [bytes([7]) * size] * ns.get_pages)
        keys = [p.header.key for p in hot]
        clients: dict[str, StoreClient] = {}
        for path in PATHS:
            c = _client(daemon.address, path, IoClass.CRITICAL)
            try:
                c.connect()
                if c.transport != path:
                    raise StrataError(f"got {c.transport}")
                clients[path] = c
            except StrataError as exc:
                c.close()
                report.notes.append(f"no {path} path here ({exc}); its rows are left out")
        flood: list[LoadProcess] = []
        try:
            next(iter(clients.values())).put(scope, hot)
            into = [bytearray(size) for _ in keys]

            def getter(c: StoreClient) -> Callable[[], None]:
                def get() -> None:
                    if c.get(scope, keys, into, tokens=[p.header.tokens for p in hot]).hit_count != len(keys):
                        raise RuntimeError("a critical get missed its DRAM pages")
                return get

            def measure() -> dict[str, list[float]]:
                per = ns.seconds / ns.rounds
                return {p: time_for(getter(c), per, ns.max_calls) for p, c in clients.items()}

            flood = [
                LoadProcess(daemon.address, p, "background", ns.flood_page_kib, ns.flood_batch,
                            seed=10 + i, reads=True)
                for i, p in enumerate(clients)
            ]
            rounds = Rounds(flood)
            daemon_bytes: dict[str, float] = {}

            def count(_: float) -> None:
                for k, v in background_bytes(daemon.metrics_url).items():
                    daemon_bytes[k] = daemon_bytes.get(k, 0.0) + v - start_bytes.get(k, 0.0)

            start_bytes: dict[str, float] = {}

            def measure_counted() -> dict[str, list[float]]:
                start_bytes.clear()
                start_bytes.update(background_bytes(daemon.metrics_url))
                return measure()

            rounds.run(ns.rounds, measure_counted, on_loaded=count)
        finally:
            for f in flood:
                f.stop()
            for c in clients.values():
                c.close()
        for p in clients:
            report.critical.append(latency(f"critical get {ns.get_pages} x 64KiB, {p}",
                                           rounds.idle[p], rounds.loaded[p]))
        window = rounds.loaded_s
        # the idle rounds' counts (nothing but the critical gets) leak into the next loaded
        # round's start value at most by what the bucket let through while paused: none
        per_path = {k: round(v / window) for k, v in sorted(daemon_bytes.items())}
        total = float(sum(per_path.values()))
        by_clients = {p: float(round(b / window))
                      for p, b in zip(clients, rounds.load_bytes, strict=True)}
        # the token bucket refills (one second of the cap) during every idle round
        allowed = ns.cap * (window + ns.rounds) / window
        report.cap = CapCheck(
            cap_bytes_per_s=ns.cap, seconds=round(window, 2),
            daemon_bytes_per_s={k: float(v) for k, v in per_path.items()},
            client_bytes_per_s=by_clients, total_bytes_per_s=total,
            client_total_bytes_per_s=sum(by_clients.values()),
            allowed_bytes_per_s=round(allowed),
            held=max(total, sum(by_clients.values())) <= allowed * 1.05,
        )


# ---- (b) DRAM gets and lookups with a slow disk ---------------------------------------------


def _dram_ops(daemon: DaemonProcess, ns: argparse.Namespace, label: str) -> tuple[
    dict[str, list[float]], dict[str, list[float]], dict[str, float]
]:
    scope = scope_for(64 << 10, "hot")
    size = scope.page_payload_bytes
    chain = build_pages(scope, list(range(32 * 16)), [bytes([9]) * size] * 32)
    keys = [p.header.key for p in chain]
    into = [bytearray(size) for _ in range(4)]
    with _client(daemon.address, "shm", IoClass.NORMAL) as c:
        c.put(scope, chain)

        def get() -> None:
            c.get(scope, keys[:4], into, tokens=[p.header.tokens for p in chain[:4]])

        def lookup() -> None:
            c.lookup(scope, keys)

        def both() -> dict[str, list[float]]:
            half = ns.seconds / ns.rounds / 2
            return {"get": time_for(get, half, ns.max_calls),
                    "lookup": time_for(lookup, half, ns.max_calls)}

        load = LoadProcess(daemon.address, "shm", "normal", ns.flood_page_kib, ns.flood_batch,
                           seed=99, reads=False)
        try:
            rounds = Rounds([load])
            rounds.run(ns.rounds, both)
        finally:
            moved = load.stop()
        hits = c.get(scope, keys[:4], into, tokens=[p.header.tokens for p in chain[:4]]).hit_count
        stats = c.stats()
    rate = rounds.load_bytes[0] / rounds.loaded_s if rounds.loaded_s else 0.0
    return rounds.idle, rounds.loaded, {
        "bytes_per_s": rate, "refused": moved.get("refused", 0), "demotions": stats.demotions,
        "hot_hits_after": hits,
    }


def bench_slow_disk(ns: argparse.Namespace, folder: Path, report: Report) -> None:
    runs = [("slow disk", ["--set", f"ssd.fault_write_delay_ms={ns.disk_delay_ms}"]),
            ("normal disk", [])]
    for label, extra in runs:
        try:
            daemon = DaemonProcess(folder / label.replace(" ", "-"), dram=ns.slow_dram,
                                   ssd=ns.ssd, extra=extra).start()
        except RuntimeError as exc:
            if "unknown config key" in str(exc):
                report.notes.append("this daemon has no slow-disk hook (ssd.fault_write_delay_ms):"
                                    " measurement (b) skipped")
                return
            raise
        try:
            idle, loaded, load = _dram_ops(daemon, ns, label)
        finally:
            daemon.stop()
        for op in ("get", "lookup"):
            name = "DRAM get 4 x 64KiB" if op == "get" else "lookup 32 keys"
            report.slow_disk.append(latency(f"{name}, {label}", idle[op], loaded[op]))
        report.notes.append(
            f"{label}: put load moved {load['bytes_per_s'] / 1e6:.0f} MB/s while on, "
            f"{int(load.get('refused', 0))} puts refused, {int(load['demotions'])} demotions, "
            f"hot pages still hit after: {int(load['hot_hits_after'])}/4"
        )


def print_report(report: Report) -> None:
    head = (f"{'operation':<44} {'idle p50':>9} {'p99':>8} {'loaded p50':>11} {'p99':>8} "
            f"{'x p50':>6} {'x p99':>6}")
    sections = (("(a) critical gets, idle vs background flood on every path", report.critical),
                ("(b) DRAM ops, idle vs put load forcing demotion", report.slow_disk))
    for title, rows in sections:
        print(title)
        print(head)
        for r in rows:
            print(f"{r.name:<44} {r.idle_p50_ms:>9.3f} {r.idle_p99_ms:>8.3f} "
                  f"{r.loaded_p50_ms:>11.3f} {r.loaded_p99_ms:>8.3f} {r.p50_ratio:>6.2f} "
                  f"{r.p99_ratio:>6.2f}")
        print()
    if report.cap is not None:
        cap = report.cap
        print(f"background cap {cap.cap_bytes_per_s / 1e6:.0f} MB/s over {cap.seconds} s: "
              f"daemon counted {cap.total_bytes_per_s / 1e6:.1f} MB/s, "
              f"flood clients moved {cap.client_total_bytes_per_s / 1e6:.1f} MB/s "
              f"(allowed with the starting burst {cap.allowed_bytes_per_s / 1e6:.1f}) -> "
              f"{'held' if cap.held else 'NOT held'}")
        for path, v in cap.daemon_bytes_per_s.items():
            print(f"  daemon, path {path:<5} {v / 1e6:8.1f} MB/s")
        for path, v in cap.client_bytes_per_s.items():
            print(f"  flood clients, {path:<5} {v / 1e6:8.1f} MB/s")
    for note in report.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["load"]:
        lp = argparse.ArgumentParser(prog="bench_isolation load")
        lp.add_argument("--address", required=True)
        lp.add_argument("--path", choices=PATHS, required=True)
        lp.add_argument("--io-class", default="background")
        lp.add_argument("--page-kib", type=int, default=256)
        lp.add_argument("--batch", type=int, default=16)
        lp.add_argument("--seed", type=int, default=0)
        lp.add_argument("--reads", action="store_true")
        return run_load(lp.parse_args(args[1:]))
    p = argparse.ArgumentParser(prog="strata bench isolation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=6.0,
                   help="timing per path, idle and loaded each, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="idle/loaded rounds, interleaved")
    p.add_argument("--max-calls", type=int, default=5000)
    p.add_argument("--cap", type=size_arg, default=64 << 20,
                   help="background cap in bytes/s, e.g. 64MiB (the default)")
    p.add_argument("--get-pages", type=int, default=4)
    p.add_argument("--flood-page-kib", type=int, default=256)
    p.add_argument("--flood-batch", type=int, default=16)
    p.add_argument("--dram", default="128MiB", help="DRAM of the flood daemon")
    p.add_argument("--slow-dram", default="64MiB", help="DRAM of the slow-disk daemons")
    p.add_argument("--ssd", default="2GiB")
    p.add_argument("--disk-delay-ms", type=int, default=200)
    p.add_argument("--only", choices=("critical", "slow-disk"), help="run one measurement")
    p.add_argument("--dir", type=Path)
    p.add_argument("--json", type=Path)
    ns = p.parse_args(args)
    folder = ns.dir or Path(tempfile.mkdtemp(prefix="strata-isolation-"))
    report = Report()
    print(f"strata bench isolation: daemons in their own processes, state in {folder}", flush=True)
    if ns.only in (None, "critical"):
        print("  (a) critical gets under a background flood ...", flush=True)
        bench_critical(ns, folder, report)
    if ns.only in (None, "slow-disk"):
        print(f"  (b) DRAM ops with every SSD write taking {ns.disk_delay_ms} ms ...", flush=True)
        bench_slow_disk(ns, folder, report)
    print()
    print_report(report)
    if ns.json:
        ns.json.write_text(json.dumps(asdict(report), indent=2))
        print(f"\nwrote {ns.json}")
    if ns.dir is None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
