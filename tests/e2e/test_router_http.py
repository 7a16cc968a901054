"""The router over HTTP against real processes: a store daemon, a prefill and a decode worker and
`strata router` on loopback (tiny preset). Non-streamed and streamed completions and chats with
the `openai` client and raw httpx give the tokens of a plain single-process greedy run; usage
counts prompt, completion and cached tokens; every error status comes with an OpenAI-style body;
a client that goes away mid-stream frees the decode worker's pages; a non-streamed answer carries
the same latency split (`strata_timings`) as a streamed one's last chunk."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from router_processes import (
    Child,
    load_report,
    router,
    wait_for,
    worker,
    write_profile,
)

from engine.checkpoint import load_checkpoint
from engine.model import DecoderModel
from engine.reference import greedy_generate
from engine.router.chat import ModelText
from engine.router.streaming import ChunkFormat
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

MODEL = "strata-tiny-llama"
CONFIG = """
[router]
policy = "strata"

[admission]
default_class = "standard"

[[admission.classes]]
name = "standard"

[[admission.classes]]
name = "impossible"
ttft_s = 0.000001
"""


class Stack:
    def __init__(self, base: str, decode: str, checkpoint: Path) -> None:
        self.base = base
        self.root = base.removesuffix("/v1")
        self.decode = decode
        ckpt = load_checkpoint(checkpoint)
        self.model = DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)
        self.text = ModelText.from_dir(checkpoint)
        self.http = httpx.Client(base_url=self.root, timeout=60)
        self.client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

    def reference(self, prompt: list[int], count: int) -> list[int]:
        with torch.no_grad():
            return greedy_generate(self.model, prompt, count)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("router-http")
    children: list[Child] = []
    with DaemonProcess(tmp / "store", dram="64MiB", ssd="0").start() as daemon:
        try:
            prefill = worker("prefill", tiny_checkpoint, daemon.address).start()
            decode = worker("decode", tiny_checkpoint, daemon.address).start()
            children += [prefill, decode]
            addresses = [prefill.ready(), decode.ready()]
            config = tmp / "router.toml"
            config.write_text(CONFIG)
            front = router(
                "--config",
                str(config),
                "--workers",
                ",".join(addresses),
                "--store",
                daemon.address,
                "--profile",
                str(write_profile(tmp / "profile.json")),
            ).start()
            children.append(front)
            base = front.ready(60)
            stack = Stack(base, addresses[1], tiny_checkpoint)
            wait_for(lambda: stack.http.get("/health").status_code == 200, 30, "router health")
            yield stack
            stack.http.close()
        finally:
            for child in children:
                child.kill9()


def prompt_ids(stack: Stack, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(3, 500, (length - 1,), generator=gen).tolist()
    return [stack.text.inner.token_to_id("<|bos|>"), *body]


def test_completion_equals_the_reference_and_counts_usage(stack: Stack) -> None:
    prompt = prompt_ids(stack, 40, seed=1)
    want = stack.reference(prompt, 12)
    extra = {"return_token_ids": True, "ignore_eos": True}
    first = stack.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
    )
    choice = first.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == want
    assert choice.text == stack.text.decode(want)
    assert choice.finish_reason == "length"
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (40, 12)
    assert first.usage.total_tokens == 52
    # the prompt's two full pages are in the store now: the second run pulls them
    again = stack.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, extra_body=extra
    )
    assert again.choices[0].model_extra["token_ids"] == want  # type: ignore[index]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_text_prompt_and_stream_over_raw_http(stack: Stack) -> None:
    text = "The store keeps pages of attention keys and values"
    ids = stack.text.encode(text)
    want = stack.reference(ids, 10)
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
    }
    events: list[str] = []
    with stack.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-strata-decode"] == stack.decode
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert tokens == want
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == stack.text.decode(want)
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 10)


# the latency split as `Run.timings` names it: the prefill worker's parts and the decode worker's
SPLIT = {
    "prefill_queue_ms", "lookup_ms", "prefill_pull_ms", "prefill_compute_ms", "sample_ms",
    "publish_wait_ms", "decode_queue_ms", "decode_pull_ms", "decode_ms",
}  # fmt: skip


def _check_split(timings: object) -> dict[str, float]:
    assert isinstance(timings, dict) and set(timings) == SPLIT, timings
    assert all(isinstance(v, float | int) and v >= 0 for v in timings.values()), timings
    assert timings["prefill_compute_ms"] > 0  # the prefill worker did compute the prompt
    assert timings["decode_ms"] > 0  # decode steps after the prefill's token
    return timings


def test_latency_split_in_a_whole_answer_as_in_a_streams_last_chunk(stack: Stack) -> None:
    prompt = prompt_ids(stack, 40, seed=4)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    whole = stack.http.post("/v1/completions", json=body)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
    got = whole.json()
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["choices"][0]["text"] == stack.text.decode(stack.reference(prompt, 4))
    assert got["usage"]["completion_tokens"] == 4
    _check_split(got["strata_timings"])
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "pages"}],
        "max_tokens": 3,
        "ignore_eos": True,
    }
    reply = stack.http.post("/v1/chat/completions", json=chat).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    _check_split(reply["strata_timings"])
    with stack.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert [("strata_timings" in c) for c in chunks] == [False] * 4 + [True]
    _check_split(chunks[-1]["strata_timings"])


def test_chunk_format_encodes_what_a_chunk_dict_would() -> None:
    """The pre-encoded chunks are the JSON of the OpenAI chunk objects, escapes included."""
    for chat in (False, True):
        for usage in (False, True):
            fmt = ChunkFormat.of(
                chat=chat, response_id='id-"1"', created=7, model="m\\x", include_usage=usage
            )
            for text, token_id, first in (('a "q"\n', 5, True), ("é\u2028", None, False)):
                raw = fmt.token(text, token_id, first=first)
                assert raw.startswith(b"data: {") and raw.endswith(b"}\n\n")
                choice: dict[str, object] = {"index": 0}
                if chat:
                    choice["delta"] = {"content": text, **({"role": "assistant"} if first else {})}
                else:
                    choice["text"] = text
                choice.update(finish_reason=None, logprobs=None)
                if token_id is not None:
                    choice["token_ids"] = [token_id]
                want = {
                    "id": 'id-"1"',
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 7,
                    "model": "m\\x",
                    "choices": [choice],
                    **({"usage": None} if usage else {}),
                }
                assert json.loads(raw[6:]) == want
            last = json.loads(
                fmt.finish("stop", first=False, token_ids=True, timings={"a_ms": 1.5})[6:]
            )
            assert last["choices"][0]["finish_reason"] == "stop"
            assert last["choices"][0]["token_ids"] == [] and last["strata_timings"] == {"a_ms": 1.5}


def test_chat_streamed_and_not_with_the_openai_client(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Say something about pages."}]
    ids = stack.text.chat_ids(MODEL, messages)
    want = stack.reference(ids, 8)
    extra = {"ignore_eos": True}
    whole = stack.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        extra_body=extra,
    )
    assert whole.choices[0].message.content == stack.text.decode(want)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 8)
    stream = stack.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    parts, usage, roles = [], None, []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            roles.append(choice.delta.role)
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].message.content
    assert roles[0] == "assistant"
    assert usage is not None and usage.completion_tokens == 8


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    return dict(body["error"])


def test_error_statuses(stack: Stack) -> None:
    post = stack.http.post
    ok = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    malformed = post(
        "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert _error(malformed, 400)["type"] == "invalid_request_error"
    assert _error(post("/v1/completions", json={**ok, "temperature": -1}), 400)
    assert "n" in str(_error(post("/v1/completions", json={**ok, "n": 2}), 400)["message"])
    assert _error(post("/v1/completions", json={**ok, "prompt": [1, 99999]}), 400)
    long = {**ok, "prompt": [5] * 1100}
    assert _error(post("/v1/completions", json=long), 400)["code"] == "context_length_exceeded"
    past = {**ok, "prompt": "hi", "max_tokens": 5000}
    assert _error(post("/v1/completions", json=past), 400)["code"] == "context_length_exceeded"
    assert _error(post("/v1/completions", json={**ok, "model": "nope"}), 404)["code"] == (
        "model_not_found"
    )
    assert _error(post("/v1/completions", json={**ok, "slo_class": "gold"}), 400)
    refused = post("/v1/completions", json=ok, headers={"x-strata-slo-class": "impossible"})
    assert _error(refused, 429)["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    assert float(refused.headers["x-strata-predicted-ttft-ms"]) > 0.001  # what broke the class
    with stack.http.stream(
        "POST", "/v1/chat/completions", json={**ok, "messages": "x", "stream": True}
    ) as bad:
        assert bad.status_code == 400
    # a known field with a value it cannot honour: 400 with an OpenAI-style body naming the field
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, field in (
        ("/v1/completions", {**ok, "stop": 5}, "stop"),
        ("/v1/completions", {**ok, "stop": {"a": 1}}, "stop"),
        ("/v1/completions", {**ok, "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {**ok, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**ok, "top_k": -1}, "top_k"),
        ("/v1/completions", {**ok, "seed": "abc"}, "seed"),
        ("/v1/completions", {**ok, "stream": True, "stream_options": "yes"}, "stream_options"),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "wizard", "content": "x"}]},
            "messages",
        ),
        ("/v1/chat/completions", {**chat, "temperature": -0.1}, "temperature"),
        ("/v1/chat/completions", {**chat, "n": 3}, "n"),
    ):
        error = _error(post(path, json=body), 400)
        assert error["type"] == "invalid_request_error", (body, error)
        assert field in str(error["message"]) + str(error.get("param")), (body, error)
    # fields it does not know are ignored, as OpenAI-compatible servers do
    assert post("/v1/completions", json={**ok, "logit_bias": {}, "user": "u"}).status_code == 200
    # the router still serves after all that
    assert post("/v1/completions", json=ok).status_code == 200


def test_models_health_metrics_openapi_and_decisions(stack: Stack) -> None:
    models = stack.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = stack.http.get("/health").json()
    assert (health["status"], health["prefill"], health["decode"]) == ("ok", 1, 1)
    reply = stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}
    )
    for header in ("x-strata-prefill", "x-strata-decode"):
        assert reply.headers[header]
    assert float(reply.headers["x-strata-predicted-ttft-ms"]) > 0
    assert float(reply.headers["x-strata-predicted-tpot-ms"]) > 0
    metrics = stack.http.get("/metrics").text
    assert "strata_router" in metrics
    schema = stack.http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert reply.headers["x-strata-policy"] == "strata"
    assert int(reply.headers["x-strata-hit-tokens"]) >= 0
    decisions = stack.http.get("/debug/decisions").json()["decisions"]
    mine = [d for d in decisions if d["request_id"] == reply.headers["x-request-id"]]
    assert mine and mine[0]["decision"] == "placed" and mine[0]["candidates"]
    # the record agrees with the headers, and prices each candidate by its parts
    record = mine[0]
    assert (record["prefill"], record["decode"]) == (
        reply.headers["x-strata-prefill"],
        reply.headers["x-strata-decode"],
    )
    assert record["predicted_ttft_s"] * 1e3 == pytest.approx(
        float(reply.headers["x-strata-predicted-ttft-ms"]), abs=1e-3
    )
    winner = record["candidates"][0]
    assert winner["rejected_because"] == "" and winner["prefill"] == record["prefill"]
    parts = winner["queue_s"] + winner["pull_s"] + winner["compute_s"]
    assert parts == pytest.approx(winner["predicted_ttft_s"], abs=1e-5)


def test_client_disconnect_frees_the_decode_workers_pages(stack: Stack) -> None:
    idle = load_report(stack.decode)
    assert idle.running_requests == 0
    body = {"model": MODEL, "prompt": "x " * 30, "max_tokens": 900, "stream": True}
    body["ignore_eos"] = True
    with stack.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(not line or line.startswith("data: ") for line in got)
        busy = load_report(stack.decode)
        assert busy.running_requests == 1 and busy.free_pages < idle.free_pages
    # the response is closed: the router cancels the decode stream, the worker frees the pages
    wait_for(
        lambda: load_report(stack.decode).free_pages == idle.free_pages,
        10,
        "the decode worker's pages to be freed",
    )
    assert load_report(stack.decode).running_requests == 0
    metrics = stack.http.get("/metrics").text
    assert 'outcome="cancelled"' in metrics


def test_client_disconnect_from_a_whole_answer_frees_the_decode_workers_pages(
    stack: Stack,
) -> None:
    """A non-streamed request whose client goes away while its answer is being collected: the
    router cancels the decode (counted as cancelled) and the worker frees the pages."""
    idle = load_report(stack.decode)
    assert idle.running_requests == 0
    cancelled_before = _cancelled_count(stack.http.get("/metrics").text)
    body = json.dumps(
        {"model": MODEL, "prompt": "x " * 30, "max_tokens": 900, "ignore_eos": True}
    ).encode()
    url = httpx.URL(stack.root)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {url.host}:{url.port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head + body)
        wait_for(
            lambda: load_report(stack.decode).running_requests == 1,
            30,
            "the decode worker to run the request",
        )
        assert load_report(stack.decode).free_pages < idle.free_pages
    # the connection is closed with no answer read: the router cancels the run
    wait_for(
        lambda: load_report(stack.decode).free_pages == idle.free_pages,
        10,
        "the decode worker's pages to be freed",
    )
    assert load_report(stack.decode).running_requests == 0
    wait_for(
        lambda: _cancelled_count(stack.http.get("/metrics").text) > cancelled_before,
        10,
        "the run to be counted as cancelled",
    )


def _cancelled_count(metrics: str) -> float:
    """The sum of the router's finished-request counters with outcome="cancelled"."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith("#") and 'outcome="cancelled"' in line and "_total" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_no_worker_gives_503(tmp_path: Path) -> None:
    front = router("--workers", "127.0.0.1:9", "--profile", str(write_profile(tmp_path / "p.json")))
    front.start()
    try:
        base = front.ready(60).removesuffix("/v1")
        with httpx.Client(base_url=base, timeout=30) as http:
            reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert _error(reply, 503)["code"] == "no_worker"
            assert int(reply.headers["retry-after"]) >= 1
            assert http.get("/health").status_code == 503
    finally:
        assert front.terminate() == 0


