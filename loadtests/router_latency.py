"""The router's added latency, for `strata bench router`: one request, through the router and
direct, many interleaved rounds, paired differences with bootstrap confidence intervals.

Each round sends the same request once by each path, in an order shuffled per round (seeded),
non-streamed and then streamed:

- `direct`: an ideal client of the workers, doing exactly the RPCs the router does (grpc.aio,
  the client stack the router itself uses): `Prefill` on a prefill worker, then `Decode` on a
  decode worker from the first token (in batches for the non-streamed sample, as the router asks
  for a non-streamed request), with a request id, the prompt already as token ids. It
  calls the pair the router placed its latest request on (its `x-strata-prefill` and
  `x-strata-decode` headers; the first workers before any), so both sides run on the same
  workers in the same proportions: two workers of one role differ by 1-3 ms on the same request
  in one run (which cores their threads got), more than the 2 ms target, and a direct client
  pinned to one of them measured that difference as the router's. Its
  TTFT is the Prefill answer; the streamed sample still runs the Decode to the end (untimed), so
  both paths leave the workers the same work behind them. It leaves out everything the router
  adds: HTTP, JSON, tokenization, the store lookup, the decision, the extra process hop.
- `router_httpx`: `POST /v1/completions` with a text prompt (the router tokenizes it to those
  same ids) through httpx, the HTTP client of the OpenAI Python SDK. It leaves nothing out.
- `router_raw`: the same request through `loadtests.raw_http` (one kept-alive socket, no client
  library): it leaves out the HTTP client library's own per-request work, nothing of the
  router's.

Non-streamed: the whole response. Streamed: TTFT, to the first `data: {` SSE chunk. With a short
`max_tokens` (2 by default: the prefill's token and one decode step) the decode's own noise does
not hide the router's. A round's difference (router - direct) pairs two samples taken a few ms
apart under the same machine load; the report gives each path's p50, and per router path the
median of the paired differences (and of the paired TTFT ratios) with a 95% bootstrap interval.
It also reads the router process's CPU time (/proc) over the rounds, less its idle rate (load
polls), per request, and the machine's load average (1, 5, 15 min) as the rounds start and end:
on a shared machine the added time follows the load, so a result is read with it.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc.aio
import httpx

from engine.router.chat import ModelText
from engine.router.dispatch import DECODE_BATCH_S
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import DecodeStub, PrefillStub
from loadtests.raw_http import RawHttp

PATHS = ("direct", "router_httpx", "router_raw")
ROUTERS = ("router_httpx", "router_raw")
LEAVES_OUT = {
    "direct": "HTTP, JSON, tokenization, store lookup, decision, the router's process hop",
    "router_httpx": "nothing (httpx: the OpenAI SDK's HTTP client)",
    "router_raw": "the HTTP client library's own work (one raw kept-alive socket)",
}


@dataclass(frozen=True, slots=True)
class Interval:
    """A median and its bootstrap 95% interval."""

    median: float
    low: float
    high: float
    samples: int

    @classmethod
    def of(cls, values: Sequence[float], *, seed: int = 0, resamples: int = 2000) -> Interval:
        """The median of `values` and the 2.5/97.5 percentiles of the medians of `resamples`
        resamples with replacement (seeded: the same values give the same interval)."""
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        rng = random.Random(seed)
        n = len(values)
        medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
        low = medians[int(0.025 * (resamples - 1))]
        high = medians[math.ceil(0.975 * (resamples - 1))]
        return cls(statistics.median(values), low, high, n)


def prompt_text(text: ModelText, tokens: int) -> tuple[str, list[int]]:
    """A text prompt of at least `tokens` tokens under `text`'s tokenizer, and its ids as the
    router computes them (special tokens added)."""
    words: list[str] = []
    ids: list[int] = []
    for i in range(16 * tokens):
        words.append(f"w{(i * 7919) % 9973}")
        if i % 8 == 7:
            ids = text.encode(" ".join(words))
            if len(ids) >= tokens:
                break
    return " ".join(words), ids


def _cpu_s(pid: int) -> float | None:
    """utime + stime of `pid` in seconds (None where /proc does not have it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """What the measurement talks to: the router (its base URL and, for its CPU time, its pid)
    and the workers a direct client calls until the router placed a request (then it follows the
    router's placements), with the model's name and checkpoint folder."""

    base_url: str
    prefill: str
    decode: str
    model: str
    model_path: Path
    router_pid: int | None = None


def measure(
    at: Endpoints, *, reps: int, prompt_tokens: int, tokens: int, seed: int = 0
) -> dict[str, object]:
    """See the module doc. The JSON-ready report."""
    return asyncio.run(_measure(at, reps, prompt_tokens, tokens, seed))


async def _measure(
    at: Endpoints, reps: int, prompt_tokens: int, tokens: int, seed: int
) -> dict[str, object]:
    base_url, router_pid, model = at.base_url, at.router_pid, at.model
    text, ids = prompt_text(ModelText.from_dir(at.model_path), prompt_tokens)
    body = {"model": model, "prompt": text, "max_tokens": tokens, "ignore_eos": True}
    stream_body = {**body, "stream": True}
    url = f"{base_url}/v1/completions"
    sampling = pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
    count = [0]
    samples: dict[str, list[float]] = {f"{p}.{k}": [] for p in PATHS for k in ("full", "ttft")}
    raw = await RawHttp.for_url(base_url).open()
    channels: dict[str, grpc.aio.Channel] = {}
    # the (prefill, decode) pair of the router's latest placement: the direct client's next
    pair = [at.prefill, at.decode]

    def placed(headers: Mapping[str, str]) -> None:
        prefill, decode = headers.get("x-strata-prefill"), headers.get("x-strata-decode")
        if prefill and decode:
            pair[:] = [prefill, decode]

    def channel(address: str) -> grpc.aio.Channel:
        if address not in channels:
            channels[address] = grpc.aio.insecure_channel(address)
        return channels[address]

    async with httpx.AsyncClient(timeout=120) as http:

        def check(got: object) -> None:
            usage = got.get("usage") if isinstance(got, dict) else None
            if not isinstance(usage, dict) or usage.get("completion_tokens") != tokens:
                raise RuntimeError(f"the router did not produce {tokens} tokens: {got!r:.300}")
            if usage.get("prompt_tokens") != len(ids):
                raise RuntimeError(
                    f"the router tokenized the prompt to {usage.get('prompt_tokens')} tokens, "
                    f"the benchmark to {len(ids)}"
                )

        async def httpx_full() -> float:
            t0 = time.perf_counter()
            r = await http.post(url, json=body)
            r.raise_for_status()
            took = time.perf_counter() - t0
            check(r.json())
            placed(r.headers)
            return took

        async def httpx_ttft() -> float:
            t0 = time.perf_counter()
            first = 0.0
            async with http.stream("POST", url, json=stream_body) as r:
                r.raise_for_status()
                placed(r.headers)
                async for line in r.aiter_lines():
                    if not first and line.startswith("data: {"):
                        first = time.perf_counter() - t0
            return first

        async def raw_full() -> float:
            t0 = time.perf_counter()
            r = await raw.post_json("/v1/completions", body)
            took = time.perf_counter() - t0
            if r.status != 200:
                raise RuntimeError(f"router answered {r.status}: {r.body[:300]!r}")
            check(r.json())
            placed(r.headers)
            return took

        async def raw_ttft() -> float:
            t0 = time.perf_counter()
            r = await raw.post_json("/v1/completions", stream_body)
            if r.status != 200 or r.first_event_s is None:
                raise RuntimeError(f"router stream answered {r.status}: {r.body[:300]!r}")
            placed(r.headers)
            return r.first_event_s - t0

        async def direct(full: bool) -> float:
            count[0] += 1
            rid = f"bench-direct-{count[0]}"
            pstub, dstub = PrefillStub(channel(pair[0])), DecodeStub(channel(pair[1]))
            t0 = time.perf_counter()
            reply = await pstub.Prefill(
                pb.PrefillRequest(request_id=rid, token_ids=ids, sampling=sampling), timeout=120
            )
            ttft = time.perf_counter() - t0
            request = pb.DecodeRequest(
                request_id=rid, prompt_token_ids=ids, output_token_ids=[reply.first_token],
                sampling=sampling, batch_s=DECODE_BATCH_S if full else 0.0,
            )  # fmt: skip
            n = 1
            async for event in dstub.Decode(request, timeout=120):
                n += len(event.token_ids) or event.HasField("token_id")
            if n != tokens:
                raise RuntimeError(f"direct produced {n} tokens, asked {tokens}")
            return time.perf_counter() - t0 if full else ttft

        async def direct_full() -> float:
            return await direct(True)

        async def direct_ttft() -> float:
            return await direct(False)

        calls: dict[str, tuple[Callable[[], Awaitable[float]], Callable[[], Awaitable[float]]]]
        calls = {
            "direct": (direct_full, direct_ttft),
            "router_httpx": (httpx_full, httpx_ttft),
            "router_raw": (raw_full, raw_ttft),
        }
        for _ in range(3):  # warm: the prompt's pages in the store, connections open
            for full, ttft in calls.values():
                await full()
                await ttft()
        idle_cpu_per_s = await _idle_rate(router_pid)
        rng = random.Random(seed)
        load0 = os.getloadavg()
        cpu0, wall0 = _cpu_s(router_pid) if router_pid else None, time.perf_counter()
        for _ in range(reps):
            order = list(PATHS)
            rng.shuffle(order)
            for path in order:
                full, ttft = calls[path]
                samples[f"{path}.full"].append(await full())
                samples[f"{path}.ttft"].append(await ttft())
        cpu1, wall1 = _cpu_s(router_pid) if router_pid else None, time.perf_counter()
        load1 = os.getloadavg()
    await raw.close()
    for ch in channels.values():
        await ch.close()
    cpu_ms = None
    if cpu0 is not None and cpu1 is not None and idle_cpu_per_s is not None:
        busy = (cpu1 - cpu0) - idle_cpu_per_s * (wall1 - wall0)
        cpu_ms = 1e3 * busy / (2 * len(ROUTERS) * reps)
    report = _report(samples, ids, tokens, reps, cpu_ms, seed)
    report["load_average"] = {"start": list(load0), "end": list(load1)}
    report["rounds_s"] = wall1 - wall0
    return report


async def _idle_rate(pid: int | None, seconds: float = 1.0) -> float | None:
    """The router process's CPU seconds per second with no request (its load polls)."""
    if pid is None:
        return None
    c0, t0 = _cpu_s(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    c1, t1 = _cpu_s(pid), time.perf_counter()
    if c0 is None or c1 is None:
        return None
    return (c1 - c0) / (t1 - t0)


def _p50_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e3 if values else math.nan


def _report(
    samples: dict[str, list[float]],
    ids: Sequence[int],
    tokens: int,
    reps: int,
    cpu_ms: float | None,
    seed: int,
) -> dict[str, object]:
    full = {p: _p50_ms(samples[f"{p}.full"]) for p in PATHS}
    ttft = {p: _p50_ms(samples[f"{p}.ttft"]) for p in PATHS}
    paths = {
        p: {"leaves_out": LEAVES_OUT[p], "full_p50_ms": full[p], "ttft_p50_ms": ttft[p]}
        for p in PATHS
    }
    added: dict[str, object] = {}
    for router in ROUTERS:
        full_diff = [
            (a - b) * 1e3
            for a, b in zip(samples[f"{router}.full"], samples["direct.full"], strict=True)
        ]
        ttft_diff = [
            (a - b) * 1e3
            for a, b in zip(samples[f"{router}.ttft"], samples["direct.ttft"], strict=True)
        ]
        ttft_ratio = [
            a / b
            for a, b in zip(samples[f"{router}.ttft"], samples["direct.ttft"], strict=True)
            if b > 0
        ]
        added[router] = {
            "non_streamed_ms": asdict(Interval.of(full_diff, seed=seed)),
            "non_streamed_p50_difference_ms": full[router] - full["direct"],
            "streamed_ttft_ms": asdict(Interval.of(ttft_diff, seed=seed)),
            "streamed_ttft_ratio": asdict(Interval.of(ttft_ratio, seed=seed)),
            "streamed_ttft_p50_ratio": ttft[router] / ttft["direct"],
        }
    return {
        "prompt_tokens": len(ids),
        "output_tokens": tokens,
        "reps": reps,
        "paths": paths,
        "added": added,
        "router_cpu_ms_per_request": cpu_ms,
        "samples_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in samples.items()},
    }
