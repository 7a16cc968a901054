"""A driver for Mooncake Store (PyPI `mooncake-transfer-engine-non-cuda`, the `peers` extra).

What `strata bench store --against mooncake` runs, on loopback only:

- `MooncakeMaster`: Mooncake's master (the `mooncake_master` binary shipped in the package),
  started here as a child process on 127.0.0.1 (RPC and metrics ports picked free), with
  `local_first` placement (a client that mounts storage keeps its own puts); otherwise its
  defaults (the benchmark removes what it stored between measurements with a forced remove).
- `MooncakeHolder`: a child process whose only job is to mount Mooncake storage, for the remote
  rows: a client without storage of its own then moves every byte over Mooncake's TCP transport.
- `MooncakeClient`: one `MooncakeDistributedStore` in the caller's process, in P2P-handshake mode
  (no metadata server), used through the zero-copy batch API (`register_buffer`,
  `batch_put_from`, `batch_get_into`, `batch_is_exist`). With `segment_bytes` > 0 its storage is
  in the caller's process: Mooncake's same-host case.

Processes started here are ended by their own PID. Mooncake's native code logs to file
descriptor 2; `native_log_to` sends that to a file while Mooncake runs in this process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

NAME = "mooncake"
HIDE_ENV = "STRATA_BENCH_HIDE_PEERS"
"""Comma-separated peer names to treat as not installed (tests of the fallback use it)."""

INSTALL_HINT = (
    "Mooncake is not installed. Get it with the `peers` extra: from a checkout "
    "`.venv/bin/pip install -e '.[peers]'`, or `.venv/bin/pip install 'stratakv[peers]'` "
    "(it installs mooncake-transfer-engine-non-cuda; its native code also needs libibverbs: "
    "`apt-get install libibverbs1` on Debian)."
)
_READY_TIMEOUT_S = 30.0


class PeerFailed(RuntimeError):
    """Mooncake failed a call the benchmark needs (a put refused, a get short, a start)."""


def installed() -> bool:
    """The `mooncake` package is importable here (it may still fail to load its libraries)."""
    return importlib.util.find_spec("mooncake") is not None


def missing_reason() -> str | None:
    """None when Mooncake can be used here; otherwise why not, and how to get it.

    Honours `STRATA_BENCH_HIDE_PEERS=mooncake` (the peer counts as not installed)."""
    hidden = {name.strip() for name in os.environ.get(HIDE_ENV, "").split(",")}
    if NAME in hidden or not installed():
        return INSTALL_HINT
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        return (
            f"Mooncake is installed but does not load here ({exc}). Its native code needs "
            "libibverbs (`apt-get install libibverbs1` on Debian)."
        )
    return None


def master_binary() -> Path:
    """The `mooncake_master` executable inside the installed package (made executable)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise PeerFailed(INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file():
        raise PeerFailed(f"{path} is missing from the mooncake package")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class MooncakeMaster:
    """`mooncake_master` on loopback, as a child process. Use as a context manager."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = self.folder / "mooncake-master.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> MooncakeMaster:
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a port picked free can be taken before the master binds it
            self.port, metrics = free_port(), free_port()
            args = [
                str(master_binary()),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
                "--enable_http_metadata_server=false",
                "--allocation_strategy=local_first",
            ]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _accepts(self.port):
                    return self
                time.sleep(0.05)
            self.stop()
        raise PeerFailed(f"mooncake_master did not start; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the master (by its PID), SIGKILL after `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeHolder:
    """A child process that mounts `segment_bytes` of Mooncake storage and holds it until its
    standard input closes (`loadtests.peers.mooncake_holder`). Use as a context manager."""

    def __init__(self, master: str, segment_bytes: int, log_path: Path) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> MooncakeHolder:
        args = [
            sys.executable, "-m", "loadtests.peers.mooncake_holder",
            self.master, str(self.segment_bytes),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        line: list[str] = []
        ready = threading.Event()

        def read_first_line() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            line.append(self.proc.stdout.readline())
            ready.set()

        threading.Thread(target=read_first_line, name="mooncake-holder", daemon=True).start()
        if not ready.wait(_READY_TIMEOUT_S) or not line or line[0].strip() != "ready":
            self.stop()
            raise PeerFailed(f"the Mooncake storage process did not start; see {self.log_path}")
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Close its standard input (it unmounts and exits), SIGKILL by PID after a timeout."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def __enter__(self) -> MooncakeHolder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def open_store(master: str, segment_bytes: int) -> Any:
    """A set-up `MooncakeDistributedStore` on loopback (TCP protocol, P2P handshake) that mounts
    `segment_bytes` of storage in this process (0: none). PeerFailed if setup fails."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        "127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master
    )
    if code != 0:
        raise PeerFailed(f"MooncakeDistributedStore.setup answered {code}")
    return store


