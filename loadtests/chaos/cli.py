"""`strata chaos`: the store under a client load while faults are injected, in turn.

Each fault gets a phase of its own (fresh daemons on loopback, a folder under `--dir`, its own
scope): `--clients` worker processes drive a mixed put/get/lookup load at `--rate` calls per
second each through the SDK, the fault is on for the middle half of the phase, and then every
acknowledged page is read back and the daemon is checked for leaks (see
`loadtests.chaos.phase`). `--duration` is the load time of all phases together; start-up and
the checks add a few seconds a phase. Prints one summary table; `--json PATH` writes it with
the fields `acknowledged`, `intact`, `missing`, `wrong`, `leaks` per fault and in total. Exits 1
when any page was served wrong, anything leaked, or a phase could not finish; a fault this
machine cannot inject (no root for tmpfs, neither tc netem nor nftables) is reported as
skipped, with why.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loadtests.chaos.faults import FAULTS
from loadtests.chaos.phase import Load, run_phase
from loadtests.chaos.report import FaultResult, failed, table, write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=240.0,
                   help="seconds of load over all faults (default 240)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated, in order (default: all of " + ",".join(FAULTS) + ")")
    p.add_argument("--rate", type=float, default=40.0, help="calls per second per client")
    p.add_argument("--clients", type=int, default=3, help="client processes")
    p.add_argument("--dir", type=Path, help="state folder (default: a temporary one, removed)")
    p.add_argument("--json", type=Path, help="write the summary here")
    ns = p.parse_args(argv)
    names = [n.strip() for n in ns.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        p.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    if ns.duration <= 0 or ns.rate <= 0 or ns.clients < 2:
        p.error("need --duration > 0, --rate > 0 and --clients >= 2")
    folder = ns.dir or Path(tempfile.mkdtemp(prefix="strata-chaos-"))
    load = Load(clients=ns.clients, rate=ns.rate)
    per_phase = ns.duration / len(names)
    print(f"strata chaos: {len(names)} faults, {per_phase:.1f} s of load each, "
          f"{ns.clients} clients at {ns.rate:g} calls/s, state in {folder}", flush=True)
    results: list[FaultResult] = []
    try:
        for name in names:
            print(f"  {name} ...", flush=True)
            began = time.monotonic()
            r = run_phase(FAULTS[name](), folder / name, load, per_phase)
            results.append(r)
            status = (r.skipped and f"skipped: {r.skipped}") or (r.error and f"ERROR: {r.error}")
            summary = status or f"acked {r.acknowledged}, wrong {r.wrong}, leaks {r.leaks}"
            print(f"    {summary} ({time.monotonic() - began:.1f} s)", flush=True)
    finally:
        if ns.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print()
    print(table(results))
    if ns.json:
        write_json(ns.json, results, {
            "duration_s": ns.duration, "faults": names, "rate": ns.rate, "clients": ns.clients,
        })
        print(f"\nwrote {ns.json}")
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
