"""`strata up`: the whole serving system on this machine, with one command.

strata up [--preset small|tiny | --model PATH] [--prefill N] [--decode M] [--colocated]
          [--port 8000] [--data-dir DIR] [--profile PATH] [--router-config TOML]
          [--api-keys FILE]

Starts, as child processes on loopback: a store daemon (`strata serve`), N prefill and M decode
workers (or M co-located ones with --colocated) and the router (`strata router`). On first run
it writes the preset's random-weight checkpoint under the per-user cache folder and profiles the
worker (`engine.profile.load_or_profile`; both with progress shown), and reuses both afterwards.
It prints the base URL, the model name and ready-to-paste curl and OpenAI-client examples.

Ctrl-C or SIGTERM stops everything in order — router, workers (draining), store — and then
checks that no child process and no shared-memory segment of the store is left (it removes a
segment a crashed store left). Each child also gets SIGKILL from the kernel if `strata up`
itself dies (PR_SET_PDEATHSIG). The router listens only on 127.0.0.1: open (no API keys, and it
says so), or with `--api-keys FILE` enforcing the keys of that file (docs/security.md). The
store daemon runs open (no tokens file) on 127.0.0.1, and says so too: only this host's users
reach it. A port that is taken is reported before anything starts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from engine.router.cli import bind
from engine.router.tenancy import KeyTable

HOST = "127.0.0.1"
_SERVING = re.compile(r"serving on (\S+)")
_SEGMENT = re.compile(r"shared memory: /dev/shm/(\S+)")
STORE_METRICS = re.compile(r"metrics: (http://\S+)")  # the store daemon's banner line
_PR_SET_PDEATHSIG = 1


def cache_dir() -> Path:
    """The per-user cache folder ($XDG_CACHE_HOME/strata, else ~/.cache/strata)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata up", description="Run store, workers and router.")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=("small", "tiny"), default="small")
    model.add_argument("--model", help="a Hugging Face checkpoint folder instead of a preset")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="co-located prefill+decode workers instead (as many as --decode)",
    )
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port (default 8000)")
    p.add_argument("--data-dir", type=Path, help="state folder (default: the per-user cache)")
    p.add_argument("--profile", type=Path, help="a time model to use instead of profiling")
    p.add_argument(
        "--router-config",
        type=Path,
        help="a router TOML file (SLO classes, policy); its workers and store are replaced",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        help="API key file (TOML, docs/security.md): the router enforces its keys",
    )
    p.add_argument("--max-context", type=int, default=4096, help="context limit (default 4096)")
    p.add_argument("--dram", default="1GiB", help="the store's DRAM budget (default 1GiB)")
    p.add_argument("--ssd", default="4GiB", help="the store's SSD budget (default 4GiB; 0: none)")
    return p


@dataclass
class Child:
    """One child process; its output goes to `log` (and is scanned for its banner)."""

    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[str] | None = None
    address: str = ""
    segment: str = ""
    lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C reaches `strata up` only; it stops the children
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._pump, name=f"{self.name}-out", daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log.open("a") as sink:
            for line in self.proc.stdout:
                sink.write(line)
                sink.flush()
                self.lines.append(line.rstrip())
                del self.lines[:-200]
                if not self.segment and (m := _SEGMENT.search(line)):
                    self.segment = m.group(1)
                if not self.address and (m := _SERVING.search(line)):
                    self.address = m.group(1)
                if self.address and "stop with Ctrl-C" in line:
                    self._ready.set()
        self._ready.set()

    def ready(self, timeout_s: float, stop: threading.Event | None = None) -> str:
        """Wait for the child's whole banner; its address. RuntimeError if it exited first, or
        when `stop` is set meanwhile (Ctrl-C during start-up)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if stop is not None and stop.is_set():
                raise RuntimeError("stopped during start-up")
            if time.monotonic() > deadline:
                break
        if not self._ready.is_set() or not self.address or not self.alive:
            tail = "\n".join(f"    {line}" for line in self.lines[-15:])
            raise RuntimeError(f"{self.name} did not start (log {self.log}):\n{tail}")
        return self.address

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        """Wait for the exit; SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent dies (Linux), so no child outlives `strata up`."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def _strata(*args: str) -> list[str]:
    return [sys.executable, "-m", "strata_cli.main", *args]