def test_openapi_schema_holds_for_generated_requests(stack: Stack) -> None:
    """schemathesis validates the published schema and sends requests generated from it: no
    answer is a server error, and every answer matches the schema (status, body, headers)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    raw = stack.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=stack.root)
    tried: list[str] = []
    routes = sorted((path, method.upper()) for path, ops in raw["paths"].items() for method in ops)
    # every route the router serves is in the schema, and every one is exercised
    assert routes == sorted(
        [
            ("/v1/completions", "POST"),
            ("/v1/chat/completions", "POST"),
            ("/v1/models", "GET"),
            ("/health", "GET"),
            ("/metrics", "GET"),
            ("/debug/decisions", "GET"),
            ("/debug/workers", "GET"),
        ]
    )
    for path, method in routes:
        operation = schema[path][method]

        @settings(
            max_examples=12,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case: object) -> None:
            response = case.call_and_validate(  # type: ignore[attr-defined]
                base_url=stack.root, timeout=60, excluded_checks=[positive_data_acceptance]
            )
            if response.status_code == 400:
                # what the schema cannot say: the context limit (in tokens), the configured
                # SLO class names, stream_options only with stream; any other 400 for a
                # schema-valid body is a failure
                error = response.json()["error"]
                assert (
                    error["code"] == "context_length_exceeded"
                    or error["param"] == "slo_class"
                    or "stream_options is only allowed" in error["message"]
                ), error

        check()
        tried.append(f"{method} {path}")
    assert len(tried) == len(routes)


def test_router_reports_a_taken_port_and_a_missing_profile(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    profile = str(write_profile(tmp_path / "p.json"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = ["router", "--workers", "127.0.0.1:9", "--port", str(port), "--profile", profile]
        done = subprocess.run(
            [sys.executable, "-m", "strata_cli.main", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "strata_cli.main", "router", "--workers", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--profile" in done.stderr


def test_seed_temperature_and_stop_reach_the_workers(stack: Stack) -> None:
    prompt = prompt_ids(stack, 30, seed=9)
    extra = {"return_token_ids": True, "ignore_eos": True}

    def run(**kw: object) -> openai.types.Completion:
        return stack.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, extra_body=extra, **kw
        )

    a = run(temperature=1.5, top_p=0.9, seed=7)
    b = run(temperature=1.5, top_p=0.9, seed=7)
    c = run(temperature=1.5, top_p=0.9, seed=8)
    ids = [r.choices[0].model_extra["token_ids"] for r in (a, b, c)]  # type: ignore[index]
    assert ids[0] == ids[1]  # seeded draws are the same on every run (and worker)
    assert ids[0] != ids[2]
    assert ids[0] != stack.reference(prompt, 12)  # temperature did change the draw
    greedy = run()
    text = greedy.choices[0].text
    cut = next(i for i in range(3, len(text)) if text[i].isalnum())
    stopped = run(stop=[text[cut : cut + 2]])
    assert stopped.choices[0].finish_reason == "stop"
    assert text.startswith(stopped.choices[0].text) and len(stopped.choices[0].text) <= cut
