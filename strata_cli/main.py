"""`strata <command>`: dispatches to the component that implements each subcommand.

Imports are lazy so that `strata serve` never loads torch, and each component stays the only
owner of its own arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: strata <command> [args]

commands:
  serve              run the store daemon (DRAM + SSD tiers under ~/.cache/strata by default)
  bench store        store put/get as an engine pays and bare, vs memcpy [--against mooncake]
  bench cluster      cluster put/get throughput and lookup latency, 1 node vs N nodes
  bench engine       engine TTFT with no cache vs a full DRAM / SSD hit; decode tokens/s
  bench keys         page-key hashing cost: BLAKE2b-128 (key schema 2) vs xxh3, per page
  bench auth         store calls with principals' tokens vs an open daemon (lookup, get)
  bench tls          remote store get/put and first call over TLS vs plaintext (TCP, gRPC)
  bench isolation    critical gets under a background flood, DRAM gets with a slow disk, vs idle
  bench router       router added latency vs direct, decisions/s, TTFT by policy, prediction error
  bench decisions    placement policies' decisions/s on 16 synthetic workers, wall and per CPU s
  drill              router operator drills: prefill pool down, half the decode pool down, 1% loss
  chaos              store load while faults are injected; checks no page is served wrong
  fuzz [--target T]  longer fuzzing (T: page codec, or a live daemon's rpc|lane|tcp): atheris
                     (--seconds N); `fuzz props --target page|rpc`: hypothesis (--examples N)
  model init PATH    write a random-weight checkpoint (--preset tiny|small)
  prefill            run a prefill worker (--model PATH --store ADDR [--port N])
  decode             run a decode worker (--model PATH --store ADDR [--port N])
  colocated          run a co-located prefill+decode worker (--model PATH [--store ADDR])
  up                 store + router + prefill and decode workers on the small preset, one command
  router             the OpenAI-compatible router alone (--workers ADDR,... or --etcd HOST)
  profile            measure a model on this machine, fit the router's time model (--model PATH [--store ADDR] [--quick])
  loadtest WORKLOAD  open-loop load test of an OpenAI API (--url URL | --up) [--rates a,b] [--out DIR]
  simulate WORKLOAD  the cluster simulator (--cluster CLUSTER.toml --out DIR [--policies a,b])
  plan WORKLOAD      best prefill:decode split for N GPUs, by simulation (--gpus N | --admission RATE)
  report A.json ...  reports side by side [--out DIR]

`strata <command> --help` shows each command's options.
"""


def _serve(argv: Sequence[str]) -> int:
    from kvstore.cli import main

    return main(argv)


def _bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: strata bench store|cluster|engine|keys|auth|tls|isolation|router|decisions [--help]")
        return 0 if argv else 2
    what, rest = argv[0], argv[1:]
    if what == "auth":
        from loadtests.bench_auth import main as auth_main

        return auth_main(rest)
    if what == "tls":
        from loadtests.bench_tls import main as tls_main

        return tls_main(rest)
    if what == "store":
        from loadtests.bench_store import main

        return main(rest)
    if what == "cluster":
        from loadtests.bench_cluster import main as cluster_main

        return cluster_main(rest)
    if what == "engine":
        from loadtests.bench_engine import main as engine_main

        return engine_main(rest)
    if what == "keys":
        from loadtests.bench_keys import main as keys_main

        return keys_main(rest)
    if what == "isolation":
        from loadtests.bench_isolation import main as isolation_main

        return isolation_main(rest)
    if what == "router":
        from loadtests.bench_router import main as router_main

        return router_main(rest)
    if what == "decisions":
        from loadtests.router_decisions import main as decisions_main

        return decisions_main(rest)
    print(
        f"strata bench: unknown benchmark {what!r} (known: store, cluster, engine, keys, auth, tls, isolation, router, decisions)", file=sys.stderr
    )
    return 2


def _chaos(argv: Sequence[str]) -> int:
    from loadtests.chaos.cli import main

    return main(list(argv))


def _model(argv: Sequence[str]) -> int:
    from engine.cli_model import main

    return main(argv)


def _up(argv: Sequence[str]) -> int:
    from engine.router.up import main

    return main(argv)


def _profile(argv: Sequence[str]) -> int:
    from engine.profile import main

    return main(argv)


def _router(argv: Sequence[str]) -> int:
    from engine.router.cli import main

    return main(argv)


def _worker(role: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        from engine.cli_engine import main

        return main(role, argv)

    return run


def _loadtests(module: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        import importlib

        return int(importlib.import_module(module).main(argv))

    return run


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "serve": _serve,
    "loadtest": _loadtests("loadtests.live.runner"),
    "simulate": _loadtests("loadtests.sim.cli"),
    "plan": _loadtests("loadtests.plan"),
    "report": _loadtests("loadtests.report.compare"),
    "bench": _bench,
    "chaos": _chaos,
    "fuzz": _loadtests("strata_cli.fuzz"),
    "drill": _loadtests("loadtests.router_drills"),
    "model": _model,
    "prefill": _worker("prefill"),
    "decode": _worker("decode"),
    "colocated": _worker("colocated"),
    "up": _up,
    "router": _router,
    "profile": _profile,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"strata: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