class Up:
    """The running system; `stop()` ends it."""

    def __init__(self, ns: argparse.Namespace, stop: threading.Event | None = None) -> None:
        self.ns = ns
        self.stopping = stop or threading.Event()
        self.data = (ns.data_dir or cache_dir()).expanduser().resolve()
        self.logs = self.data / "up" / "logs"
        self.children: list[Child] = []
        self.store: Child | None = None
        self.router: Child | None = None

    def step(self, number: int, text: str) -> None:
        print(f"[{number}/5] {text}", flush=True)

    def checkpoint(self) -> Path:
        if self.ns.model:
            path = Path(self.ns.model).expanduser().resolve()
            self.step(1, f"model: {path}")
            return path
        path = self.data / "models" / f"strata-{self.ns.preset}"
        if (path / "config.json").exists() and (path / "tokenizer_config.json").exists():
            self.step(1, f"model: the {self.ns.preset} preset at {path}")
            return path
        self.step(1, f"writing the {self.ns.preset} preset checkpoint to {path} (first run) ...")
        began = time.monotonic()
        from engine.presets import init_checkpoint  # torch: only on first run

        result = init_checkpoint(path, self.ns.preset, seed=0, tie_word_embeddings=False)
        print(
            f"      {result.num_params:,} parameters written in {time.monotonic() - began:.1f} s",
            flush=True,
        )
        return path

    def profile(self, checkpoint: Path, store: str) -> Path:
        """The time model file: --profile, else this checkpoint's profile under the data folder
        (measured on first run, with pulls from `store`; reused while it matches)."""
        if self.ns.profile:
            self.step(3, f"time model: {self.ns.profile}")
            return Path(self.ns.profile)
        from engine.profile import load_or_profile  # torch

        target = self.data / "profiles" / f"{checkpoint.name}.json"
        fresh = not target.exists()
        self.step(3, f"time model: {'measuring this machine (first run)' if fresh else target}")
        began = time.monotonic()
        load_or_profile(
            checkpoint,
            store=store,
            path=target,
            progress=lambda text: print(f"      {text}", flush=True),
        )
        if fresh:
            print(f"      saved to {target} ({time.monotonic() - began:.1f} s)", flush=True)
        return target

    def start(self) -> str:
        """Start everything; returns the router's base URL. RuntimeError when a part fails."""
        ns = self.ns
        self.logs.mkdir(parents=True, exist_ok=True)
        checkpoint = self.checkpoint()
        self.step(2, "store daemon ...")
        self.store = self._spawn(
            "store",
            _strata(
                "serve",
                "--host",
                HOST,
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--data-dir",
                str(self.data / "up" / "store"),
                "--dram",
                ns.dram,
                "--ssd",
                ns.ssd or "0",
            ),
        )
        store = self.store.ready(60, self.stopping)
        profile = self.profile(checkpoint, store)
        roles = (
            [("colocated", ns.decode)]
            if ns.colocated
            else [
                ("prefill", ns.prefill),
                ("decode", ns.decode),
            ]
        )
        self.step(4, ", ".join(f"{n} {role}" for role, n in roles) + " worker(s) ...")
        workers: list[Child] = []
        for role, count in roles:
            for i in range(count):
                workers.append(
                    self._spawn(
                        f"{role}-{i}",
                        _strata(
                            role,
                            "--model",
                            str(checkpoint),
                            "--store",
                            store,
                            "--host",
                            HOST,
                            "--port",
                            "0",
                            "--max-context",
                            str(ns.max_context),
                            "--drain-timeout",
                            "5",
                        ),
                    )
                )
        addresses = [w.ready(600, self.stopping) for w in workers]
        self.step(5, "router ...")
        self.router = self._spawn(
            "router",
            _strata(
                "router",
                "--host",
                HOST,
                "--port",
                str(ns.port),
                "--workers",
                ",".join(addresses),
                "--store",
                store,
                "--profile",
                str(profile),
                *(["--config", str(ns.router_config)] if ns.router_config else []),
                *(["--api-keys", str(ns.api_keys)] if ns.api_keys else []),
                "--log-level",
                "WARNING",
            ),
        )
        return self.router.ready(60, self.stopping)

    def _spawn(self, name: str, args: list[str]) -> Child:
        child = Child(name, args, self.logs / f"{name}.log").start()
        self.children.append(child)
        return child

    def stop(self) -> list[str]:
        """Router, then workers (in parallel), then the store; returns what was left behind
        (and cleaned up)."""
        order = [[c for c in self.children if c is self.router]]
        order.append([c for c in self.children if c not in (self.router, self.store)])
        order.append([c for c in self.children if c is self.store])
        for group in order:
            for child in group:
                child.terminate()
            for child in group:
                child.wait(20)
        left: list[str] = []
        for child in self.children:
            if child.alive:
                left.append(f"process {child.name}")
        if self.store is not None and self.store.segment:
            segment = Path("/dev/shm") / self.store.segment
            if segment.exists():
                segment.unlink()
                left.append(f"shared-memory segment {segment} (removed)")
        return left

    def check(self) -> str:
        """ "" while all is well; else what failed."""
        for child in self.children:
            if not child.alive:
                code = child.proc.returncode if child.proc is not None else None
                return f"{child.name} exited (code {code}); see {child.log}"
        return ""


