"""Child processes for the router's end-to-end tests: workers, routers, a time model file.

Every child runs on loopback with port 0 and prints a banner whose first line names its address;
`ready()` waits for the banner's last line. Tests signal only these children, each by its PID.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import WorkerStub

_ADDRESS = re.compile(r"serving on (\S+)")


class Child:
    """A `strata ...` child process. `start()` returns at once; `ready()` waits for its banner."""

    def __init__(self, name: str, args: Sequence[str]) -> None:
        self.name = name
        self.args = [sys.executable, "-m", "strata_cli.main", *args]
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.address = ""
        self._ready = threading.Event()

    def start(self) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._pump, name=f"{self.name}-out", daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            if not self.address and (m := _ADDRESS.search(line)):
                self.address = m.group(1)
            if self.address and "stop with Ctrl-C" in line:
                self._ready.set()
        self._ready.set()

    def ready(self, timeout_s: float = 120.0) -> str:
        if not self._ready.wait(timeout_s) or not self.address or not self.alive:
            raise RuntimeError(f"{self.name} did not start:\n" + self.text(40))
        return self.address

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def kill9(self) -> None:
        """SIGKILL to this child's PID, and reap it."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(30)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM; the exit code (SIGKILL after `timeout_s`)."""
        assert self.proc is not None
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)

    def text(self, last: int = 0) -> str:
        return "\n".join(self.output[-last:] if last else self.output)


def worker(role: str, model: Path, store: str, *extra: str) -> Child:
    return Child(
        f"{role}",
        [
            role,
            "--model",
            str(model),
            "--store",
            store,
            "--port",
            "0",
            "--max-context",
            "1024",
            "--drain-timeout",
            "2",
            *extra,
        ],
    )


def router(*args: str) -> Child:
    return Child("router", ["router", "--port", "0", "--log-level", "WARNING", *args])


def write_profile(path: Path) -> Path:
    """A time model with explicit coefficients (of the order of the tiny preset on a CPU)."""
    TimeModel(
        PrefillCoeffs(fixed_s=0.004, per_token_s=2e-5, per_cached_token_s=1e-6, attention_s=0.0),
        DecodeCoeffs(fixed_s=0.004, per_request_s=1e-4, per_context_token_s=1e-7),
    ).save(path)
    return path


def load_report(address: str) -> pb.LoadReport:
    """The worker's current load report."""
    with grpc.insecure_channel(address) as channel:
        report: pb.LoadReport = WorkerStub(channel).Load(pb.LoadRequest(), timeout=5)
        return report


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 50 ms until it holds; AssertionError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
