"""Failover against real processes: a store daemon, two prefill and two decode workers, and
`strata router` (round_robin, so which worker a request meets is known) from a config file.

- the router restarted from its file serves again, with its configuration (SLO classes, policy);
- a prefill worker killed with SIGKILL: the next requests are served by the other one (the
  router retries), and the dead one is dropped within the bounded time;
- a decode worker that hangs mid-stream (SIGSTOP): the router gives up on it after its stall
  bound and the stream continues on the other decode worker; the worker is taken back later;
- a non-streamed request's decode worker that hangs: the answer is completed on the other from
  its last batch of tokens, the greedy reference's exactly;
- the decode worker killed with SIGKILL mid-stream: the stream continues on the other decode
  worker, and the client gets exactly the greedy reference's tokens (none missing or repeated).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from router_processes import Child, load_report, router, wait_for, worker, write_profile

from engine.checkpoint import load_checkpoint
from engine.model import DecoderModel
from engine.reference import greedy_generate
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

MODEL = "strata-tiny-llama"
DROP_AFTER_S = 1.5
STALL_S = 1.0


class Cluster:
    def __init__(self, checkpoint: Path, config: Path) -> None:
        ckpt = load_checkpoint(checkpoint)
        self.model = DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)
        self.config = config
        self.prefill: dict[str, Child] = {}
        self.decode: dict[str, Child] = {}
        self.router: Child | None = None
        self.base = ""

    def start_router(self, port: int = 0) -> str:
        self.router = router("--config", str(self.config), "--port", str(port)).start()
        self.base = self.router.ready(60).removesuffix("/v1")
        wait_for(lambda: self.health().get("status") == "ok", 30, "router health")
        return self.base

    def health(self) -> dict[str, object]:
        try:
            return dict(httpx.get(f"{self.base}/health", timeout=5).json())
        except httpx.HTTPError:
            return {}

    def reference(self, prompt: list[int], count: int) -> list[int]:
        with torch.no_grad():
            return greedy_generate(self.model, prompt, count)


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-failover")
    children: list[Child] = []
    running: Cluster | None = None
    with DaemonProcess(tmp / "store", dram="64MiB", ssd="0").start() as daemon:
        try:
            roles = ["prefill", "prefill", "decode", "decode"]
            started = [worker(role, tiny_checkpoint, daemon.address).start() for role in roles]
            children += started
            addresses = [w.ready() for w in started]
            config = tmp / "router.toml"
            config.write_text(
                "[router]\n"
                'policy = "round_robin"\n'
                f"drop_after_s = {DROP_AFTER_S}\n"
                f"min_stall_s = {STALL_S}\n"
                f"workers = {json.dumps(addresses)}\n"
                f'store = "{daemon.address}"\n'
                f'profile = "{write_profile(tmp / "profile.json")}"\n'
                "[admission]\n"
                'default_class = "standard"\n'
                "[[admission.classes]]\n"
                'name = "standard"\n'
                "[[admission.classes]]\n"
                'name = "impossible"\n'
                "ttft_s = 0.000001\n"
            )
            running = Cluster(tiny_checkpoint, config)
            running.prefill = dict(zip(addresses[:2], started[:2], strict=True))
            running.decode = dict(zip(addresses[2:], started[2:], strict=True))
            running.start_router()
            assert running.router is not None
            children.append(running.router)
            yield running
        finally:
            for child in children:
                child.kill9()
            if running is not None and running.router is not None:
                running.router.kill9()


def _prompt(seed: int, length: int = 35) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [0, *torch.randint(3, 500, (length - 1,), generator=gen).tolist()]


def _complete(base: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def _retries(base: str, stage: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    pattern = rf'^strata_router_retries_total\{{[^}}]*stage="{stage}"[^}}]*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def test_router_restarted_serves_again_with_its_configuration(cluster: Cluster) -> None:
    prompt = _prompt(1)
    before = _complete(cluster.base, prompt, 6)
    assert before.status_code == 200
    port = int(cluster.base.rsplit(":", 1)[1])
    assert cluster.router is not None and cluster.router.terminate() == 0
    cluster.start_router(port)  # the same file, the same port
    after = _complete(cluster.base, prompt, 6)
    assert after.status_code == 200
    assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    refused = httpx.post(
        f"{cluster.base}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers={"x-strata-slo-class": "impossible"},
        timeout=30,
    )
    assert refused.status_code == 429 and "retry-after" in refused.headers
    health = cluster.health()
    assert (health["prefill"], health["decode"]) == (2, 2)


def test_prefill_worker_killed_requests_served_by_the_other(cluster: Cluster) -> None:
    dead, alive = sorted(cluster.prefill)
    retries = _retries(cluster.base, "prefill")
    cluster.prefill[dead].kill9()
    # round robin sends one of two consecutive requests to the dead worker, which the router
    # still believes alive (its last report is younger than drop_after_s): that one is retried
    for seed in (2, 3):
        prompt = _prompt(seed)
        reply = _complete(cluster.base, prompt, 5)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-strata-prefill"] == alive
        assert reply.json()["choices"][0]["token_ids"] == cluster.reference(prompt, 5)
    assert _retries(cluster.base, "prefill") >= retries + 1
    # and the silent worker is dropped within the bound
    wait_for(lambda: cluster.health().get("prefill") == 1, DROP_AFTER_S + 3, "the drop")


def _stream_tokens(cluster: Cluster, prompt: list[int], count: int, act: object) -> list[int]:
    """Stream a completion; after 4 tokens call `act(decode worker address)` once."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": count,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    acted = False
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        first = reply.headers["x-strata-decode"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0].get("token_ids", [])
            if not acted and len(tokens) >= 4:
                act(first)  # type: ignore[operator]
                acted = True
    assert acted, "the stream ended before the worker could be disturbed"
    return tokens


