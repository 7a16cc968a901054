"""`strata serve`: run the store daemon until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kvstore.config import load_config
from kvstore.errors import StrataError
from kvstore.server import Daemon


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="strata serve", description=__doc__)
    p.add_argument("--config", help="TOML config file (default: $STRATA_CONFIG)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 7700; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 7701; -1 = off)")
    p.add_argument("--data-dir", help="state folder (default: ~/.cache/strata)")
    p.add_argument("--dram", metavar="SIZE", help="DRAM tier budget, e.g. 4GiB")
    p.add_argument("--ssd", metavar="SIZE", help="SSD tier budget, e.g. 64GiB; 0 = no SSD tier")
    p.add_argument("--ssd-path", help="SSD tier folder (default: <data-dir>/ssd)")
    p.add_argument("--gpu", metavar="SIZE", help="enable the GPU tier with this budget")
    p.add_argument("--gpu-device", help="torch device of the GPU tier (default cuda)")
    p.add_argument("--write-through", action="store_true", help="copy every put to SSD too")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any config value, e.g. --set ssd.admission=second-hit (repeatable)",
    )
    p.add_argument(
        "--check-integrity-on-exit",
        action="store_true",
        help="on SIGTERM/SIGINT, run the store's check_integrity() before closing it and print "
        "'integrity: ok' or 'integrity: FAILED: ...' (exit status 3) (chaos runs, tests)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def overrides_from(ns: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise StrataError(f"--set needs SECTION.KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    flags = {
        "server.host": ns.host,
        "server.port": ns.port,
        "server.metrics_port": ns.metrics_port,
        "data_dir": ns.data_dir,
        "dram.capacity_bytes": ns.dram,
        "ssd.path": ns.ssd_path,
        "gpu.device": ns.gpu_device,
    }
    out.update({k: str(v) for k, v in flags.items() if v is not None})
    if ns.ssd is not None:
        if ns.ssd.strip() in ("0", "off"):
            out["ssd.enabled"] = "false"
        else:
            out["ssd.capacity_bytes"] = ns.ssd
    if ns.gpu is not None:
        out["gpu.enabled"] = "true"
        out["gpu.capacity_bytes"] = ns.gpu
    if ns.write_through:
        out["ssd.write_mode"] = "write-through"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(ns.config, overrides=overrides_from(ns))
        daemon = Daemon(config)
        info = daemon.start()
    except (StrataError, OSError) as exc:
        print(f"strata serve: {exc}", file=sys.stderr)
        return 2
    print(f"strata store serving on {info.address}", flush=True)
    print(f"  same-host control: {info.local_address or 'off'}", flush=True)
    print(f"  shared memory: /dev/shm/{info.segment_name}", flush=True)
    tcp, ucx = info.tcp_address or "off", info.ucx_address or "off"
    print(f"  remote bulk data: tcp {tcp}, ucx {ucx} (else gRPC streams)", flush=True)
    print(f"  tiers: {daemon.describe_tiers()}", flush=True)
    print(f"  metrics: {info.metrics_url or 'off'}", flush=True)
    print("  stop with Ctrl-C or SIGTERM", flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(1.0):
        pass
    print("strata store stopping", flush=True)
    code = 0
    if ns.check_integrity_on_exit and daemon.store is not None:
        try:
            daemon.store.check_integrity()
            daemon.store.tiers.dram.check_integrity()
            print("integrity: ok", flush=True)
        except (RuntimeError, AssertionError) as exc:
            print(f"integrity: FAILED: {exc}", flush=True)
            code = 3
    daemon.stop()
    return code
