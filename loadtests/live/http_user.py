"""One streamed OpenAI completion, recorded as the report wants it.

`stream_completion(http, base_url, body, ...)` POSTs to /v1/completions with `stream: true` (the
prompt as token ids, `ignore_eos` so the answer is `max_tokens` long, usage at the end) and
stamps, on the run's clock: the first token, every inter-token gap, the end. Status: ok; refused
(HTTP 429); timeout (no end within the request timeout); failed (anything else, with the error).
The live latency split comes from the `strata_timings` a Strata router puts on the last chunk
(the workers' own queue, pull and compute times, see `split_latency`); against another server
TTFT goes to `prefill_s` and the rest to `decode_s`.

`post_completion(...)` is the same request not streamed (`completion_body(..., stream=False)`):
the client sees only the end, so the record has no first token (TTFT and TPOT are not
observable; `metrics.meets` judges it on its end-to-end time) and its split comes from the
`strata_timings` a Strata router puts in the response body (`split_whole`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from loadtests.report.records import Breakdown, RequestRecord


@dataclass(frozen=True, slots=True)
class Sent:
    """What the scheduler knows of a request when it leaves."""

    request_id: str
    slo_class: str
    intended_s: float
    sent_s: float
    prompt_tokens: int
    max_tokens: int


def completion_body(
    model: str, prompt: list[int], max_tokens: int, *, stream: bool = True
) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        "temperature": 0.0,
        # Each streamed token's id (Strata's extension): a token whose text is still an
        # incomplete character arrives with empty text and is counted by its id.
        "return_token_ids": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def split_latency(timings: dict[str, object], ttft_s: float, decode_total_s: float) -> Breakdown:
    """A request's latency split from the `strata_timings` (ms) of a Strata router's last chunk.

    Disaggregated (the prefill worker reported its parts): queue, lookup + pull + the wait for
    its pages to publish, compute + sampling before the first token, the decode worker's queue
    and pull after it. Co-located (only the decode worker reported): its queue and pull come
    before the first token and the rest of the TTFT is the prefill. What the workers do not
    account for (the client's lag, the router, the network) is `other_s`. Without timings
    (another server): TTFT and decode only.
    """

    def part(name: str) -> float:
        value = timings.get(name, 0.0)
        return float(value) / 1e3 if isinstance(value, int | float) and value > 0 else 0.0

    if not timings:
        return Breakdown(prefill_s=ttft_s, decode_s=decode_total_s)
    d_queue, d_pull = part("decode_queue_ms"), part("decode_pull_ms")
    if "prefill_compute_ms" in timings:
        queue = part("prefill_queue_ms")
        compute = part("prefill_compute_ms") + part("sample_ms")
        # the prompt's pages on their way to the decode worker: published, then pulled
        pull = part("lookup_ms") + part("prefill_pull_ms") + part("publish_wait_ms")
        after = min(d_queue + d_pull, decode_total_s)
        return Breakdown(
            queue_s=queue,
            prefill_s=compute,
            pull_s=pull + min(d_pull, after),
            decode_queue_s=min(d_queue, max(after - d_pull, 0.0)),
            decode_s=decode_total_s - after,
            other_s=max(ttft_s - queue - compute - pull, 0.0),
        )
    before = min(d_queue + d_pull, ttft_s)
    return Breakdown(
        queue_s=min(d_queue, before),
        pull_s=max(before - d_queue, 0.0),
        prefill_s=ttft_s - before,
        decode_s=decode_total_s,
    )


def split_whole(timings: dict[str, object], e2e_s: float) -> Breakdown:
    """The latency split of a non-streamed request from the `strata_timings` (ms) of its body.

    The workers' parts as in `split_latency` (prefill queue, compute + sampling, KV movement,
    decode queue; a `decode_ms` part when the router reports one); the client saw no first
    token, so what the workers do not account for goes to `decode_s` when there is no
    `decode_ms` (it is the decode worker's streaming, mostly) and to `other_s` when there is.
    Without timings (another server) nothing is known of the parts: it is all `other_s`.
    The parts add up to `e2e_s` (a report longer than it is clipped).
    """

    def part(name: str) -> float:
        value = timings.get(name, 0.0)
        return float(value) / 1e3 if isinstance(value, int | float) and value > 0 else 0.0

    if not timings:
        return Breakdown(other_s=max(e2e_s, 0.0))
    left = max(e2e_s, 0.0)

    def take(x: float) -> float:
        nonlocal left
        got = min(x, left)
        left -= got
        return got

    queue = take(part("prefill_queue_ms"))
    compute = take(part("prefill_compute_ms") + part("sample_ms"))
    pull = take(
        part("lookup_ms")
        + part("prefill_pull_ms")
        + part("publish_wait_ms")
        + part("decode_pull_ms")
    )
    d_queue = take(part("decode_queue_ms"))
    if "decode_ms" in timings:
        decode = take(part("decode_ms"))
        return Breakdown(queue, compute, pull, d_queue, decode, other_s=left)
    return Breakdown(queue, compute, pull, d_queue, decode_s=left)


def post_completion(
    http: httpx.Client,
    base_url: str,
    body: dict[str, object] | bytes,
    sent: Sent,
    now: Callable[[], float],
    *,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """One non-streamed completion: the end only, its tokens from `usage` (or `token_ids`),
    its split from the body's `strata_timings` when present."""
    status, http_status, error = "ok", 0, ""
    tokens = cached = 0
    timings: dict[str, object] = {}
    prefill_worker = decode_worker = ""
    finish = math.nan
    try:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        resp = http.post(
            f"{base_url}/completions", content=content, headers=hdrs, timeout=timeout_s
        )
        finish = now()
        http_status = resp.status_code
        prefill_worker = resp.headers.get("x-strata-prefill", "")
        decode_worker = resp.headers.get("x-strata-decode", "")
        if resp.status_code != 200:
            status = "refused" if resp.status_code == 429 else "failed"
            error = resp.text[:300]
        else:
            doc = resp.json()
            if not isinstance(doc, dict):
                raise ValueError("the response body is not a JSON object")
            usage = doc.get("usage") or {}
            tokens = int(usage.get("completion_tokens", 0))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            if not tokens:
                tokens = sum(len(c.get("token_ids") or ()) for c in doc.get("choices") or ())
            if isinstance(doc.get("strata_timings"), dict):
                timings = doc["strata_timings"]
            if not tokens:
                status, error = "failed", "the response had no token"
    except httpx.TimeoutException as exc:
        status, error = "timeout", str(exc)[:300] or "timed out"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"[:300]
    ok = status == "ok"
    return RequestRecord(
        request_id=sent.request_id,
        slo_class=sent.slo_class,
        status=status,
        intended_s=sent.intended_s,
        sent_s=sent.sent_s,
        first_token_s=math.nan,
        finish_s=finish if ok else math.nan,
        prompt_tokens=sent.prompt_tokens,
        output_tokens=tokens if ok else 0,
        max_tokens=sent.max_tokens,
        hit_tokens=(("unknown", cached),) if cached and ok else (),
        breakdown=split_whole(timings, finish - sent.intended_s) if ok else Breakdown(),
        prefill_worker=prefill_worker,
        decode_worker=decode_worker,
        http_status=http_status,
        error=error,
    )


def stream_completion(
    http: httpx.Client,
    base_url: str,
    body: dict[str, object] | bytes,
    sent: Sent,
    now: Callable[[], float],
    *,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> RequestRecord:
    """One streamed completion; `on_first_token()` is called as its first token arrives."""
    times: list[float] = []
    tokens = 0
    cached = 0
    status, http_status, error = "ok", 0, ""
    prefill_worker = decode_worker = ""
    timings: dict[str, object] = {}
    try:
        # A body encoded ahead of time (bytes) keeps the JSON work off the send path.
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        with http.stream(
            "POST", f"{base_url}/completions", content=content, headers=hdrs, timeout=timeout_s
        ) as resp:
            http_status = resp.status_code
            prefill_worker = resp.headers.get("x-strata-prefill", "")
            decode_worker = resp.headers.get("x-strata-decode", "")
            if resp.status_code != 200:
                resp.read()
                status = "refused" if resp.status_code == 429 else "failed"
                error = resp.text[:300]
            else:
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        status, error = "failed", json.dumps(chunk["error"])[:300]
                        break
                    usage = chunk.get("usage")
                    if usage:
                        tokens = max(tokens, int(usage.get("completion_tokens", 0)))
                        cached = int(
                            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                        )
                    if isinstance(chunk.get("strata_timings"), dict):
                        timings = chunk["strata_timings"]
                    for choice in chunk.get("choices") or ():
                        ids = choice.get("token_ids")
                        if ids:
                            times.extend(
                                [now()] * len(ids)
                            )  # every token, gaps of 0 within a chunk
                        elif ids is None and choice.get("text"):
                            times.append(now())  # a server without token ids: one per text chunk
                    if times and on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                if not times and status == "ok":
                    status, error = "failed", "the stream ended without a token"
    except httpx.TimeoutException as exc:
        status, error = "timeout", str(exc)[:300] or "timed out"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"[:300]
    first = times[0] if times else math.nan
    finish = times[-1] if times else math.nan
    tokens = max(tokens, len(times)) if status == "ok" else len(times)
    gaps = tuple(b - a for a, b in itertools.pairwise(times))
    breakdown = (
        split_latency(timings, first - sent.intended_s, finish - first) if times else Breakdown()
    )
    return RequestRecord(
        request_id=sent.request_id,
        slo_class=sent.slo_class,
        status=status,
        intended_s=sent.intended_s,
        sent_s=sent.sent_s,
        first_token_s=first if status == "ok" else math.nan,
        finish_s=finish if status == "ok" else math.nan,
        prompt_tokens=sent.prompt_tokens,
        output_tokens=tokens,
        max_tokens=sent.max_tokens,
        hit_tokens=(("unknown", cached),) if cached else (),
        token_gaps_s=gaps,
        breakdown=breakdown,
        prefill_worker=prefill_worker,
        decode_worker=decode_worker,
        http_status=http_status,
        error=error,
    )
