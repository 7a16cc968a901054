"""A router in front of real worker processes, for `strata bench router`, the drills and e2e tests.

`RouterCluster` starts, as child processes on loopback (port 0 at first): a store daemon
(`strata serve`), `prefill` prefill workers and `decode` decode workers (`strata prefill` /
`strata decode`) on a preset checkpoint, and a router (`strata router --workers ...`) with a
time model. Every process is signalled by its own PID only: `kill(worker)` is a SIGKILL (a
crash), `restart(worker)` starts it again on the same port (the router's static worker list
names it, so the router finds it by itself), `stop()` sends SIGTERM to everything, then
SIGKILL after a timeout.

With `netns` the store and the workers run inside a network namespace the cluster creates
(`ip netns add`, a veth pair 10.251.N.1 (here) <-> 10.251.N.2 (there)); the router and its
clients stay here, so router <-> worker traffic crosses the veth and nothing else does. That is
where the drills put packet loss (`impair_loss`). Needs root; `stop()` deletes the namespace
and the veth.

The time model is `profile` if given, else explicit coefficients written to the work folder
(`write_test_profile`): enough for placement to work, not a measurement.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.router.core.timemodel import (
    DecodeCoeffs,
    PrefillCoeffs,
    Provenance,
    PullCoeffs,
    TimeModel,
)
from loadtests.daemon import DaemonProcess

_SERVING = re.compile(r"^strata \w+ serving on (\S+)")


class ClusterError(RuntimeError):
    """A process of the cluster did not start, or the router never saw its workers."""


def write_test_profile(path: Path) -> Path:
    """A time model with explicit coefficients (CPU, tiny preset order of magnitude)."""
    model = TimeModel(
        prefill=PrefillCoeffs(
            fixed_s=0.01, per_token_s=5.0e-5, per_cached_token_s=1.0e-6, attention_s=1.0e-8
        ),
        decode=DecodeCoeffs(fixed_s=0.01, per_request_s=1.0e-3, per_context_token_s=1.0e-6),
        pulls=(PullCoeffs("dram", True, 1.0e-3, 1.0e-9), PullCoeffs("ssd", True, 2.0e-3, 2.0e-9)),
        provenance=Provenance(
            note="explicit coefficients (loadtests.router_cluster), not measured"
        ),
    )
    model.save(path)
    return path


class Proc:
    """A `strata <command>` child: `start()` returns once its banner's last line is out."""

    def __init__(self, name: str, args: Sequence[str], *, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.args = [*prefix, sys.executable, "-m", "strata_cli.main", *args]
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.address = ""
        self._ready = threading.Event()

    def start(self, timeout_s: float = 120.0) -> Proc:
        self._ready.clear()
        self.address = ""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        if not self._ready.wait(timeout_s) or not self.address or self.proc.poll() is not None:
            self.kill()
            tail = "\n".join(self.output[-30:])
            raise ClusterError(f"{self.name} did not start ({' '.join(self.args)}):\n{tail}")
        return self

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output.append(line.rstrip())
            if not self.address and (m := _SERVING.search(line)):
                self.address = m.group(1)
            if self.address and "stop with Ctrl-C" in line:
                self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL this child's PID (a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM this child's PID, SIGKILL after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Worker:
    role: str
    proc: Proc
    port: int = 0

    @property
    def address(self) -> str:
        return self.proc.address


@dataclass
class ClusterSpec:
    preset: str = "tiny"
    prefill: int = 1
    decode: int = 1
    policy: str = "strata"
    model: Path | None = None  # a checkpoint; default: the preset, written to the work folder
    profile: Path | None = None
    max_context: int = 1024
    max_batch: int = 32
    drop_after_s: float = 1.0
    netns: bool = False
    router_config: str = ""  # extra TOML for the router's config file ([admission] tables)
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = field(default_factory=tuple)


class Netns:
    """A network namespace with a veth pair to this one, deleted by `close()`."""

    def __init__(self, tag: int) -> None:
        self.name = f"strata-{os.getpid()}-{tag}"
        n = 1 + (os.getpid() + tag) % 250
        self.here_if, self.there_if = f"sdh{os.getpid() % 100000}{tag}", "eth0"
        self.here_ip, self.there_ip = f"10.251.{n}.1", f"10.251.{n}.2"
        self._tmp_if = f"sdt{os.getpid() % 100000}{tag}"
        self.created = False

    def create(self) -> Netns:
        if os.geteuid() != 0:
            raise ClusterError("a network namespace needs root")
        run(["ip", "netns", "add", self.name])
        self.created = True
        run(["ip", "link", "add", self.here_if, "type", "veth", "peer", "name", self._tmp_if])
        run(["ip", "link", "set", self._tmp_if, "netns", self.name])
        self.exec(["ip", "link", "set", self._tmp_if, "name", self.there_if])
        run(["ip", "addr", "add", f"{self.here_ip}/30", "dev", self.here_if])
        run(["ip", "link", "set", self.here_if, "up"])
        self.exec(["ip", "addr", "add", f"{self.there_ip}/30", "dev", self.there_if])
        self.exec(["ip", "link", "set", self.there_if, "up"])
        self.exec(["ip", "link", "set", "lo", "up"])
        return self

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def exec(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([*self.prefix, *args], check=check)

    def impair_loss(self, percent: float) -> str:
        """Drop `percent`% of the packets crossing the veth, each way, at random; returns how
        ("netem" where the kernel has sch_netem, else "nftables": a `numgen random` drop rule
        on the namespace's end). ClusterError when neither works."""
        if not 0 < percent < 100:
            raise ValueError(f"loss percent must be in (0, 100), got {percent}")
        if netem_works(self):
            for args in (
                ["tc", "qdisc", "add", "dev", self.here_if, "root", "netem", "loss", f"{percent}%"],
                [*self.prefix, "tc", "qdisc", "add", "dev", self.there_if, "root", "netem",
                 "loss", f"{percent}%"],
            ):  # fmt: skip
                run(args)
            return "netem"
        if shutil.which("nft") is None:
            raise ClusterError(
                "no way to drop packets: the kernel has no netem qdisc and nft is not installed"
            )
        per_10k = round(percent * 100)
        rules = (
            "table inet strata_drill {\n"
            f"  chain in {{ type filter hook input priority 0; policy accept; "
            f'iifname "{self.there_if}" numgen random mod 10000 < {per_10k} counter drop; }}\n'
            f"  chain out {{ type filter hook output priority 0; policy accept; "
            f'oifname "{self.there_if}" numgen random mod 10000 < {per_10k} counter drop; }}\n'
            "}\n"
        )
        out = subprocess.run(
            [*self.prefix, "nft", "-f", "-"], input=rules, capture_output=True, text=True,
            timeout=30, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise ClusterError(f"nft: {(out.stderr or out.stdout).strip()}")
        return "nftables"

    def clear_impairment(self) -> None:
        """Undo `impair_loss` (either mechanism); a no-op when nothing was added."""
        run(["tc", "qdisc", "del", "dev", self.here_if, "root"], check=False)
        self.exec(["tc", "qdisc", "del", "dev", self.there_if, "root"], check=False)
        if shutil.which("nft") is not None:
            self.exec(["nft", "delete", "table", "inet", "strata_drill"], check=False)

    def dropped_packets(self) -> int:
        """Packets the nftables rules dropped so far (0 with netem, which keeps no count here)."""
        out = self.exec(["nft", "list", "table", "inet", "strata_drill"], check=False)
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out.stdout))

    def close(self) -> None:
        if self.created:
            with contextlib.suppress(ClusterError):
                run(["ip", "link", "del", self.here_if], check=False)
                run(["ip", "netns", "del", self.name], check=False)
            self.created = False


def run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise ClusterError(f"{' '.join(args)}: {(out.stderr or out.stdout).strip()}")
    return out


class RouterCluster:
    """See the module doc. Use as a context manager; `stop()` is idempotent."""

    def __init__(self, spec: ClusterSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.netns = Netns(id(self) % 997) if spec.netns else None
        self.store: DaemonProcess | None = None
        self.workers: list[Worker] = []
        self.router: Proc | None = None
        self.model_path = spec.model or self.workdir / f"{spec.preset}-ckpt"
        self.profile_path = spec.profile or self.workdir / "profile.json"
        self.base_url = ""

    # ---- lifecycle

    def start(self, timeout_s: float = 180.0) -> RouterCluster:
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        if self.spec.model is None and not (self.model_path / "config.json").exists():
            from engine.presets import init_checkpoint

            init_checkpoint(self.model_path, self.spec.preset)
        if self.spec.profile is None:
            write_test_profile(self.profile_path)
        host = "127.0.0.1"
        prefix: list[str] = []
        if self.netns is not None:
            self.netns.create()
            host, prefix = self.netns.there_ip, self.netns.prefix
        # Inside the namespace this cluster created, the daemon listens on the namespace's own
        # address: nothing outside the veth pair reaches it, so it may run open there.
        extra = ["--host", host]
        if self.netns is not None:
            extra += ["--set", "server.allow_open=true"]
        store = DaemonProcess(self.workdir / "store", dram="256MiB", ssd="256MiB", extra=extra)
        store.args = [*prefix, *store.args]
        self.store = store.start()
        threads = []
        for role, count in (("prefill", self.spec.prefill), ("decode", self.spec.decode)):
            for _ in range(count):
                worker = Worker(role, Proc(role, self._worker_args(role, host, 0), prefix=prefix))
                self.workers.append(worker)
                t = threading.Thread(target=_start_quietly, args=(worker.proc, timeout_s))
                threads.append(t)
                t.start()
        for t in threads:
            t.join()
        for worker in self.workers:
            if not worker.proc.running or not worker.address:
                raise ClusterError(
                    f"{worker.role} worker did not start:\n" + "\n".join(worker.proc.output[-30:])
                )
            worker.port = int(worker.address.rpartition(":")[2])
            worker.proc.args = [
                *prefix,
                *self._cmd(self._worker_args(worker.role, host, worker.port)),
            ]
        self.start_router(self.spec.policy, timeout_s=timeout_s)

    def _cmd(self, args: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "strata_cli.main", *args]

    def _worker_args(self, role: str, host: str, port: int) -> list[str]:
        assert self.store is not None
        args = [
            role, "--model", str(self.model_path), "--store", self.store.address,
            "--host", host, "--port", str(port), "--page-tokens", "16",
            "--max-context", str(self.spec.max_context),
        ]  # fmt: skip
        if role != "prefill":
            args += ["--max-batch", str(self.spec.max_batch)]
        return [*args, *self.spec.worker_args]

    def start_router(
        self, policy: str, *, timeout_s: float = 120.0, workers: Sequence[Worker] | None = None
    ) -> str:
        """(Re)start the router with `policy` over `workers` (default: all); waits until it sees
        every running one."""
        assert self.store is not None
        chosen = list(self.workers if workers is None else workers)
        if self.router is not None:
            self.router.stop()
        config = self.workdir / "router.toml"
        config.write_text(self.spec.router_config)
        args = [
            "router", "--config", str(config), "--port", "0",
            "--workers", ",".join(w.address for w in chosen),
            "--store", self.store.address, "--profile", str(self.profile_path),
            "--policy", policy, "--drop-after", str(self.spec.drop_after_s),
            *self.spec.router_args,
        ]  # fmt: skip
        self.router = Proc("router", args).start(timeout_s)
        self.base_url = self.router.address.removesuffix("/v1")
        want = {
            "prefill": sum(1 for w in chosen if w.role == "prefill" and w.proc.running),
            "decode": sum(1 for w in chosen if w.role == "decode" and w.proc.running),
        }
        if not self.wait_health(lambda h: all(h.get(k) == v for k, v in want.items()), timeout_s):
            raise ClusterError(f"the router never saw {want}: {self.health()}")
        return self.base_url

    def stop(self) -> None:
        """SIGTERM every process started here (by PID), SIGKILL stragglers; drop the netns."""
        procs = [self.router] if self.router is not None else []
        procs += [w.proc for w in self.workers]
        threads = [threading.Thread(target=p.stop) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.router = None
        self.workers = []
        if self.store is not None:
            self.store.stop()
            self.store = None
        if self.netns is not None:
            self.netns.close()

    def __enter__(self) -> RouterCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- faults

    def kill(self, worker: Worker) -> None:
        """SIGKILL `worker` (a crash)."""
        worker.proc.kill()

    def restart(self, worker: Worker, timeout_s: float = 120.0) -> None:
        """Start `worker` again on its port (bounded retries while the port is released)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                worker.proc.start(max(1.0, deadline - time.monotonic()))
                return
            except ClusterError:
                if time.monotonic() > deadline or "in use" not in "\n".join(worker.proc.output):
                    raise
                time.sleep(0.2)

    # ---- the router's view

    def health(self) -> dict[str, object]:
        try:
            r = httpx.get(f"{self.base_url}/health", timeout=2.0)
            data: dict[str, object] = r.json()
            return data
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_health(self, pred: object, timeout_s: float) -> bool:
        """Poll /health until `pred(health)` holds (bounded by `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if callable(pred) and pred(self.health()):
                return True
            time.sleep(0.05)
        return False

    def metrics_text(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=5.0).text

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]


def _start_quietly(proc: Proc, timeout_s: float) -> None:
    with contextlib.suppress(ClusterError):
        proc.start(timeout_s)


def netem_works(ns: Netns) -> bool:
    """Whether `tc qdisc add dev lo root netem loss 1%` works inside `ns` (removed again)."""
    if shutil.which("tc") is None:
        return False
    out = ns.exec(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "1%"], check=False)
    if out.returncode != 0:
        return False
    ns.exec(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    return True


def loss_support() -> tuple[str, str]:
    """How packet loss can be injected here: ("netem" | "nftables" | "", the reasons for what
    is missing). Probes in a throwaway namespace."""
    if os.geteuid() != 0:
        return "", "not root: cannot create a network namespace"
    if shutil.which("ip") is None:
        return "", "iproute2 (ip) is not installed"
    ns = Netns(998)
    try:
        ns.create()
        if netem_works(ns):
            return "netem", ""
        out = ns.exec(
            ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "1%"], check=False
        )
        why = f"`tc qdisc add dev lo root netem loss 1%` in a namespace: {(out.stderr or out.stdout).strip()}"
        if shutil.which("nft") is None:
            return "", f"{why}; and nft (nftables) is not installed for the fallback"
        probe = ns.exec(["nft", "add", "table", "inet", "strata_probe"], check=False)
        if probe.returncode != 0:
            return "", f"{why}; and nft failed: {(probe.stderr or probe.stdout).strip()}"
        return "nftables", why
    except ClusterError as exc:
        return "", str(exc)
    finally:
        ns.close()
