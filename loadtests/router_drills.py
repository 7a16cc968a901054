"""Operator drills for the router (`strata drill`, or `strata bench router --drills`).

The drills run, in order, on one cluster of real processes (`loadtests.router_cluster`: a
store, 2 prefill and 2 decode workers, tiny preset by default, and a router; the store and the
workers inside a network namespace when packet loss can be injected here) while a prober sends
completions through the router without pause; each reports what clients saw and how long
recovery took. The processes a drill kills are its own children, by PID.

1. `prefill_down`: every prefill worker is SIGKILLed. Clients must get a fast 503 with
   Retry-After (no hang, no 500); one worker is restarted on its port and the router must serve
   again by itself. Reported: time from the kill to the first 503, 503 latency (p50, max), the
   Retry-After values, and time to recover (restarted worker ready -> first 200).
2. `decode_half`: half the decode workers are SIGKILLed while streams run on them. Every request
   must still be served (a broken stream is resumed on a survivor). Reported: requests and
   failures during the drill, decode resumes, time until the router's /health stops counting
   the dead workers, and, once they are restarted, time until the router places on them again.
3. `packet_loss`: the store and the workers run in a network namespace the drill creates; 1% of
   the packets between the router and them are dropped at random, each way (`tc netem` where the
   kernel has it, else an nftables `numgen random` drop rule; the report says which). Requests
   must keep succeeding; reported: success rate and p50/p99 latency without and with loss, and
   time to recover after the loss stops (until 10 requests in a row succeed within the
   baseline p99).

Results are frozen dataclasses; `main` prints a table and writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from loadtests.router_cluster import ClusterSpec, RouterCluster, loss_support

DRILLS = ("prefill_down", "decode_half", "packet_loss")


@dataclass(frozen=True, slots=True)
class Probe:
    """One request the prober sent: when (monotonic s), how long, and what came back."""

    sent_s: float
    latency_s: float
    status: int  # 0 = transport error
    retry_after: str = ""
    decode: str = ""
    tokens: int = 0
    error: str = ""


class Prober:
    """`concurrency` threads sending completions through the router until `stop()` (or
    `max_requests`). Each request is streamed (so a broken decode is visible as a broken stream)
    with `max_tokens` greedy tokens; the log is `probes`, in completion order."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        concurrency: int = 2,
        max_tokens: int = 8,
        prompt_tokens: int = 48,
        vocab: int = 512,
        timeout_s: float = 30.0,
        max_requests: int = 100_000,
    ) -> None:
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.max_requests = max_requests
        self.probes: list[Probe] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._count = 0

    def start(self) -> Prober:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def stop(self) -> list[Probe]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        return list(self.probes)

    def since(self, t: float) -> list[Probe]:
        with self._lock:
            return [p for p in self.probes if p.sent_s >= t]

    def _next(self) -> int | None:
        with self._lock:
            if self._count >= self.max_requests:
                return None
            self._count += 1
            return self._count

    def _loop(self, lane: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                n = self._next()
                if n is None:
                    return
                ids = [3 + (n * 131 + i * 7) % (self.vocab - 3) for i in range(self.prompt_tokens)]
                body = {"model": self.model, "prompt": ids, "max_tokens": self.max_tokens,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                probe = self._send(client, body)
                with self._lock:
                    self.probes.append(probe)
                if probe.status != 200:
                    # a client honouring Retry-After would wait; the drill probes sooner (bounded)
                    self._stop.wait(0.05)

    def _send(self, client: httpx.Client, body: dict[str, object]) -> Probe:
        sent = time.monotonic()
        try:
            with client.stream("POST", self.url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Probe(sent, time.monotonic() - sent, r.status_code,
                                 r.headers.get("retry-after", ""), error=r.text[:160])  # fmt: skip
                tokens = 0
                done = False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {") and '"error"' not in line:
                        tokens += 1
                    elif '"error"' in line:
                        return Probe(sent, time.monotonic() - sent, 599, error=line[:160])
                if not done:
                    return Probe(sent, time.monotonic() - sent, 598, error="stream ended early")
                return Probe(sent, time.monotonic() - sent, 200,
                             decode=r.headers.get("x-strata-decode", ""), tokens=tokens)  # fmt: skip
        except httpx.HTTPError as exc:
            return Probe(sent, time.monotonic() - sent, 0, error=f"{type(exc).__name__}: {exc}")


def wait_until(
    pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.02
) -> float | None:
    """Seconds until `pred()` held (polled every `interval_s`), None if not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(interval_s)
    return None


def _ms(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return 1e3 * ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# ---- 1. every prefill worker down ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillDown:
    prefill_workers: int
    requests_while_down: int
    status_counts: dict[str, int]
    first_503_after_kill_s: float | None
    latency_503_p50_ms: float
    latency_503_max_ms: float
    retry_after_values: tuple[str, ...]
    restart_ready_s: float  # restart command -> the worker's banner (model load)
    recover_s: float | None  # worker ready -> first 200 through the router


def drill_prefill_down(
    cluster: RouterCluster,
    model: str,
    *,
    down_s: float = 3.0,
    restart_all: bool = True,
    timeout_s: float = 120.0,
) -> PrefillDown:
    prober = Prober(cluster.base_url, model).start()
    try:
        if wait_until(lambda: any(p.status == 200 for p in prober.probes), timeout_s) is None:
            raise RuntimeError("no request succeeded before the drill")
        prefills = cluster.by_role("prefill")
        killed_at = time.monotonic()
        for w in prefills:
            cluster.kill(w)
        all_dead_at = time.monotonic()  # until the last kill, a live prefill may still serve
        first_503 = wait_until(
            lambda: any(p.status == 503 for p in prober.since(killed_at)), timeout_s
        )
        time.sleep(down_s)  # stay down a while: every answer meanwhile must be a fast 503
        restart_at = time.monotonic()
        cluster.restart(prefills[0])
        ready_at = time.monotonic()
        recover = wait_until(
            lambda: any(p.status == 200 for p in prober.since(ready_at)), timeout_s
        )
        down = [p for p in prober.since(all_dead_at) if p.sent_s < restart_at]
    finally:
        prober.stop()
    if restart_all:
        for w in prefills[1:]:
            cluster.restart(w)
    counts: dict[str, int] = {}
    for p in down:
        counts[str(p.status)] = counts.get(str(p.status), 0) + 1
    lat = [p.latency_s for p in down if p.status == 503]
    return PrefillDown(
        prefill_workers=len(prefills),
        requests_while_down=len(down),
        status_counts=counts,
        first_503_after_kill_s=first_503,
        latency_503_p50_ms=_ms(lat, 0.5),
        latency_503_max_ms=_ms(lat, 1.0),
        retry_after_values=tuple(sorted({p.retry_after for p in down if p.status == 503})),
        restart_ready_s=ready_at - restart_at,
        recover_s=recover,
    )


# ---- 2. half the decode workers down --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeHalf:
    decode_workers: int
    killed: int
    requests: int
    failed: int
    failures: tuple[str, ...]
    decode_resumes: float
    dropped_from_health_s: float | None  # kill -> /health counts only the survivors
    latency_p50_ms: float
    latency_max_ms: float
    back_in_rotation_s: float | None  # restarted workers ready -> a request decoded on one


def _decode_resumes(cluster: RouterCluster) -> float:
    total = 0.0
    for line in cluster.metrics_text().splitlines():
        if line.startswith("strata_router_retries_total{") and 'stage="decode"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def drill_decode_half(
    cluster: RouterCluster, model: str, *, run_s: float = 4.0, timeout_s: float = 120.0
) -> DecodeHalf:
    decodes = cluster.by_role("decode")
    victims = decodes[: len(decodes) // 2]
    if not victims:
        raise ValueError("the decode_half drill needs at least 2 decode workers")
    before = _decode_resumes(cluster)
    prober = Prober(cluster.base_url, model, concurrency=3, max_tokens=24).start()
    try:
        if wait_until(lambda: sum(p.status == 200 for p in prober.probes) >= 3, timeout_s) is None:
            raise RuntimeError("no request succeeded before the drill")
        killed_at = time.monotonic()
        for w in victims:
            cluster.kill(w)
        survivors = len(decodes) - len(victims)
        dropped = wait_until(lambda: cluster.health().get("decode") == survivors, timeout_s)
        time.sleep(run_s)
        for w in victims:
            cluster.restart(w)
        ready_at = time.monotonic()
        addresses = {w.address for w in victims}
        back = wait_until(
            lambda: any(p.decode in addresses for p in prober.since(ready_at)), timeout_s
        )
        during = [p for p in prober.since(killed_at) if p.sent_s < ready_at]
    finally:
        prober.stop()
    # A request in flight at the kill was sent before it: count those too.
    during += [p for p in prober.probes if p.sent_s < killed_at <= p.sent_s + p.latency_s]
    bad = [p for p in during if p.status != 200]
    lat = [p.latency_s for p in during if p.status == 200]
    return DecodeHalf(
        decode_workers=len(decodes),
        killed=len(victims),
        requests=len(during),
        failed=len(bad),
        failures=tuple(f"{p.status} {p.error}" for p in bad[:5]),
        decode_resumes=_decode_resumes(cluster) - before,
        dropped_from_health_s=dropped,
        latency_p50_ms=_ms(lat, 0.5),
        latency_max_ms=_ms(lat, 1.0),
        back_in_rotation_s=back,
    )


# ---- 3. packet loss between the router and its workers -------------------------------------


@dataclass(frozen=True, slots=True)
class PacketLoss:
    mechanism: str  # "netem" or "nftables"
    why_not_netem: str
    loss_percent: float
    baseline_requests: int
    baseline_ok: int
    baseline_p50_ms: float
    baseline_p99_ms: float
    lossy_requests: int
    lossy_ok: int
    lossy_p50_ms: float
    lossy_p99_ms: float
    lossy_failures: tuple[str, ...]
    packets_dropped: int
    workers_dropped_during_loss: bool
    recover_s: float | None  # loss removed -> 10 requests in a row ok within the baseline p99


def drill_packet_loss(
    cluster: RouterCluster,
    model: str,
    *,
    loss_percent: float = 1.0,
    phase_s: float = 6.0,
    timeout_s: float = 120.0,
) -> PacketLoss:
    ns = cluster.netns
    if ns is None:
        raise ValueError("the packet_loss drill needs a cluster started with netns=True")
    _, why = loss_support()
    prober = Prober(cluster.base_url, model, concurrency=2).start()
    try:
        if wait_until(lambda: any(p.status == 200 for p in prober.probes), timeout_s) is None:
            raise RuntimeError("no request succeeded before the drill")
        t_base = time.monotonic()
        time.sleep(phase_s)
        t_loss = time.monotonic()
        mechanism = ns.impair_loss(loss_percent)
        healthy = [True]

        def watch() -> None:
            while time.monotonic() - t_loss < phase_s:
                h = cluster.health()
                if h and h.get("status") != "ok":
                    healthy[0] = False
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(phase_s)
        watcher.join()
        dropped = ns.dropped_packets()
        ns.clear_impairment()
        t_clear = time.monotonic()
        base = [p for p in prober.since(t_base) if p.sent_s < t_loss]
        base_p99 = _ms([p.latency_s for p in base if p.status == 200], 0.99) / 1e3
        recover = wait_until(lambda: _settled(prober.since(t_clear), base_p99), timeout_s)
        lossy = [p for p in prober.since(t_loss) if p.sent_s < t_clear]
    finally:
        prober.stop()
    ok_base = [p.latency_s for p in base if p.status == 200]
    ok_lossy = [p.latency_s for p in lossy if p.status == 200]
    return PacketLoss(
        mechanism=mechanism,
        why_not_netem=why,
        loss_percent=loss_percent,
        baseline_requests=len(base),
        baseline_ok=len(ok_base),
        baseline_p50_ms=_ms(ok_base, 0.5),
        baseline_p99_ms=_ms(ok_base, 0.99),
        lossy_requests=len(lossy),
        lossy_ok=len(ok_lossy),
        lossy_p50_ms=_ms(ok_lossy, 0.5),
        lossy_p99_ms=_ms(ok_lossy, 0.99),
        lossy_failures=tuple(f"{p.status} {p.error}" for p in lossy if p.status != 200)[:5],
        packets_dropped=dropped,
        workers_dropped_during_loss=not healthy[0],
        recover_s=recover,
    )


def _settled(probes: Sequence[Probe], limit_s: float, run: int = 10) -> bool:
    """Whether `run` consecutive requests (in send order) succeeded within `limit_s`."""
    streak = 0
    for p in sorted(probes, key=lambda p: p.sent_s):
        streak = streak + 1 if p.status == 200 and p.latency_s <= limit_s else 0
        if streak >= run:
            return True
    return False


# ---- the command ------------------------------------------------------------------------


def model_of(cluster: RouterCluster) -> str:
    models = cluster.health().get("models")
    if not isinstance(models, list) or not models:
        raise RuntimeError(f"the router serves no model: {cluster.health()}")
    return str(models[0])


def run(
    drills: Sequence[str],
    workdir: Path,
    *,
    preset: str = "tiny",
    loss_percent: float = 1.0,
    quick: bool = False,
) -> dict[str, object]:
    """Run `drills` in order on one cluster (2 prefill + 2 decode; in a network namespace when
    packet loss can be injected here, else on plain loopback with the loss drill skipped and
    its reason reported). `quick` shortens every phase (for tests)."""
    out: dict[str, object] = {}
    mechanism, why = loss_support() if "packet_loss" in drills else ("", "")
    spec = ClusterSpec(preset=preset, prefill=2, decode=2, netns=bool(mechanism))
    pace = 0.5 if quick else 1.0
    with RouterCluster(spec, workdir / "cluster") as cluster:
        model = model_of(cluster)
        for drill in drills:
            say = {"prefill_down": "every prefill worker killed",
                   "decode_half": "half the decode workers killed",
                   "packet_loss": f"{loss_percent}% packet loss ({mechanism or 'unavailable'})"}  # fmt: skip
            print(f"[drill] {say[drill]}", file=sys.stderr, flush=True)
            if drill == "prefill_down":
                result: object = drill_prefill_down(
                    cluster, model, down_s=3.0 * pace, restart_all=not quick
                )
            elif drill == "decode_half":
                result = drill_decode_half(cluster, model, run_s=4.0 * pace)
            elif not mechanism:
                out[drill] = {"skipped": why}
                continue
            else:
                result = drill_packet_loss(
                    cluster, model, loss_percent=loss_percent, phase_s=6.0 * pace
                )
            out[drill] = asdict(result)  # type: ignore[call-overload]
    return out


def _s(v: object) -> str:
    return f"{v:.2f} s" if isinstance(v, float) else "never"


def print_report(result: dict[str, object]) -> None:
    pd = result.get("prefill_down")
    if isinstance(pd, dict):
        print(f"\nevery prefill worker killed ({pd['prefill_workers']}): "
              f"{pd['requests_while_down']} requests while down, statuses {pd['status_counts']}")  # fmt: skip
        print(f"  first 503 {_s(pd['first_503_after_kill_s'])} after the kill; 503 latency p50 "
              f"{pd['latency_503_p50_ms']:.1f} ms, max {pd['latency_503_max_ms']:.1f} ms; "
              f"Retry-After {', '.join(pd['retry_after_values']) or 'missing'}")  # fmt: skip
        print(f"  restarted worker ready in {_s(pd['restart_ready_s'])}; router serving again "
              f"{_s(pd['recover_s'])} after that")  # fmt: skip
    dh = result.get("decode_half")
    if isinstance(dh, dict):
        print(f"\nhalf the decode workers killed ({dh['killed']} of {dh['decode_workers']}): "
              f"{dh['requests']} requests, {dh['failed']} failed, "
              f"{dh['decode_resumes']:.0f} streams resumed on a survivor")  # fmt: skip
        print(f"  dropped from /health {_s(dh['dropped_from_health_s'])} after the kill; latency "
              f"p50 {dh['latency_p50_ms']:.1f} ms, max {dh['latency_max_ms']:.1f} ms; restarted "
              f"workers back in rotation {_s(dh['back_in_rotation_s'])} after ready")  # fmt: skip
    pl = result.get("packet_loss")
    if isinstance(pl, dict) and "skipped" in pl:
        print(f"\npacket loss drill skipped: {pl['skipped']}")
    elif isinstance(pl, dict):
        print(f"\n{pl['loss_percent']}% packet loss router <-> workers ({pl['mechanism']}; "
              f"{pl['packets_dropped']} packets dropped)")  # fmt: skip
        print(f"  without loss: {pl['baseline_ok']}/{pl['baseline_requests']} ok, p50 "
              f"{pl['baseline_p50_ms']:.1f} ms, p99 {pl['baseline_p99_ms']:.1f} ms")  # fmt: skip
        print(f"  with loss:    {pl['lossy_ok']}/{pl['lossy_requests']} ok, p50 "
              f"{pl['lossy_p50_ms']:.1f} ms, p99 {pl['lossy_p99_ms']:.1f} ms; workers dropped: "
              f"{'yes' if pl['workers_dropped_during_loss'] else 'no'}")  # fmt: skip
        print(f"  recovered {_s(pl['recover_s'])} after the loss stopped")
        if pl["why_not_netem"]:
            print(f"  (netem unavailable: {pl['why_not_netem']})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata drill", description="Router operator drills.")
    p.add_argument("drills", nargs="*", default=list(DRILLS), help=f"any of {', '.join(DRILLS)}")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    p.add_argument("--loss", type=float, default=1.0, help="packet loss percent (default 1)")
    p.add_argument("--quick", action="store_true", help="shorter phases")
    p.add_argument("--json", type=Path, dest="json_path")
    ns = p.parse_args(argv)
    unknown = sorted(set(ns.drills) - set(DRILLS))
    if unknown:
        print(f"strata drill: unknown drills {unknown} (known: {', '.join(DRILLS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="strata-drill-") as tmp:
        result = run(ns.drills, Path(tmp), preset=ns.preset, loss_percent=ns.loss, quick=ns.quick)
    print_report(result)
    if ns.json_path is not None:
        ns.json_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {ns.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