def test_decode_worker_that_hangs_mid_stream_is_given_up_on(cluster: Cluster) -> None:
    prompt = _prompt(5, length=40)
    count = 200
    want = cluster.reference(prompt, count)
    stopped: list[Child] = []

    def hang(address: str) -> None:
        cluster.decode[address].signal(signal.SIGSTOP)  # alive, but silent
        stopped.append(cluster.decode[address])

    resumes = _retries(cluster.base, "decode")
    began = time.monotonic()
    try:
        tokens = _stream_tokens(cluster, prompt, count, hang)
    finally:
        for child in stopped:
            child.signal(signal.SIGCONT)
    assert tokens == want
    assert _retries(cluster.base, "decode") >= resumes + 1
    assert time.monotonic() - began < 30
    # the worker that hung answers again and is taken back
    wait_for(lambda: cluster.health().get("decode") == 2, 15, "the hung worker's return")


def test_a_non_streamed_request_whose_decode_worker_hangs_resumes_from_its_last_batch(
    cluster: Cluster,
) -> None:
    """A non-streamed request's Decode comes in batches (`DecodeRequest.batch_s`): a decode
    worker that goes silent mid-request is given up on after its stall bound, and the answer is
    completed on the other from the tokens the router has, the greedy reference's exactly."""
    prompt = _prompt(7, length=40)
    count = 400
    want = cluster.reference(prompt, count)
    resumes = _retries(cluster.base, "decode")
    stopped: list[Child] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_complete, cluster.base, prompt, count)

        def busy() -> str:
            return next((a for a in cluster.decode if load_report(a).running_requests > 0), "")

        wait_for(lambda: bool(busy()) or reply.done(), 30, "the decode to start")
        running = busy()
        assert running, "the request ended before its decode worker could be stopped"
        cluster.decode[running].signal(signal.SIGSTOP)
        stopped.append(cluster.decode[running])
        try:
            answer = reply.result(timeout=60)
        finally:
            for child in stopped:
                child.signal(signal.SIGCONT)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-strata-decode"] != running
    assert answer.json()["choices"][0]["token_ids"] == want
    assert answer.json()["usage"]["completion_tokens"] == count
    assert _retries(cluster.base, "decode") >= resumes + 1
    wait_for(lambda: cluster.health().get("decode") == 2, 15, "the hung worker's return")


def test_decode_worker_killed_mid_stream_resumes_on_the_other(cluster: Cluster) -> None:
    prompt = _prompt(4, length=40)
    count = 300
    want = cluster.reference(prompt, count)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": count,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    killed = ""
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        first = reply.headers["x-strata-decode"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0].get("token_ids", [])
            if not killed and len(tokens) >= 4:
                cluster.decode[first].kill9()
                killed = first
    assert killed, "the stream ended before the decode worker could be killed"
    assert tokens == want
    assert _retries(cluster.base, "decode") >= 1
    # the resume was placed by the core's decode-only policy, and explained like any decision
    decisions = httpx.get(f"{cluster.base}/debug/decisions", timeout=10).json()["decisions"]
    resumes = [d for d in decisions if d.get("policy") == "resume"]
    assert resumes, decisions[-3:]
    resume = resumes[-1]
    assert resume["decode"] != killed and resume["prefill"] == resume["decode"]
    assert resume["resumed_after_tokens"] >= 4
    assert resume["predicted_ttft_s"] > 0 and resume["predicted_tpot_s"] > 0
    assert killed not in {c["decode"] for c in resume["candidates"]}


def test_last_decode_worker_killed_mid_stream_ends_with_an_error_event(cluster: Cluster) -> None:
    """With no decode worker left, the stream ends with an OpenAI-style error event (the 503
    of the one table) and `data: [DONE]`: never a silent truncation."""
    body = {
        "model": MODEL,
        "prompt": _prompt(6),
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[str] = []
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        last = reply.headers["x-strata-decode"]
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 4:
                    cluster.decode[last].kill9()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("overloaded_error", "no_worker")
