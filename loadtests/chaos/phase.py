"""One chaos phase: fresh daemon(s), a client load, one fault, then the checks.

Timeline (fractions of the phase's load time): load without the fault for a quarter, the fault
on for half (`Fault.inject` runs until then), a quarter to recover; then the workers stop and
the checks run:

1. every page any worker was acknowledged for is read back through the SDK by a fresh client:
   intact (the key's own bytes), missing (a miss: allowed, it is a cache), or wrong; pages
   workers were served wrong during the load are added to wrong;
2. leaks, through what the daemon exposes: leases still held once every client has stopped and
   the lease time has passed; pages or bytes left after deleting the phase's scope (a page
   that "never leaves"); and, where `strata serve --check-integrity-on-exit` exists, the
   store's own `check_integrity()` run when the daemon stops.

Each phase has its own folder, ports and scope, so phases cannot mask each other's findings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from client import ClusterClient, StoreClient, StrataError
from loadtests.chaos.pages import LAYOUTS, chaos_scope, classify
from loadtests.chaos.report import FaultResult, availability
from loadtests.chaos.worker import Record
from loadtests.daemon import DaemonProcess, wait_for
from loadtests.etcd import free_port

INTEGRITY_FLAG = "--check-integrity-on-exit"
LEASE_TTL_MS = 2000


@dataclass(frozen=True, slots=True)
class Load:
    """The client load of every phase."""

    clients: int = 3
    rate: float = 40.0  # calls per second per client
    pages: int = 8  # pages per prompt
    dram: str = "16MiB"
    ssd: str = "256MiB"


@cache
def daemon_has_flag(flag: str) -> bool:
    """Whether this checkout's `strata serve` takes `flag` (asked once, through --help)."""
    out = subprocess.run(
        [sys.executable, "-m", "strata_cli.main", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    return flag in out.stdout


class Worker:
    """A `loadtests.chaos.worker` child process."""

    def __init__(self, args: Sequence[str], result: Path, prefix: Sequence[str] = ()) -> None:
        self.result = result
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "loadtests.chaos.worker", *args,
             "--result", str(result)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.ready = threading.Event()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "ready":
                self.ready.set()

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())
            del self.stderr[:-40]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 20.0) -> Record | None:
        """SIGCONT (in case it is stopped), SIGTERM, wait; the record it wrote, or None."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        try:
            return Record.from_json(json.loads(self.result.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass
class PhaseEnv:
    """What a fault works on during its phase."""

    name: str
    folder: Path
    load: Load
    daemons: list[DaemonProcess] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    victims: set[int] = field(default_factory=set)  # worker indexes a fault stalls on purpose
    notes: list[str] = field(default_factory=list)
    details: dict[str, object] = field(default_factory=dict)
    etcd_url: str = ""
    began: float = field(default_factory=time.monotonic)
    daemon_prefix: list[str] = field(default_factory=list)  # e.g. ip netns exec NS
    daemon_host: str = "127.0.0.1"
    ports: list[int] = field(default_factory=list)  # one gRPC port per daemon, fixed for restarts

    def mark(self, step: str) -> None:
        """Record how far into the phase `step` ended (the JSON's `details.seconds`)."""
        marks = self.details.setdefault("seconds", {})
        assert isinstance(marks, dict)
        marks[step] = round(time.monotonic() - self.began, 2)

    @property
    def scope_name(self) -> str:
        return f"chaos-{self.name}"

    def stats_client(self, daemon: DaemonProcess) -> StoreClient:
        return StoreClient(daemon.address, shared_memory=False, ucx=False, tcp=False,
                           timeout_s=5.0)


class Fault:
    """One fault. Subclasses override what they need; every method is bounded in time."""

    name = ""
    nodes = 1
    dram = ""  # the daemons' DRAM budget when not the load's (a fault that needs demotion)

    def skip_reason(self) -> str:
        """Why this fault cannot be injected on this machine ("" = it can)."""
        return ""

    def settings(self, env: PhaseEnv) -> list[str]:
        """Extra `strata serve` arguments of this phase's daemons."""
        return []

    def setup(self, env: PhaseEnv) -> str:
        """Prepare before the daemons start; returns a skip reason or ""."""
        return ""

    def worker_args(self, env: PhaseEnv, index: int) -> list[str]:
        return []

    def worker_prefix(self, env: PhaseEnv) -> list[str]:
        return []

    def inject(self, env: PhaseEnv, until: float) -> None:
        """Apply the fault (in steps) until the monotonic time `until`, then clear it."""
        wait_until(until)

    def teardown(self, env: PhaseEnv) -> None:
        """Undo `setup` (always called)."""


def wait_until(t: float) -> None:
    """Block until the monotonic time `t` (a fault's steps and the phase's timeline)."""
    delay = t - time.monotonic()
    if delay > 0:
        threading.Event().wait(delay)


def run_phase(fault: Fault, folder: Path, load: Load, load_s: float) -> FaultResult:
    """Run `fault` under `load` for `load_s` seconds of load, then check. Never raises for a
    finding: a phase that cannot finish reports its error."""
    if reason := fault.skip_reason():
        return FaultResult(fault.name, skipped=reason)
    env = PhaseEnv(fault.name, folder, load)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if reason := fault.setup(env):
            return FaultResult(fault.name, skipped=reason)
        return _run(fault, env, load_s)
    except (StrataError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return FaultResult(fault.name, error=_tail(f"{type(exc).__name__}: {exc}"),
                           notes=tuple(env.notes), details=env.details)
    finally:
        for w in env.workers:
            w.stop()
        for d in env.daemons:
            d.kill()
        fault.teardown(env)


def _start_daemons(fault: Fault, env: PhaseEnv) -> None:
    integrity = [INTEGRITY_FLAG] if daemon_has_flag(INTEGRITY_FLAG) else []
    for n, port in enumerate(env.ports):
        extra = [
            "--host", env.daemon_host,
            "--set", f"limits.lease_ttl_ms={LEASE_TTL_MS}",
            *integrity, *fault.settings(env),
        ]
        d = DaemonProcess(env.folder / f"node{n}", dram=fault.dram or env.load.dram,
                          ssd=env.load.ssd, extra=extra, port=port)
        d.args = [*env.daemon_prefix, *d.args]
        env.daemons.append(d)
        d.start()


def _run(fault: Fault, env: PhaseEnv, load_s: float) -> FaultResult:
    # the workers start (and import) while the daemons do: they retry until one answers
    env.ports = [free_port() for _ in range(fault.nodes)]
    scope = env.scope_name
    for i in range(env.load.clients):
        where = (["--etcd", env.etcd_url] if env.etcd_url
                 else ["--address", f"{env.daemon_host}:{env.ports[0]}"])
        args = [
            *where, "--namespace", scope, "--worker-id", str(i), "--seed", str(i + 1),
            "--rate", str(env.load.rate), "--pages", str(env.load.pages),
            "--duration", str(load_s + 60), *fault.worker_args(env, i),
        ]
        env.workers.append(Worker(args, env.folder / f"worker{i}.json", fault.worker_prefix(env)))
    try:
        _start_daemons(fault, env)
    except RuntimeError as exc:
        text = str(exc)
        if "unknown config key" in text:
            key = text.split("unknown config key", 1)[1].split(";")[0].strip()
            return FaultResult(fault.name, skipped=f"this daemon has no such setting: {key}")
        raise
    env.mark("daemons started")
    if not all(w.ready.wait(60) for w in env.workers):
        late = [i for i, w in enumerate(env.workers) if not w.ready.is_set()]
        errs = "; ".join(" | ".join(env.workers[i].stderr[-3:]) for i in late)
        raise RuntimeError(f"workers {late} made no successful call in 60 s: {errs}")
    env.mark("workers ready")
    start = time.monotonic()
    wait_until(start + load_s * 0.25)
    t_on = time.monotonic()
    fault.inject(env, start + load_s * 0.75)
    t_off = time.monotonic()
    wait_until(max(t_off + 0.5, start + load_s))
    records = []
    for i, w in enumerate(env.workers):
        rec = w.stop()
        if rec is None:
            raise RuntimeError(f"worker {i} wrote no record: {' | '.join(w.stderr[-5:])}")
        records.append(rec)
    env.workers.clear()
    env.mark("workers stopped")
    return _check(fault, env, records, t_on, t_off)


def _check(
    fault: Fault, env: PhaseEnv, records: list[Record], t_on: float, t_off: float
) -> FaultResult:
    acked: dict[int, dict[str, int]] = {}  # page KiB -> key hex -> digest
    wrong_live: set[str] = set()
    calls: list[tuple[float, float, bool, str]] = []
    errors: dict[str, int] = {}
    for i, rec in enumerate(records):
        acked.setdefault(rec.page_kib, {}).update(rec.acked)
        wrong_live.update(rec.wrong)
        for name, n in rec.errors.items():
            errors[name] = errors.get(name, 0) + n
        if i not in env.victims:
            calls.extend(rec.calls)
    avail = availability(calls, t_on, t_off)
    intact: list[bytes] = []
    missing: list[bytes] = []
    wrong_now: list[bytes] = []
    for page_kib, keys in sorted(acked.items()):
        a, b, c = _read_back(env, page_kib, [bytes.fromhex(k) for k in keys])
        intact += a
        missing += b
        wrong_now += c
    env.mark("read back")
    wrong = wrong_live | {k.hex() for k in wrong_now}
    leaks = _leaks(env)
    env.mark("leak checks and stop")
    env.details["client_errors"] = errors
    env.details["served_wrong_during_load"] = len(wrong_live)
    return FaultResult(
        fault.name, acknowledged=sum(len(k) for k in acked.values()), intact=len(intact),
        missing=len(missing), wrong=len(wrong), leaks=leaks, availability=avail,
        notes=tuple(env.notes),
        details=env.details,
    )


def _read_back(
    env: PhaseEnv, page_kib: int, keys: list[bytes]
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Read every acknowledged page once through a fresh client (the default data path)."""
    scope = chaos_scope(env.scope_name, page_kib)
    size = scope.page_payload_bytes
    client: StoreClient | ClusterClient
    if env.etcd_url:
        client = ClusterClient(etcd_endpoints=env.etcd_url, cluster="chaos", replicas=2,
                               timeout_s=10.0, shared_memory=False)
    else:
        client = StoreClient(env.daemons[0].address, timeout_s=10.0, ucx=False)
    intact: list[bytes] = []
    missing: list[bytes] = []
    wrong: list[bytes] = []
    batch = 32 if page_kib <= 32 else 4
    into = [bytearray(size) for _ in range(batch)]
    errors = 0
    try:
        for start in range(0, len(keys), batch):
            part = keys[start : start + batch]
            try:
                # tokens=None: these readers know keys only; every payload is checked against its key
                got = client.get(scope, part, into[: len(part)], tokens=None)
                hits = [e is not None for e in got.entries]
            except StrataError:  # e.g. UNAVAILABLE for an SSD error: try each page alone
                hits = []
                for i, key in enumerate(part):
                    try:
                        one = client.get(scope, [key], into[i : i + 1], tokens=None)
                        hits.append(one.entries[0] is not None)
                    except StrataError:
                        errors += 1  # not served: a miss, never a wrong page
                        hits.append(False)
            a, b, c = classify(part, hits, into[: len(part)])
            intact += a
            missing += b
            wrong += c
    finally:
        client.close()
    env.details["read_back_errors"] = errors
    return intact, missing, wrong


def _leaks(env: PhaseEnv) -> int:
    """Leases and pages that outlive their owners, and what `check_integrity()` says at stop."""
    leaks = 0
    scopes = [chaos_scope(env.scope_name, kib) for kib in LAYOUTS]
    bound_s = 2 * LEASE_TTL_MS / 1000 + 3
    for n, daemon in enumerate(env.daemons):
        with env.stats_client(daemon) as c:
            if not wait_for(lambda c=c: c.stats().active_leases == 0, timeout_s=bound_s,
                            interval_s=0.1):
                leaks += 1
                env.notes.append(f"node{n}: {c.stats().active_leases} leases held after "
                                 f"every client stopped")
            for attempt in range(5):  # a delete may meet an injected SSD error: it is retried
                try:
                    for scope in scopes:
                        c.delete(scope=scope)
                    break
                except StrataError as exc:
                    if attempt == 4:
                        env.notes.append(f"node{n}: delete failed 5 times: {exc}")

            def empty(c: StoreClient = c) -> bool:
                s = c.stats()
                return s.pages == 0 and all(t.used_bytes == 0 for t in s.tiers)

            if not wait_for(empty, timeout_s=bound_s, interval_s=0.1):
                s = c.stats()
                leaks += 1
                left = ", ".join(f"{t.tier.name.lower()} {t.used_bytes} B" for t in s.tiers)
                env.notes.append(f"node{n}: {s.pages} pages left after deleting all ({left})")
        env.mark(f"node{n} checked")
    verdicts: list[str] = []
    for n, daemon in enumerate(env.daemons):
        code = daemon.stop()
        said = [x.strip() for x in daemon.output if x.startswith("integrity: ")]
        if said and said[-1].startswith("integrity: FAILED"):
            leaks += 1
            env.notes.append(f"node{n}: {said[-1]}")
            verdicts.append(said[-1].removeprefix("integrity: "))
        elif said:
            verdicts.append(said[-1].removeprefix("integrity: "))
        elif daemon_has_flag(INTEGRITY_FLAG):
            env.notes.append(f"node{n}: no integrity verdict at stop (exit code {code})")
            verdicts.append(f"no verdict (exit code {code})")
    if not daemon_has_flag(INTEGRITY_FLAG):
        env.details["check_integrity"] = "not reachable: strata serve has no " + INTEGRITY_FLAG
    else:
        env.details["check_integrity"] = "; ".join(verdicts)
    env.daemons.clear()
    return leaks


def _tail(text: str, limit: int = 600) -> str:
    """The end of an error (a daemon's traceback ends with what went wrong), on one line."""
    flat = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return flat if len(flat) <= limit else "..." + flat[-limit:]