class MooncakeClient:
    """The zero-copy calls the benchmark times, on buffers registered with `register`.

    `segment_bytes` > 0: Mooncake's storage lives in this process (same-host); 0: every byte
    goes to a `MooncakeHolder` over Mooncake's TCP transport (remote)."""

    def __init__(self, master: str, segment_bytes: int) -> None:
        self.store = open_store(master, segment_bytes)
        self._pinned: list[tuple[int, object]] = []  # (address, the ctypes view that pins it)

    def register(self, arena: bytearray) -> int:
        """Register `arena` for zero-copy transfers; returns its base address."""
        view = (ctypes.c_char * len(arena)).from_buffer(arena)
        base = ctypes.addressof(view)
        code = self.store.register_buffer(base, len(arena))
        if code != 0:
            raise PeerFailed(f"register_buffer answered {code}")
        self._pinned.append((base, view))
        return base

    def unregister(self, base: int) -> None:
        """Unregister the buffer `register` returned `base` for (its arena may be freed after)."""
        for entry in [e for e in self._pinned if e[0] == base]:
            self.store.unregister_buffer(base)
            self._pinned.remove(entry)

    def unregister_all(self) -> None:
        """Unregister every buffer `register` registered (their arenas may be freed after)."""
        pinned, self._pinned = self._pinned, []
        for base, _ in pinned:
            self.store.unregister_buffer(base)

    def put(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> None:
        codes = self.store.batch_put_from(keys, addresses, sizes)
        if any(code != 0 for code in codes):
            raise PeerFailed(f"batch_put_from answered {sorted(set(codes))}")

    def get(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> None:
        got = self.store.batch_get_into(keys, addresses, sizes)
        if list(got) != list(sizes):
            raise PeerFailed(f"batch_get_into delivered {sorted(set(got))} bytes, not {sizes[0]}")

    def get_missing(self, key: str, address: int, size: int) -> None:
        """A get of a key that is not there (which must come back as a miss)."""
        if self.store.get_into(key, address, size) >= 0:
            raise PeerFailed(f"get_into of the missing key {key!r} found it")

    def present(self, keys: Sequence[str]) -> int:
        """How many leading keys are present (`batch_is_exist`, then the prefix an engine
        would use)."""
        found = 0
        for flag in self.store.batch_is_exist(keys):
            if flag != 1:
                break
            found += 1
        return found

    def prime(self, total_bytes: int) -> None:
        """Write `total_bytes` of 4 MiB objects through this client once and remove them, so its
        storage (here or in the holder) has been touched before anything is timed."""
        size, batch = 4 << 20, 16
        arena = bytearray(size * batch)
        base = self.register(arena)
        try:
            for n in range(max(1, total_bytes // (size * batch))):
                keys = [f"prime-{n}-{j}" for j in range(batch)]
                self.put(keys, [base + j * size for j in range(batch)], [size] * batch)
        finally:
            self.clear()
            self.unregister(base)

    def clear(self) -> None:
        """Remove every object (forced: leases and replication tasks are not waited for)."""
        self.store.remove_all(True)

    def close(self) -> None:
        self.unregister_all()
        self.store.close()


@contextlib.contextmanager
def native_log_to(path: Path) -> Iterator[None]:
    """Send this process's file descriptor 2 (where Mooncake's native code logs) to `path` for
    the block; Python's own stderr goes there too meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