def banner(base: str, model: str, ns: argparse.Namespace, up: Up) -> None:
    root = base.removesuffix("/v1")
    workers = [c for c in up.children if c not in (up.store, up.router)]
    print(f"\nStrata is up at {base}   model: {model}", flush=True)
    if ns.api_keys:
        print(f"  API keys enforced from {ns.api_keys}, on 127.0.0.1 only", flush=True)
    else:
        print("  open access (no API keys), on 127.0.0.1 only", flush=True)
    key = "YOUR_KEY" if ns.api_keys else "none"
    assert up.store is not None
    print(
        f"  store {up.store.address} (open: no store tokens, on 127.0.0.1 only); "
        + ", ".join(f"{w.name} {w.address}" for w in workers)
    )
    store_metrics = next((m.group(1) for m in map(STORE_METRICS.search, up.store.lines) if m), "")
    if store_metrics:
        print(f"  store metrics {store_metrics}", flush=True)
    print(f"  logs in {up.logs}", flush=True)
    print("\n  curl:", flush=True)
    print(
        f"    curl {base}/completions -H 'Content-Type: application/json' \\\n"
        + (f"      -H 'Authorization: Bearer {key}' \\\n" if ns.api_keys else "")
        + f'      -d \'{{"model": "{model}", "prompt": "The store keeps pages", "max_tokens": 32}}\'',
        flush=True,
    )
    print("\n  OpenAI client (Python):", flush=True)
    print(
        "    from openai import OpenAI\n"
        f'    client = OpenAI(base_url="{base}", api_key="{key}")\n'
        f'    reply = client.chat.completions.create(model="{model}", max_tokens=32,\n'
        '        messages=[{"role": "user", "content": "Hello"}])\n'
        "    print(reply.choices[0].message.content)",
        flush=True,
    )
    print(f"\n  health {root}/health   metrics {root}/metrics", flush=True)
    print("  stop with Ctrl-C or SIGTERM", flush=True)


def _model_name(base: str) -> str:
    """The model the router serves, once it lists one (bounded: 30 s). Asks /health, which
    needs no API key."""
    deadline = time.monotonic() + 30
    root = base.removesuffix("/v1")
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=2) as reply:
                data = json.loads(reply.read())["models"]
            if data:
                return str(data[0])
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the router did not list the model within 30 s")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.prefill < 1 or ns.decode < 1:
        print("strata up: --prefill and --decode must be at least 1", file=sys.stderr)
        return 2
    try:
        bind(HOST, ns.port).close()  # a taken port is reported before anything starts
        if ns.api_keys:
            KeyTable.load(ns.api_keys)  # so is a key file that does not parse
    except (OSError, ValueError) as exc:
        print(f"strata up: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    up = Up(ns, stop)
    code = 0
    try:
        base = up.start()
        if not stop.is_set():
            banner(base, _model_name(base), ns, up)
        while not stop.wait(0.5):
            problem = up.check()
            if problem:
                print(f"strata up: {problem}; stopping", file=sys.stderr, flush=True)
                code = 1
                break
    except (RuntimeError, ValueError, OSError) as exc:
        if not stop.is_set():  # a part failed; a Ctrl-C during start-up is not an error
            print(f"strata up: {exc}", file=sys.stderr, flush=True)
            code = 1
    finally:
        print("strata up: stopping router, workers and store ...", flush=True)
        left = up.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if left:
        print(f"strata up: cleaned up after the children: {', '.join(left)}", flush=True)
    print("strata up: stopped; no process or shared-memory segment left", flush=True)
    return code
