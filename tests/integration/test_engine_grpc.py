"""The engine workers over gRPC (in-process servers on port 0, a real daemon): the Prefill and
Decode services give the reference's tokens, bad requests get INVALID_ARGUMENT and the worker
keeps serving, health reports SERVING, a cancelled stream frees its request, and `stop()` lets a
stream in flight finish while refusing new calls."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from conftest import RunningDaemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import StoreClient
from engine.reference import greedy_generate
from engine.runtime import ModelRuntime
from engine.server import DECODE_SERVICE, PREFILL_SERVICE, EngineServer
from engine.wire import unpack_page_keys
from engine.worker_config import WorkerConfig
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import DecodeStub, PrefillStub

pytestmark = pytest.mark.integration

PAGE = 16


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint: Path) -> ModelRuntime:
    return ModelRuntime(tiny_checkpoint, page_tokens=PAGE, max_context=1024)


class Served:
    def __init__(self, runtime: ModelRuntime, store: StoreClient, model: str) -> None:
        self.prefill = EngineServer(
            WorkerConfig("prefill", model, port=0, page_tokens=PAGE, max_context=1024),
            runtime=runtime,
            store=store,
        )
        self.decode = EngineServer(
            WorkerConfig("decode", model, port=0, page_tokens=PAGE, max_context=1024, max_batch=4),
            runtime=runtime,
            store=store,
        )
        self.channels = [
            grpc.insecure_channel(self.prefill.start()),
            grpc.insecure_channel(self.decode.start()),
        ]
        self.prefill_stub = PrefillStub(self.channels[0])
        self.decode_stub = DecodeStub(self.channels[1])

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.prefill.stop(5)
        self.decode.stop(5)


@pytest.fixture
def served(runtime: ModelRuntime, daemon: RunningDaemon, tiny_checkpoint: Path) -> Iterator[Served]:
    store = StoreClient(daemon.address, timeout_s=2.0, retries=1)
    running = Served(runtime, store, str(tiny_checkpoint))
    yield running
    running.close()
    store.close()


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_prefill_then_decode_over_grpc(runtime: ModelRuntime, served: Served) -> None:
    text = "The store keeps pages of attention keys and values, 42 of them."
    prompt = runtime.tokenizer.encode(text)
    want = greedy_generate(runtime.model, prompt, 20)
    first = served.prefill_stub.Prefill(
        pb.PrefillRequest(request_id="r1", prompt_text=text, sampling=greedy(20)), timeout=30
    )
    assert (first.request_id, first.first_token, first.finish_reason) == ("r1", want[0], "")
    assert list(first.prompt_token_ids) == prompt and first.prompt_tokens == len(prompt)
    assert len(unpack_page_keys(first.page_keys)) == len(prompt) // PAGE == first.published_pages
    assert first.computed_tokens == len(prompt) and first.timings.total_s > 0
    events = list(
        served.decode_stub.Decode(
            pb.DecodeRequest(
                request_id="r1",
                prompt_token_ids=prompt,
                output_token_ids=[first.first_token],
                sampling=greedy(20),
            ),
            timeout=30,
        )
    )
    assert [e.index for e in events] == list(range(1, 20))
    assert [first.first_token, *(e.token_id for e in events)] == want
    assert all(e.HasField("token_id") for e in events)
    assert [e.finish_reason for e in events] == [""] * 18 + ["length"]
    last = events[-1].stats
    assert last.hit_tokens.dram == len(prompt) // PAGE * PAGE and last.computed_tokens >= 1
    assert first.first_text + "".join(e.text for e in events) == runtime.tokenizer.decode(want)
    # a hit on the second prefill, now by token ids
    again = served.prefill_stub.Prefill(pb.PrefillRequest(token_ids=prompt, sampling=greedy(20)))
    assert again.hit_tokens.dram == len(prompt) // PAGE * PAGE and not again.prompt_token_ids


def test_health(served: Served) -> None:
    for channel, service in zip(served.channels, (PREFILL_SERVICE, DECODE_SERVICE), strict=True):
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


BAD_PREFILLS = [
    (pb.PrefillRequest(), "empty"),
    (pb.PrefillRequest(token_ids=[1] * 1024), "context holds 1024"),
    (pb.PrefillRequest(token_ids=[1, 2], prompt_text="x"), "not both"),
    (pb.PrefillRequest(token_ids=[1, 100_000]), "outside the vocabulary"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(top_p=2.0)), "top_p"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(top_k=-3)), "top_k"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(stop=[""])), "stop string"),
    (
        pb.PrefillRequest(token_ids=[1], sampling=pb.SamplingParams(stop_token_ids=[99_999])),
        "stop token ids",
    ),
]


def test_bad_requests_are_invalid_argument_and_the_workers_keep_serving(
    runtime: ModelRuntime, served: Served
) -> None:
    for request, message in BAD_PREFILLS:
        with pytest.raises(grpc.RpcError) as info:
            served.prefill_stub.Prefill(request, timeout=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, request
        assert message in (info.value.details() or ""), (request, info.value.details())
    bad_decodes = [
        (pb.DecodeRequest(), "empty"),
        (pb.DecodeRequest(prompt_token_ids=[1], output_token_ids=[100_000]), "output token ids"),
        (pb.DecodeRequest(prompt_token_ids=[1] * 2000), "context holds 1024"),
        (
            pb.DecodeRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(temperature=-2)),
            "temperature",
        ),
    ]
    for request, message in bad_decodes:
        with pytest.raises(grpc.RpcError) as info:
            list(served.decode_stub.Decode(request, timeout=10))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, request
        assert message in (info.value.details() or "")
    prompt = [runtime.tokenizer.bos_id or 0, 5, 6, 7]
    ok = served.prefill_stub.Prefill(pb.PrefillRequest(token_ids=prompt, sampling=greedy(4)))
    events = list(
        served.decode_stub.Decode(
            pb.DecodeRequest(
                prompt_token_ids=prompt, output_token_ids=[ok.first_token], sampling=greedy(4)
            )
        )
    )
    want = greedy_generate(runtime.model, prompt, 4)
    assert [ok.first_token, *(e.token_id for e in events)] == want


def test_a_cancelled_stream_frees_its_request(runtime: ModelRuntime, served: Served) -> None:
    call = served.decode_stub.Decode(
        pb.DecodeRequest(prompt_token_ids=[1, 2, 3], sampling=greedy(900)), timeout=60
    )
    assert next(call).index == 0
    call.cancel()
    worker = served.decode.worker
    assert worker.wait_idle(10)
    assert worker.pool.num_free == worker.pool.num_pages


def test_stop_finishes_the_stream_in_flight_and_refuses_new_calls(
    runtime: ModelRuntime, served: Served
) -> None:
    prompt = [runtime.tokenizer.bos_id or 0, *range(10, 30)]
    call = served.decode_stub.Decode(
        pb.DecodeRequest(prompt_token_ids=prompt, sampling=greedy(600)), timeout=120
    )
    events = [next(call)]
    rest: list[pb.TokenEvent] = []
    reader = threading.Thread(target=lambda: rest.extend(call), daemon=True)
    reader.start()
    stopper = threading.Thread(target=served.decode.stop, daemon=True)
    stopper.start()
    deadline = threading.Event()
    for _ in range(500):  # bounded: until the server refuses new calls
        if not served.decode.accepting:
            break
        deadline.wait(0.01)
    assert not served.decode.accepting
    with pytest.raises(grpc.RpcError) as info:
        list(served.decode_stub.Decode(pb.DecodeRequest(prompt_token_ids=[1, 2]), timeout=10))
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert reader.is_alive()  # the stream was still in flight when the new call was refused
    reader.join(60)
    stopper.join(60)
    events += rest
    assert len(events) == 600 and events[-1].finish_reason == "length"
    want = greedy_generate(runtime.model, prompt, 40)
    assert [e.token_id for e in events[:40]] == want
    assert torch.tensor([e.index for e in events]).diff().eq(1).all()
