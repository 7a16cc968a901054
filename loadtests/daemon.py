"""Run a store daemon as a child process (benchmarks, load tests, e2e tests).

The daemon is started with `python -m strata_cli.main serve --port 0 ...`; its first stdout line
names the bound address. `stop()` sends SIGTERM to that child's PID only, then SIGKILL after a
timeout; `kill()` sends SIGKILL (crash tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_ADDR_RE = re.compile(r"serving on (\S+)")
_LOCAL_RE = re.compile(r"same-host control: (\S+)")
_METRICS_RE = re.compile(r"metrics: (\S+)")
_SEGMENT_RE = re.compile(r"shared memory: /dev/shm/(\S+)")


class DaemonProcess:
    """A `strata serve` child process on loopback. Use as a context manager."""

    def __init__(
        self,
        data_dir: Path,
        *,
        dram: str = "1GiB",
        ssd: str = "4GiB",
        extra: Sequence[str] = (),
        port: int = 0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.args = [
            sys.executable, "-m", "strata_cli.main", "serve",
            "--port", str(port), "--metrics-port", "0", "--data-dir", str(self.data_dir),
            "--dram", dram, "--ssd", ssd, *extra,
        ]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.local_address = ""
        self.metrics_url = ""
        self.segment = ""
        self.output: list[str] = []

    def start(self) -> DaemonProcess:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line.rstrip())
                if m := _ADDR_RE.search(line):
                    self.address = m.group(1)
                elif m := _LOCAL_RE.search(line):
                    self.local_address = m.group(1)
                elif m := _SEGMENT_RE.search(line):
                    self.segment = m.group(1)
                elif m := _METRICS_RE.search(line):
                    self.metrics_url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, name="daemon-output", daemon=True).start()
        if not ready.wait(self.start_timeout_s) or not self.address or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("daemon did not start:\n" + "\n".join(self.output[-30:]))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait, SIGKILL if needed. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL (a crash) and reap; unlinks the shared-memory file the dead daemon left."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)
        self.proc = None
        if self.segment:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{self.segment}")

    def __enter__(self) -> DaemonProcess:
        # `with DaemonProcess(...).start() as d:` must not start a second daemon (the first
        # would be left running, orphaned, with its shared-memory segment).
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: object, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Poll a condition with a bounded count of tries (for tests across processes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(interval_s)
    return False
