"""Tenants at the router against real processes (store daemon, a prefill and a decode worker,
`strata router --api-keys FILE`, all on loopback): a request without a key or with a wrong one
is 401, a key past its request or token rate is 429 with Retry-After, a class the key may not
use is 403; the namespace comes from the key alone (a request naming another tenant's namespace
is ignored: the other tenant's first request finds nothing cached), and `cache_salt` isolates
within a tenant (no page shared across salts, shared within one)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from router_processes import Child, router, wait_for, worker, write_profile

from engine.router.chat import ModelText
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

MODEL = "strata-tiny-llama"
KEY_A = "sk-test-tenant-a-000000000000"
KEY_B = "sk-test-tenant-b-111111111111"
KEY_SLOW = "sk-test-slow-222222222222222"
KEY_THIN = "sk-test-thin-333333333333333"
KEYS = f"""
[[keys]]
key = "{KEY_A}"
tenant = "a"
slo_classes = ["standard"]

[[keys]]
key_sha256 = "{hashlib.sha256(KEY_B.encode()).hexdigest()}"
tenant = "b"

[[keys]]
key = "{KEY_SLOW}"
tenant = "slow"
requests_per_s = 0.01
request_burst = 1

[[keys]]
key = "{KEY_THIN}"
tenant = "thin"
tokens_per_s = 1
token_burst = 60
"""
CONFIG = """
[admission]
default_class = "standard"
[[admission.classes]]
name = "standard"
[[admission.classes]]
name = "batch"
"""


class Stack:
    def __init__(self, base: str, checkpoint: Path) -> None:
        self.root = base.removesuffix("/v1")
        self.text = ModelText.from_dir(checkpoint)
        self.http = httpx.Client(base_url=self.root, timeout=60)
        self.seed = 100

    def prompt(self, length: int = 40) -> list[int]:
        """A fresh prompt (two full 16-token pages and a tail) that nobody has sent yet."""
        self.seed += 1
        gen = torch.Generator().manual_seed(self.seed)
        body = torch.randint(3, 500, (length - 1,), generator=gen).tolist()
        return [self.text.inner.token_to_id("<|bos|>"), *body]

    def complete(
        self,
        key: str | None,
        prompt: list[int],
        headers: dict[str, str] | None = None,
        **body: object,
    ) -> httpx.Response:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        return self.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **body},
            headers={**h, **(headers or {})},
        )

    def cached(self, key: str, prompt: list[int], **body: object) -> int:
        reply = self.complete(key, prompt, **body)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("router-tenants")
    children: list[Child] = []
    with DaemonProcess(tmp / "store", dram="64MiB", ssd="0").start() as daemon:
        try:
            prefill = worker("prefill", tiny_checkpoint, daemon.address).start()
            decode = worker("decode", tiny_checkpoint, daemon.address).start()
            children += [prefill, decode]
            addresses = [prefill.ready(), decode.ready()]
            (tmp / "keys.toml").write_text(KEYS)
            (tmp / "router.toml").write_text(CONFIG)
            front = router(
                "--config",
                str(tmp / "router.toml"),
                "--api-keys",
                str(tmp / "keys.toml"),
                "--workers",
                ",".join(addresses),
                "--store",
                daemon.address,
                "--profile",
                str(write_profile(tmp / "profile.json")),
            ).start()
            children.append(front)
            stack = Stack(front.ready(60), tiny_checkpoint)
            assert "API keys enforced" in front.text()
            wait_for(lambda: stack.http.get("/health").status_code == 200, 30, "router health")
            yield stack
            stack.http.close()
        finally:
            for child in children:
                child.kill9()


def _error(reply: httpx.Response, status: int) -> dict[str, object]:
    assert reply.status_code == status, reply.text
    error: dict[str, object] = reply.json()["error"]
    return error


def test_no_key_or_a_wrong_key_is_401(stack: Stack) -> None:
    prompt = stack.prompt()
    for reply in (
        stack.complete(None, prompt),
        stack.complete("sk-test-not-a-key-at-all-000", prompt),
        stack.complete(None, prompt, headers={"Authorization": f"Basic {KEY_A}"}),
        stack.http.get("/v1/models"),
        stack.http.get("/debug/decisions", headers={"Authorization": f"Bearer {KEY_A}"}),
    ):
        want = 403 if reply.request.url.path.startswith("/debug") else 401
        error = _error(reply, want)
        if want == 401:
            assert error["code"] == "invalid_api_key"
            assert reply.headers["www-authenticate"] == "Bearer"
    models = stack.http.get("/v1/models", headers={"x-api-key": KEY_B})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert stack.http.get("/health").status_code == 200  # health and metrics stay open
    assert stack.http.get("/metrics").status_code == 200
    assert stack.complete(KEY_A, prompt).status_code == 200


def test_a_class_the_key_may_not_use_is_403(stack: Stack) -> None:
    error = _error(stack.complete(KEY_A, stack.prompt(), slo_class="batch"), 403)
    assert error["param"] == "slo_class" and error["code"] == "permission_denied"
    assert stack.complete(KEY_B, stack.prompt(), slo_class="batch").status_code == 200


def test_past_the_request_rate_is_429_with_retry_after(stack: Stack) -> None:
    assert stack.complete(KEY_SLOW, stack.prompt()).status_code == 200
    reply = stack.complete(KEY_SLOW, stack.prompt())
    error = _error(reply, 429)
    assert error["code"] == "rate_limit_exceeded" and "request rate" in str(error["message"])
    assert reply.headers["x-strata-limited-by"] == "requests"
    assert 90 <= int(reply.headers["retry-after"]) <= 100  # one request at 0.01/s
    assert stack.complete(KEY_B, stack.prompt()).status_code == 200  # other keys unaffected


def test_past_the_token_rate_is_429_with_retry_after(stack: Stack) -> None:
    assert stack.complete(KEY_THIN, stack.prompt()).status_code == 200  # 40 + 4 of 60 tokens
    reply = stack.complete(KEY_THIN, stack.prompt())
    error = _error(reply, 429)
    assert reply.headers["x-strata-limited-by"] == "tokens" and "token rate" in str(
        error["message"]
    )
    assert 28 <= int(reply.headers["retry-after"]) <= 30  # 28 tokens short at 1/s
    # a request the bucket can never hold is a 400 naming max_tokens, not a retry
    big = _error(stack.complete(KEY_THIN, stack.prompt(), max_tokens=100), 400)
    assert big["param"] == "max_tokens"


def test_the_key_decides_the_namespace(stack: Stack) -> None:
    prompt = stack.prompt()
    # tenant a names tenant b's namespace in the body and in a header: both are ignored
    claim = {"namespace": "b"}
    assert stack.cached(KEY_A, prompt, **claim) == 0
    reply = stack.complete(KEY_A, prompt, headers={"x-strata-namespace": "b"}, **claim)
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # a's own pages
    # had a's pages gone to b's namespace, b would find them now
    assert stack.cached(KEY_B, prompt) == 0
    assert stack.cached(KEY_B, prompt) == 32


def test_cache_salt_isolates_within_a_tenant(stack: Stack) -> None:
    prompt = stack.prompt()
    assert stack.cached(KEY_A, prompt, cache_salt="s1") == 0
    assert stack.cached(KEY_A, prompt, cache_salt="s1") == 32  # shared within one salt
    assert stack.cached(KEY_A, prompt, cache_salt="s2") == 0  # not across salts
    assert stack.cached(KEY_A, prompt) == 0  # nor with the tenant's unsalted requests
    assert stack.cached(KEY_B, prompt, cache_salt="s1") == 0  # nor across tenants, same salt
