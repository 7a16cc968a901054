"""The workers' `strata.engine.v1.Worker` service, in process: `Describe` gives the router the very
scope the worker keys its pages under (so the router's page keys are the worker's), its tokenizer
and its limits; `Load` reports a decode stream while it runs and the pages it frees after."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import xxhash

from client import page_keys
from engine.router.chat import ModelText
from engine.router.registry import Registry, scope_of
from engine.server import EngineServer
from engine.worker_config import WorkerConfig
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import DecodeStub, PrefillStub, WorkerStub

pytestmark = pytest.mark.integration


@pytest.fixture
def servers(tiny_checkpoint: Path) -> Iterator[dict[str, EngineServer]]:
    started = {}
    for role in ("prefill", "decode"):
        config = WorkerConfig(role=role, model=str(tiny_checkpoint), port=0, max_context=512)
        server = EngineServer(config)
        server.start()
        started[role] = server
    yield started
    for server in started.values():
        server.stop(2)


def test_describe_gives_the_workers_scope_and_tokenizer(
    servers: dict[str, EngineServer], tiny_checkpoint: Path
) -> None:
    for role, server in servers.items():
        with grpc.insecure_channel(server.address) as channel:
            d = WorkerStub(channel).Describe(pb.DescribeRequest(include_tokenizer=True), timeout=5)
            bare = WorkerStub(channel).Describe(pb.DescribeRequest(), timeout=5)
        runtime = server.runtime
        assert d.role == role
        assert scope_of(d) == runtime.scope()
        prompt = list(range(3, 70))
        assert page_keys(scope_of(d), prompt) == page_keys(runtime.scope(), prompt)
        assert (d.page_tokens, d.max_context, d.vocab_size) == (16, 512, runtime.vocab_size)
        assert d.page_payload_bytes == runtime.scope().page_payload_bytes
        assert d.host_id and list(d.eos_token_ids) == list(runtime.eos_ids)
        assert d.tokenizer_json == (tiny_checkpoint / "tokenizer.json").read_bytes()
        assert xxhash.xxh3_128_hexdigest(d.tokenizer_json) == d.tokenizer_fingerprint
        assert ModelText(d.tokenizer_json, d.tokenizer_config_json).chat_template
        assert bare.tokenizer_json == b"" and bare.model_id == d.model_id


def test_load_reports_a_running_decode_and_its_freed_pages(
    servers: dict[str, EngineServer],
) -> None:
    with grpc.insecure_channel(servers["decode"].address) as channel:
        worker = WorkerStub(channel)
        idle = worker.Load(pb.LoadRequest(), timeout=5)
        assert (idle.running_requests, idle.queued_requests, idle.accepting) == (0, 0, True)
        assert idle.free_pages == servers["decode"].worker.pool.num_pages
        sampling = pb.SamplingParams(max_tokens=400, ignore_eos=True)
        request = pb.DecodeRequest(prompt_token_ids=list(range(3, 50)), sampling=sampling)
        stream = DecodeStub(channel).Decode(request, timeout=60)
        next(stream)
        busy = worker.Load(pb.LoadRequest(), timeout=5)
        assert busy.running_requests == 1 and busy.free_pages < idle.free_pages
        assert busy.running_context_tokens >= 48
        (remaining,) = busy.running_remaining_tokens
        assert 0 < remaining < 400
        stream.cancel()
        deadline = time.monotonic() + 10
        while worker.Load(pb.LoadRequest(), timeout=5).free_pages != idle.free_pages:
            assert time.monotonic() < deadline, "the cancelled request kept its pages"
            time.sleep(0.05)
    with grpc.insecure_channel(servers["prefill"].address) as channel:
        reply = PrefillStub(channel).Prefill(
            pb.PrefillRequest(token_ids=list(range(3, 40)), sampling=pb.SamplingParams()),
            timeout=30,
        )
        assert reply.prompt_tokens == 37
        load = WorkerStub(channel).Load(pb.LoadRequest(), timeout=5)
        assert (load.queued_prefill_tokens, load.running_requests) == (0, 0)
        assert load.served_requests == 1


def test_a_colocated_workers_step_budget_reaches_the_routers_view(
    servers: dict[str, EngineServer], tiny_checkpoint: Path
) -> None:
    """The registry's views carry a co-located worker's step token budget (from Describe), so
    the core prices the decode steps its prefill chunks share; other roles report none."""
    config = WorkerConfig(
        role="colocated", model=str(tiny_checkpoint), port=0, max_context=512, step_token_budget=96
    )
    colocated = EngineServer(config)
    colocated.start()
    addresses = [colocated.address, servers["prefill"].address, servers["decode"].address]

    async def views() -> dict[str, tuple[str, int]]:
        registry = Registry(addresses)
        await registry.start()
        try:
            model = next(iter(registry.models))
            return {v.worker_id: (v.role.value, v.step_token_budget) for v in registry.views(model)}
        finally:
            await registry.stop()

    try:
        seen = asyncio.run(views())
    finally:
        colocated.stop(2)
    assert seen == {
        colocated.address: ("colocated", 96),
        servers["prefill"].address: ("prefill", 0),
        servers["decode"].address: ("decode", 0),
    }
