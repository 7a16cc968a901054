"""`strata prefill|decode|colocated`: run one engine worker until SIGTERM or SIGINT.

strata prefill   --model PATH --store ADDR [--port N] ...
strata decode    --model PATH --store ADDR [--port N] ...
strata colocated --model PATH [--store ADDR] [--step-token-budget N] ...

The first line on stdout names the bound address ("strata decode serving on HOST:PORT"; --port 0
picks a free port). On SIGTERM the worker stops accepting, finishes the work in flight (for at
most --drain-timeout seconds), finishes publishing its pages and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from engine.worker_config import DEFAULT_PORTS, ROLES, WorkerConfig, load_worker_config


def build_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"strata {role}", description=f"Run a {role} worker.")
    p.add_argument("--model", help="checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument(
        "--store",
        help="store: a daemon HOST:PORT, several (comma-separated), or etcd://HOST:2379/CLUSTER",
    )
    p.add_argument("--etcd", help="etcd endpoints to register this worker in (for the router)")
    p.add_argument("--cluster", help="cluster name of the etcd registration (default)")
    p.add_argument("--advertise", help="address the router reaches this worker at")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, help=f"gRPC port (default {DEFAULT_PORTS[role]}; 0 = any free port)"
    )
    p.add_argument("--device", help="torch device (default cpu)")
    p.add_argument("--page-tokens", type=int, help="tokens per KV page (default 16)")
    p.add_argument("--chunk-tokens", type=int, help="most tokens per forward pass (default 256)")
    p.add_argument("--max-context", type=int, help="context limit (default: the model's)")
    if role != "prefill":
        p.add_argument("--max-batch", type=int, help="requests decoded together (default 32)")
        p.add_argument("--kv-capacity-tokens", type=int, help="KV pool size in tokens")
        p.add_argument("--max-waiting", type=int, help="queued requests before refusing more")
    if role == "colocated":
        p.add_argument(
            "--step-token-budget", type=int, help="tokens per step, decodes + prompt chunks (512)"
        )
    if role == "prefill":
        p.add_argument(
            "--publish-timeout",
            type=float,
            dest="publish_timeout_s",
            help="seconds an answer waits for its pages to be stored (default 5)",
        )
    p.add_argument(
        "--store-timeout",
        type=float,
        dest="store_timeout_s",
        help="deadline of each store call in seconds (default 5)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="on SIGTERM, seconds in-flight work may take (default 30)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(role: str, argv: Sequence[str] | None = None) -> int:
    """Run the worker of `role` with `argv` (the arguments after the role); the exit code."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    ns = build_parser(role).parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in vars(ns).items() if k != "log_level"}
    try:
        config = load_worker_config(role, env=os.environ, overrides=overrides)
    except ValueError as exc:
        print(f"strata {role}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # before anything slow: a SIGTERM during start-up stops the worker once it is up
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(role, config, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(role: str, config: WorkerConfig, stop: threading.Event) -> int:
    try:
        from engine.server import EngineServer  # torch loads here, after the flags are checked

        server = EngineServer(config)
        address = server.start()
    except (ValueError, OSError) as exc:
        print(f"strata {role}: {exc}", file=sys.stderr)
        return 2
    rt = server.runtime
    print(f"strata {role} serving on {address}", flush=True)
    print(f"  model: {rt.checkpoint.model_id} at {config.model} on {rt.device}", flush=True)
    print(f"  store: {config.store or 'none'}", flush=True)
    print(f"  pages: {rt.page_tokens} tokens; context {rt.max_context} tokens", flush=True)
    print("  stop with Ctrl-C or SIGTERM", flush=True)
    while not stop.wait(1.0):
        pass
    print(f"strata {role} stopping: {server.in_flight} request(s) in flight", flush=True)
    drained = server.stop()
    print(f"strata {role} stopped{'' if drained else ' (drain timed out)'}", flush=True)
    return 0
