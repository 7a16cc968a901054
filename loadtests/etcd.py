"""Run a single-member etcd as a child process on loopback (cluster tests and benchmarks).

Client and peer ports are free ports picked at start; the data folder is the caller's. `kill()`
sends SIGKILL to that child's PID only. etcd comes from Debian's `etcd-server` package
(scripts/test installs it); a missing binary is an error, never a skip.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

from loadtests.daemon import wait_for


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    """`etcd` on 127.0.0.1 with its state under `data_dir`. Use as a context manager."""

    def __init__(self, data_dir: Path, *, start_timeout_s: float = 30.0) -> None:
        self.data_dir = Path(data_dir)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.client_port = 0
        self.url = ""
        self.output: list[str] = []

    def start(self) -> EtcdProcess:
        exe = shutil.which("etcd")
        if exe is None:
            raise FileNotFoundError(
                "etcd not found on PATH: install Debian's etcd-server (scripts/bootstrap.sh does)"
            )
        self.client_port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            exe, "--name", "strata-test", "--data-dir", str(self.data_dir / "etcd"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"strata-test={peer_url}",
            "--log-level", "warn",
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line.rstrip())

        threading.Thread(target=pump, name="etcd-output", daemon=True).start()
        if not wait_for(self.healthy, timeout_s=self.start_timeout_s, interval_s=0.05):
            self.kill()
            raise RuntimeError("etcd did not start:\n" + "\n".join(self.output[-30:]))
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as reply:
                return b'"true"' in reply.read()
        except OSError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL this etcd (by its PID) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)
        self.proc = None

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
