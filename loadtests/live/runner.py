"""`strata loadtest WORKLOAD.toml [--url URL | --up] [--duration S] [--out DIR] [--rates a,b,c | --search]`

Runs the workload open loop against an OpenAI-compatible server (a URL, or a fresh `strata up`
started and stopped here), headless under locust's library API with gevent: one locust user runs
the open-loop schedule (`openloop.py`) and every request goes out in its own greenlet
(`http_user.py`), reported to locust's statistics as it completes and recorded for the report.
Bounded in time: each rate runs its duration, then waits at most the request timeout for the
stragglers, which count as timed out. With `--rates` it sweeps and the report gives the goodput
(the highest rate at which ≥ 90% of requests meet both targets of their class). Progress lines
every few seconds: elapsed, sent, in flight, current send and completion rates. Before each rate,
`--warmup` (3) unrecorded requests go out one at a time (the first requests after start-up are
slow). Bytes moved and
evictions are the store daemon's counters (its Prometheus metrics, which `--up` finds and
`--store-metrics URL` gives) read before and after each rate.

`--search` finds the goodput by bounded bisection over the rate (`search.py`: `--search-low`,
`--search-high`, `--search-steps` short runs). `--no-stream` sends non-streamed requests (the
latency split from the response body's `strata_timings`). `--fresh-prefixes` gives each rate
the workload's prompts under a token-id shift of its own (a bijection of the vocabulary, so each
rate shares within itself exactly as the workload does, and nothing with the rates before it).
`--validate CLUSTER.toml` (with `--up` and `--rates`) measures the serving path just before
each rate (`calibrate.py`), runs the rates with fresh prefixes, simulates the same requests on
the cluster with the terms measured before each and writes both into one report
(`validation.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtests.live.target import UpTarget
    from loadtests.report.records import RunResult


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata loadtest", description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of the OpenAI API, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--up", action="store_true", help="start a fresh `strata up` and test it")
    where.add_argument("--store", help="load a store daemon (gRPC address) through the SDK instead")
    ap.add_argument(
        "--up-args",
        default=None,
        help='arguments for `strata up`, written --up-args="..." (default: the tiny preset)',
    )
    ap.add_argument(
        "--up-data-dir",
        default=None,
        help="keep `strata up`'s checkpoint and profile here (default: a fresh temporary folder)",
    )
    ap.add_argument(
        "--store-metrics",
        default=None,
        help="the store daemon's Prometheus URL, for bytes moved and evictions (with --url; "
        "--up finds it)",
    )
    ap.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    ap.add_argument("--rates", default=None, help="comma list of request rates to sweep")
    ap.add_argument(
        "--search", action="store_true", help="find the goodput by bisection over the rate"
    )
    ap.add_argument("--search-low", type=float, default=0.5, help="lowest rate to search (/s)")
    ap.add_argument("--search-high", type=float, default=8.0, help="highest rate to search (/s)")
    ap.add_argument("--search-steps", type=int, default=5, help="runs in the search, at most")
    ap.add_argument(
        "--no-stream", action="store_true", help="non-streamed requests (end-to-end only)"
    )
    ap.add_argument(
        "--fresh-prefixes",
        action="store_true",
        help="each rate's prompts shifted apart, so no rate hits what an earlier one cached",
    )
    ap.add_argument(
        "--validate",
        default=None,
        metavar="CLUSTER.toml",
        help="measure the serving path, run the rates live, simulate them on this cluster and "
        "report live against simulated (with --up and --rates)",
    )
    ap.add_argument(
        "--time-model",
        default=None,
        help="with --validate: the profile whose pulls the simulation uses (default: the one "
        "`strata up` used, else the cluster's)",
    )
    ap.add_argument("--out", default="loadtest-report")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument(
        "--send-class", action="store_true", help="send each request's class (x-strata-slo-class)"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="unrecorded requests (prompts outside the workload) sent one at a time before each rate",
    )
    ap.add_argument("--progress-s", type=float, default=5.0)
    ap.add_argument("--max-lag-ms", type=float, default=50.0)
    ap.add_argument("--no-plots", action="store_true")
    return ap


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    # gevent first: locust and httpx must see patched sockets and locks.
    from gevent import monkey

    monkey.patch_all()
    from loadtests.live.calibrate import CalibrationError
    from loadtests.live.search import SearchError, check_range, search
    from loadtests.live.target import TargetError
    from loadtests.report.files import write_report
    from loadtests.sim.cluster import ClusterError, load_cluster
    from loadtests.workload import WorkloadError, load_workload

    try:
        spec = load_workload(args.workload)
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
        if args.search:
            if args.rates:
                raise ValueError("--search and --rates exclude each other")
            check_range(args.search_low, args.search_high, args.search_steps)
        cluster = load_cluster(args.validate) if args.validate else None
        if cluster is not None and (not args.up or not args.rates or args.search):
            raise ValueError("--validate needs --up and --rates (and no --search)")
    except (WorkloadError, ValueError, SearchError, ClusterError) as exc:
        print(f"strata loadtest: {exc}", file=sys.stderr)
        return 2
    if args.store:
        return _run_store(args, spec, rates[0])
    fresh = args.fresh_prefixes or cluster is not None
    shifts = itertools.count(1 if fresh else 0)
    measured: list[object] = []  # --validate: a calibration before each rate and after the last
    profile = ""
    try:
        with _target(args) as target:

            def run_at(rate: float | None) -> RunResult:
                if cluster is not None and rate is not None:
                    from loadtests.live.validation import measure_now

                    # measured just before this rate, under the machine's conditions of now
                    measured.append(measure_now(args, spec, target, cluster, rate))
                shift = next(shifts) if fresh else 0
                return _with_store_counters(
                    target.store_metrics,
                    functools.partial(
                        _run_rate, args, spec, target.base_url, target.model, rate, shift
                    ),
                )

            if args.search:
                print(
                    f"goodput search {spec.name} against {target.base_url} (model "
                    f"{target.model}): {args.search_low:g} to {args.search_high:g}/s, at most "
                    f"{args.search_steps} runs",
                    flush=True,
                )
                runs, probes = search(
                    run_at,
                    args.search_low,
                    args.search_high,
                    args.search_steps,
                    progress=lambda line: print(line, flush=True),
                )
            else:
                print(
                    f"load test {spec.name} against {target.base_url} (model {target.model}), "
                    "rates "
                    + ", ".join(
                        f"{r:g}/s" if r else f"{spec.arrival.rate:g}/s (spec)" for r in rates
                    ),
                    flush=True,
                )
                runs = [run_at(rate) for rate in rates]
                if cluster is not None and rates[-1] is not None:
                    from loadtests.live.validation import measure_now, profile_of

                    measured.append(measure_now(args, spec, target, cluster, rates[-1]))
                    profile = profile_of(args, target, cluster)
    except (TargetError, CalibrationError) as exc:
        print(f"strata loadtest: {exc}", file=sys.stderr)
        return 1
    if cluster is not None:
        from loadtests.live.validation import simulate_and_report

        return simulate_and_report(args, spec, cluster, profile, measured, runs)  # type: ignore[arg-type]
    extra = ""
    if args.search:
        from loadtests.live.search import goodput

        rows = "\n".join(
            f"| {i} | {p.rate:.3g} | {p.attainment * 100:.1f}% | {'yes' if p.valid else 'NO'} | "
            f"{'meets' if p.passed() else 'misses'} |"
            for i, p in enumerate(probes, 1)
        )
        extra = (
            f"## Goodput search\n\n{args.search_low:g} to {args.search_high:g}/s, "
            f"{len(probes)} of at most {args.search_steps} runs: goodput **{goodput(probes):.3g}/s**"
            "\n\n| step | rate /s | attainment | valid | goal |\n|---|---|---|---|---|\n"
            + rows
            + "\n"
        )
    paths = write_report(
        runs, args.out, f"Load test: {spec.name}", plots=not args.no_plots, extra_markdown=extra
    )
    from loadtests.report.compare import side_by_side

    print(side_by_side(runs))
    invalid = [r.label for r in runs if not _valid(r)]
    if invalid:
        print(f"INVALID (the client fell behind its schedule): {', '.join(invalid)}")
    if args.search:
        from loadtests.live.search import goodput

        print(f"goodput {goodput(probes):.3g}/s (search of {len(probes)} runs)", flush=True)
    print(f"wrote {paths['json']} and {paths['markdown']}", flush=True)
    return 0


def _valid(run: object) -> bool:
    from loadtests.report.metrics import run_metrics

    return run_metrics(run).valid  # type: ignore[arg-type]


def _with_store_counters(metrics_url: str, run: Callable[[], RunResult]) -> RunResult:
    """`run()`, with the store's bytes moved and evictions over it (when its metrics are known)."""
    from loadtests.live.target import store_counters

    if not metrics_url:
        return run()
    moved, evicted = store_counters(metrics_url)
    result = run()
    moved_after, evicted_after = store_counters(metrics_url)
    return dataclasses.replace(
        result, bytes_moved=moved_after - moved, evictions=evicted_after - evicted
    )


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[UpTarget]:
    """The server under test: a URL, or a fresh `strata up` (stopped on exit)."""
    from loadtests.live.target import DEFAULT_UP_ARGS, UpTarget, fresh_up, model_of

    def given(t: UpTarget) -> UpTarget:
        return UpTarget(
            t.base_url, args.model or t.model, args.store_metrics or t.store_metrics, t.profile
        )

    if args.url:
        base = args.url.rstrip("/")
        yield given(UpTarget(base, args.model or model_of(base)))
        return
    up_args = args.up_args.split() if args.up_args else list(DEFAULT_UP_ARGS)
    if args.up_data_dir:
        with fresh_up(up_args, Path(args.up_data_dir)) as target:
            yield given(target)
        return
    with (
        tempfile.TemporaryDirectory(prefix="strata-loadtest-") as tmp,
        fresh_up(up_args, Path(tmp)) as target,
    ):
        yield given(target)


