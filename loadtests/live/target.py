"""What a load test runs against: a URL, or a fresh `strata up` started (and stopped) here.

`fresh_up(args, log)` starts `strata up` as a child process (its own arguments, default the tiny
preset on a free port), waits for its "Strata is up at URL model: NAME" banner (bounded), yields
an `UpTarget` (URL, model, the store's metrics URL, the time model file `strata up` used), and
on exit sends SIGTERM and waits for its ordered stop (then SIGKILL as a last resort). `model_of(url)`
asks /v1/models for the first model when none was given. `store_counters(url)` reads a store
daemon's bytes moved and evictions from its Prometheus metrics (the runner takes the difference
over each run).
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

UP_BANNER = re.compile(r"Strata is up at (http://\S+/v1)\s+model: (\S+)")
STORE_METRICS = re.compile(r"store metrics (http://\S+)")
UP_PROFILE = re.compile(r"(?:time model: |saved to )(\S+\.json)")
DEFAULT_UP_ARGS = ("--preset", "tiny", "--port", "0", "--max-context", "1024", "--ssd", "0")


class TargetError(RuntimeError):
    """The target could not be reached or started."""


@dataclass(frozen=True, slots=True)
class UpTarget:
    base_url: str  # the OpenAI API, e.g. http://127.0.0.1:8000/v1
    model: str
    store_metrics: str = ""  # the store daemon's Prometheus URL ("" = unknown)
    profile: str = ""  # the time model file `strata up` measured or reused ("" = unknown)


def model_of(base_url: str, timeout_s: float = 10.0) -> str:
    try:
        reply = httpx.get(f"{base_url}/models", timeout=timeout_s)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise TargetError(f"{base_url}/models did not name a model: {exc}") from None


@contextlib.contextmanager
def fresh_up(
    up_args: Sequence[str], data_dir: Path, *, start_timeout_s: float = 900.0
) -> Iterator[UpTarget]:
    """Yields the running system's `UpTarget`."""
    args = [sys.executable, "-m", "strata_cli.main", "up", *up_args, "--data-dir", str(data_dir)]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(f"  [up] {line.rstrip()}", flush=True)
            if "stop with Ctrl-C" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not ready.wait(start_timeout_s) or proc.poll() is not None:
            raise TargetError("strata up did not come up:\n" + "\n".join(lines[-30:]))
        match = UP_BANNER.search("\n".join(lines))
        if match is None:
            raise TargetError("strata up printed no URL:\n" + "\n".join(lines[-30:]))
        text = "\n".join(lines)
        metrics = STORE_METRICS.search(text)
        profile = UP_PROFILE.search(text)
        yield UpTarget(
            match.group(1),
            match.group(2),
            metrics.group(1) if metrics else "",
            profile.group(1) if profile else "",
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        deadline = time.monotonic() + 5
        while reader.is_alive() and time.monotonic() < deadline:
            reader.join(0.1)


def store_counters(metrics_url: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """(payload bytes moved, pages evicted) so far, from a store daemon's Prometheus text:
    the sums of `strata_bytes_total` (every path, direction and class) and
    `strata_evictions_total` (every tier). TargetError when it cannot be read."""
    try:
        resp = httpx.get(metrics_url, timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise TargetError(f"cannot read the store's metrics at {metrics_url}: {exc}") from exc
    moved = evicted = 0.0
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in ("strata_bytes_total", "strata_evictions_total"):
            try:
                value = float(line.rsplit(" ", 1)[-1])
            except ValueError as exc:
                raise TargetError(f"unreadable metrics line {line!r}") from exc
            if name == "strata_bytes_total":
                moved += value
            else:
                evicted += value
    return int(moved), int(evicted)
