"""`strata router`: run the OpenAI-compatible router alone, in front of running workers.

strata router --workers HOST:PORT,HOST:PORT --store ADDR --profile PROFILE.json [--port N]
strata router --config router.toml [--port N] ...
strata router --etcd HOST:2379 [--cluster NAME] --profile PROFILE.json   (workers register there)
strata router ... --api-keys KEYS.toml        (enforce API keys: engine.router.tenancy)

The first line on stdout names the base URL ("strata router serving on http://HOST:PORT/v1";
--port 0 picks a free port). The HTTP server is FastAPI on uvicorn (as vLLM and SGLang serve
theirs), on uvloop with the httptools parser when they are installed (the router extra installs
them), the two completion routes answered by `engine.router.completions.CompletionsFront` before
FastAPI, each response's head written with its first body bytes (`engine.router.http_protocol`).
It listens on loopback unless --host says otherwise. Without --api-keys it is open (any caller,
one namespace) and says so; it refuses to listen open on a non-loopback address unless
--allow-open is given (docs/security.md).
SIGTERM or Ctrl-C stops it (streams in flight are cancelled on their workers).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Sequence

from engine.router.config import RouterConfig, load_router_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata router", description="Run the router alone.")
    p.add_argument("--config", help="TOML file ([router] and [admission] tables)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000; 0 = any free port)")
    p.add_argument("--workers", help="worker addresses, comma-separated HOST:PORT")
    p.add_argument("--etcd", help="etcd endpoints where workers register (host:2379,...)")
    p.add_argument("--cluster", help="the cluster name workers register under (default)")
    p.add_argument("--store", help="the workers' store: HOST:PORT, a list, or etcd://HOST/NAME")
    p.add_argument("--profile", help="time model JSON (strata profile)")
    p.add_argument("--policy", help="strata | round_robin | least_load | longest_prefix")
    p.add_argument("--api-keys", dest="api_keys", help="API key file (TOML): enforce its keys")
    p.add_argument(
        "--allow-open",
        dest="allow_open",
        action="store_const",
        const=True,
        help="listen on a non-loopback address without API keys (anyone who reaches it may use it)",
    )
    p.add_argument("--drop-after", type=float, dest="drop_after_s", help="silent worker (s)")
    p.add_argument("--log-level", default="INFO")
    return p


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; OSError with a clear message when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP; without it a response written in two parts waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {port} on {host} is already in use (another router or program); "
                "choose another with --port"
            ) from None
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


# seconds an idle kept-alive client connection stays open (uvicorn's default is 5)
KEEP_ALIVE_S = 15


def serve(
    config: RouterConfig,
    *,
    sock: socket.socket | None = None,
    banner: bool = True,
    log_level: str = "info",
) -> int:
    """Run the router until SIGTERM/SIGINT; the exit code. Raises OSError for a taken port."""
    import uvicorn

    from engine.router.app import create_asgi
    from engine.router.core.timemodel import TimeModel
    from engine.router.http_protocol import protocol_class
    from engine.router.service import RouterService

    if not config.profile:
        raise ValueError("a time model is required: --profile PATH (written by strata profile)")
    if not config.api_keys and not config.allow_open and not is_loopback(config.host):
        raise ValueError(
            f"refusing to listen on {config.host} without API keys: anyone who reaches it could "
            "use every worker and read the shared cache's timing. Give --api-keys FILE, or "
            "--allow-open to run open anyway"
        )
    time_model = TimeModel.load(config.profile)
    listener = sock or bind(config.host, config.port)
    host, port = listener.getsockname()[:2]
    base = f"http://{host}:{port}/v1"

    def ready() -> None:
        if banner:
            print(f"strata router serving on {base}", flush=True)
            print(f"  workers: {', '.join(config.workers) or '-'}", flush=True)
            print(f"  etcd: {config.etcd or '-'}  store: {config.store or 'none'}", flush=True)
            print(f"  policy: {config.policy}; profile {config.profile}", flush=True)
            if config.api_keys:
                access = f"API keys enforced from {config.api_keys}"
            elif is_loopback(host):
                access = "open access (no API keys), loopback only"
            else:
                access = f"OPEN ACCESS on {host} (no API keys; --allow-open)"
            print(f"  {access}; stop with Ctrl-C or SIGTERM", flush=True)

    service = RouterService(config, time_model)
    app = create_asgi(service, on_ready=ready)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=log_level.lower(),
            access_log=False,
            server_header=False,  # no `server: uvicorn` line for every client to parse
            # httptools, each response's head and first body bytes in one write
            http=protocol_class() or "auto",
            # longer than an HTTP client's idle pool expiry (httpx, so the OpenAI SDK: 5 s), so
            # the server does not close a kept-alive connection just as the client reuses it
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=5,
            lifespan="on",
        )
    )
    # uvicorn re-raises the stop signal after its graceful shutdown, into the handlers it found:
    # these, so a SIGTERM ends the process with exit code 0 once everything is closed.
    previous = {
        sig: signal.signal(sig, lambda signum, frame: None)
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        # uvicorn's event loop: uvloop when installed (the router extra installs it), as
        # `uvicorn.run` would choose; the HTTP parser is httptools then (http="auto").
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            runner.run(server.serve(sockets=[listener]))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if banner:
        print("strata router stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in vars(ns).items() if k not in ("config", "log_level")}
    try:
        config = load_router_config(ns.config, overrides)
        return serve(config, log_level="warning")
    except (ValueError, OSError) as exc:
        print(f"strata router: {exc}", file=sys.stderr)
        return 2