def shift_tokens(ids: Sequence[int], shift: int, low: int, vocab: int) -> list[int]:
    """`ids` under a rotation of [low, vocab) by `shift` (a bijection: equal prompts stay equal,
    shared prefixes stay shared, and a shifted prompt shares no page with an unshifted one)."""
    span = vocab - low
    if shift % span == 0:
        return list(ids)
    return [low + (t - low + shift) % span if t >= low else t for t in ids]


def _run_rate(
    args: argparse.Namespace, spec, base_url: str, model: str, rate: float | None, shift: int = 0
):
    import gevent
    import httpx
    from locust import User, task
    from locust.env import Environment
    from locust.exception import StopUser

    from loadtests.live.http_user import Sent, completion_body, post_completion, stream_completion
    from loadtests.live.openloop import OpenLoop
    from loadtests.report.records import ClassTarget, RequestRecord, RunResult, Sample
    from loadtests.workload import generate_requests, request_token_ids

    duration = args.duration or spec.duration_s
    requests = generate_requests(spec, rate=rate, duration_s=duration)
    offered = rate or spec.arrival.rate
    records: dict[int, RequestRecord] = {}
    in_flight: set[int] = set()
    greenlets: list[gevent.Greenlet] = []
    samples: list[Sample] = []
    http = httpx.Client(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
    env = Environment(user_classes=[], events=None)
    env.create_local_runner()
    state: dict[str, object] = {}

    # Prompts and bodies are built before the clock starts: nothing CPU-heavy on the send path.
    import json

    stream = not args.no_stream
    low, vocab = spec.model.token_low, spec.model.vocab_size
    # a shift of 0 is the workload's own ids; each fresh-prefix rate rotates them by 1/7 of the
    # vocabulary more (mod its size), so no two rates of a sweep share a page
    step = max(1, (vocab - low) // 7)
    bodies = [
        json.dumps(
            completion_body(
                model,
                shift_tokens(request_token_ids(r, spec.model), shift * step, low, vocab),
                r.max_tokens,
                stream=stream,
            )
        ).encode()
        for r in requests
    ]
    send = stream_completion if stream else post_completion

    # Warm-up: a few requests of prompts outside the workload (nothing it shares gets cached),
    # one at a time and not recorded, so the first rate after start-up is not slower than the rest.
    for i in range(args.warmup):
        prompt = [3 + (i * 7919 + j * 104729) % (spec.model.vocab_size - 3) for j in range(32)]
        stream_completion(
            http,
            base_url,
            completion_body(model, prompt, 4),
            Sent(f"warmup-{i}", "", 0.0, 0.0, len(prompt), 4),
            time.monotonic,
            timeout_s=args.request_timeout,
        )

    def fire(index: int, intended: float, sent_at: float) -> None:
        req = requests[index]
        in_flight.add(index)
        body = bodies[index]
        headers = {"x-strata-slo-class": req.slo_class} if args.send_class else None
        sent = Sent(
            req.request_id, req.slo_class, intended, sent_at, req.prompt_tokens, req.max_tokens
        )
        rec = send(
            http, base_url, body, sent, loop.now, timeout_s=args.request_timeout, headers=headers
        )
        records[index] = rec
        in_flight.discard(index)
        env.events.request.fire(
            request_type="POST",
            name=f"/v1/completions [{req.slo_class}]",
            response_time=(rec.e2e_s if rec.status == "ok" else loop.now() - intended) * 1e3,
            response_length=rec.output_tokens,
            exception=None
            if rec.status == "ok"
            else RuntimeError(f"{rec.status}: {rec.error[:80]}"),
            context={"class": req.slo_class},
        )

    def spawn(fn):
        g = gevent.spawn(fn)
        greenlets.append(g)
        return g

    loop = OpenLoop(
        [r.arrival_s for r in requests],
        fire,
        spawn=spawn,
        sleep=gevent.sleep,
        deadline_s=duration,
        max_lag_s=args.max_lag_ms / 1e3,
    )

    class OpenLoopUser(User):
        """Runs the whole open-loop schedule once (locust's own pacing is not used)."""

        @task
        def schedule(self) -> None:
            state["schedule"] = loop.run()
            raise StopUser()

    OpenLoopUser.host = base_url
    env.user_classes = [OpenLoopUser]
    runner = env.runner
    assert runner is not None

    def progress() -> None:
        last_t, last_sent, last_done = 0.0, 0, 0
        while True:
            gevent.sleep(min(0.5, args.progress_s))
            t = loop.now()
            samples.append(Sample(t, 0, len(in_flight)))
            if t - last_t >= args.progress_s:
                done = len(records)
                print(
                    f"  [{t:6.1f}s] sent {loop.sent}/{len(requests)}, in flight {len(in_flight)}, "
                    f"send {(loop.sent - last_sent) / (t - last_t):.2f}/s (target {offered:g}/s), "
                    f"done {(done - last_done) / (t - last_t):.2f}/s",
                    flush=True,
                )
                last_t, last_sent, last_done = t, loop.sent, done

    print(f"rate {offered:g}/s: {len(requests)} requests over {duration:g}s", flush=True)
    load_before = os.getloadavg()[0]
    reporter = gevent.spawn(progress)
    runner.start(1, spawn_rate=1)
    deadline = time.monotonic() + duration + args.request_timeout + 10
    while time.monotonic() < deadline and ("schedule" not in state or in_flight):
        gevent.sleep(0.05)
    runner.quit()
    reporter.kill()
    gevent.killall([g for g in greenlets if not g.dead], timeout=5)
    http.close()
    out: list[RequestRecord] = []
    for i, req in enumerate(requests):
        rec = records.get(i)
        if rec is None:  # never finished within the bound (or never sent: the client fell behind)
            rec = RequestRecord(
                req.request_id,
                req.slo_class,
                "timeout",
                req.arrival_s,
                req.arrival_s if i < loop.sent else math.inf,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.max_tokens,
                error="no answer within the run's bound",
            )
        out.append(rec)
    sched = state.get("schedule")
    total = env.stats.total
    notes = (
        f"locust: {total.num_requests} requests, {total.num_failures} failures, "
        f"median {total.median_response_time} ms, p99 {total.get_response_time_percentile(0.99)} ms",
        f"schedule lag p99 {getattr(sched, 'p99_lag_s', math.nan) * 1e3:.2f} ms, max "
        f"{getattr(sched, 'max_lag_s', math.nan) * 1e3:.2f} ms",
    )
    notes = (
        *notes,
        f"machine load average (1 min) {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs",
    )
    if shift:
        notes = (*notes, f"prompts shifted by {shift * step} token ids (fresh prefixes)")
    if not stream:
        notes = (*notes, "not streamed: end-to-end only")
    return RunResult(
        label=f"live @ {offered:g}/s",
        kind="live",
        workload=spec.name,
        target_rate=offered,
        duration_s=duration,
        classes=tuple(ClassTarget(c.name, c.ttft_s, c.tpot_s) for c in spec.classes),
        records=tuple(out),
        samples=tuple(samples),
        policy="live",
        cluster=base_url,
        seed=spec.seed,
        notes=notes,
    )


def _run_store(args: argparse.Namespace, spec, rate: float | None) -> int:
    """The workload's requests as store operations (lookup, get hits, put misses), open loop;
    every gRPC call reported to locust by the interceptor; prints locust's table per method."""
    import json

    import gevent
    from locust.env import Environment

    from client.transports import gevent_support
    from loadtests.live.grpc_user import StoreLoad, instrumented_client, load_scope
    from loadtests.live.openloop import OpenLoop
    from loadtests.workload import generate_requests

    gevent_support.init()
    env = Environment(user_classes=[])
    env.create_local_runner()

    def report(
        method: str, seconds: float, sent: int, received: int, error: BaseException | None
    ) -> None:
        env.events.request.fire(
            request_type="grpc",
            name=method,
            response_time=seconds * 1e3,
            response_length=sent + received,
            exception=error,
            context={},
        )

    duration = args.duration or spec.duration_s
    requests = generate_requests(spec, rate=rate, duration_s=duration)
    client = instrumented_client(args.store, report, timeout_s=args.request_timeout)
    load = StoreLoad(client, spec, load_scope(spec))
    greenlets: list[gevent.Greenlet] = []
    errors: list[str] = []

    def fire(index: int, intended: float, sent: float) -> None:
        try:
            load.serve(requests[index])
        except Exception as exc:  # a store error is a result of the load test, not its crash
            errors.append(f"{type(exc).__name__}: {exc}")

    loop = OpenLoop(
        [r.arrival_s for r in requests],
        fire,
        spawn=lambda fn: greenlets.append(gevent.spawn(fn)),
        sleep=gevent.sleep,
        deadline_s=duration,
        max_lag_s=args.max_lag_ms / 1e3,
    )
    print(
        f"store load {spec.name} against {args.store}: {len(requests)} requests over {duration:g}s",
        flush=True,
    )
    schedule = loop.run()
    gevent.joinall(greenlets, timeout=args.request_timeout)
    client.close()
    rows = []
    print(
        "| call | requests | failures | median ms | p99 ms | mean bytes |\n|---|---|---|---|---|---|"
    )
    for (name, _kind), entry in sorted(env.stats.entries.items()):
        mean_bytes = entry.total_content_length / entry.num_requests if entry.num_requests else 0
        print(
            f"| {name} | {entry.num_requests} | {entry.num_failures} | {entry.median_response_time} "
            f"| {entry.get_response_time_percentile(0.99)} | {mean_bytes:.0f} |"
        )
        rows.append(
            {
                "call": name,
                "requests": entry.num_requests,
                "failures": entry.num_failures,
                "median_ms": entry.median_response_time,
                "p99_ms": entry.get_response_time_percentile(0.99),
                "mean_bytes": mean_bytes,
            }
        )
    print(
        f"schedule: {schedule.sent}/{schedule.intended} sent, lag p99 {schedule.p99_lag_s * 1e3:.2f} ms"
        + (" (INVALID: the client fell behind)" if schedule.behind else "")
        + f"; {len(errors)} errors"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_calls.json").write_text(
        json.dumps(
            {
                "calls": rows,
                "errors": errors[:50],
                "lag_p99_s": schedule.p99_lag_s,
                "valid": not schedule.behind,
            },
            indent=2,
        )
    )
    return 0 if not errors else 1
