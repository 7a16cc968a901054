"""A non-streamed request's Decode in batches (`DecodeRequest.batch_s`): the worker's servicer
sends every token since its last message once that message is `batch_s` old or the stream ends;
the router asks for batches only for a non-streamed run, accepts each batch's tokens by index
and, when a batched stream breaks, resumes on another decode worker from the last batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import grpc
import grpc.aio
import pytest

from engine.requests import DecodeStats, FinishReason, TierTokens, TokenEvent
from engine.router.core import (
    Admission,
    DecodeCoeffs,
    PrefillCoeffs,
    Role,
    RouterCore,
    TimeModel,
    WorkerView,
    build_policy,
)
from engine.router.core.errors import ErrorKind
from engine.router.dispatch import DECODE_BATCH_S, Dispatcher, Job
from engine.router.http_errors import HttpError
from engine.router.lookup import StoreLookup
from engine.router.registry import Registry
from engine.server import batched
from kvstore_pb import engine_pb2 as pb

pytestmark = pytest.mark.unit

MODEL = TimeModel(PrefillCoeffs(0.01, 0.0, 0.0, 0.0), DecodeCoeffs(0.01, 0.0, 0.0))
PROMPT = (5, 6, 7)


def test_the_servicer_batches_by_age_and_sends_the_end_at_once() -> None:
    times = iter([0.0, 0.1, 0.2, 0.3, 0.35, 0.4])  # the first is the call's start
    stats = DecodeStats(TierTokens(0, 16, 0), computed_tokens=3, queue_s=0.01, pull_s=0.02)
    events = [
        TokenEvent(1, 11, "a"),
        TokenEvent(2, 12, "b"),
        TokenEvent(3, 13, "c"),  # 0.3 s after the start: the batch goes
        TokenEvent(4, 14, "d"),
        TokenEvent(5, None, "!", FinishReason.LENGTH, stats),  # the end, however young
    ]
    out = list(batched(events, 0.25, clock=lambda: next(times)))
    assert [(m.index, list(m.token_ids), m.text, m.finish_reason) for m in out] == [
        (1, [11, 12, 13], "abc", ""),
        (4, [14], "d!", "length"),
    ]
    assert not out[0].HasField("token_id") and not out[0].HasField("stats")
    assert out[1].stats.hit_tokens.dram == 16 and out[1].stats.pull_s == pytest.approx(0.02)


def test_a_young_batch_waits_for_more_tokens() -> None:
    times = iter([0.0, 0.0, 0.0])
    out = list(batched([TokenEvent(1, 5, "x"), TokenEvent(2, 6, "y")], 1e9, lambda: next(times)))
    assert out == []  # nothing ended: a batch waits (the servicer sends one per token at 0)


@dataclass
class Call:
    """A grpc.aio Decode call: `events`, then `error` if given."""

    events: list[pb.TokenEvent]
    error: grpc.aio.AioRpcError | None = None
    cancelled: bool = False

    def __aiter__(self) -> AsyncIterator[pb.TokenEvent]:
        async def gen() -> AsyncIterator[pb.TokenEvent]:
            for event in self.events:
                yield event
            if self.error is not None:
                raise self.error

        return gen()

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


def batch(index: int, ids: list[int], text: str, finish: str = "") -> pb.TokenEvent:
    event = pb.TokenEvent(index=index, text=text, finish_reason=finish)
    event.token_ids.extend(ids)
    if finish:
        event.stats.CopyFrom(pb.DecodeStats())
    return event


@dataclass
class Workers:
    """One prefill and two decode workers; each decode worker answers with its next call."""

    calls: dict[str, Iterator[Call]]
    requests: list[tuple[str, list[int], float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = {a: self._handle(a) for a in ("p:1", "d:1", "d:2")}

    def _handle(self, address: str) -> SimpleNamespace:
        async def prefill(request: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
            return pb.PrefillResponse(first_token=10, first_text="<", prompt_tokens=len(PROMPT))

        def decode(request: pb.DecodeRequest, timeout: float) -> Call:
            self.requests.append((address, list(request.output_token_ids), request.batch_s))
            return next(self.calls[address])

        return SimpleNamespace(
            prefill_stub=lambda: SimpleNamespace(Prefill=prefill),
            decode_stub=lambda: SimpleNamespace(Decode=decode),
        )

    def views(self, model: str, now: float | None = None) -> tuple[WorkerView, ...]:
        return tuple(
            WorkerView(a, Role.prefill if a.startswith("p") else Role.decode, "h", model, 16)
            for a in self.workers
            if a not in self.failed
        )

    def mark_failed(self, address: str, why: str) -> None:
        self.failed.append(address)


def serve(workers: Workers, *, whole: bool) -> tuple[list[int], str, Dispatcher]:
    core = RouterCore(build_policy("round_robin"), Admission(), MODEL)
    dispatcher = Dispatcher(cast(Registry, workers), StoreLookup(None), core)
    model = SimpleNamespace(model_id="m", scope=None, page_tokens=16, page_bytes=1024)
    job = Job("r", cast(Any, model), PROMPT, pb.SamplingParams(max_tokens=6), 6, whole=whole)

    async def run() -> tuple[list[int], str]:
        run = await dispatcher.start(job)
        tokens = [t async for t in run.tokens()]
        return [t.token_id for t in tokens if t.token_id is not None], "".join(
            t.text for t in tokens
        )

    ids, text = asyncio.run(run())
    return ids, text, dispatcher


def test_a_non_streamed_run_asks_for_batches_and_takes_each_batch_by_index() -> None:
    first = Call([batch(1, [11, 12], "ab"), batch(3, [13, 14, 15], "cde", "length")])
    workers = Workers({"d:1": iter([first]), "d:2": iter([])})
    ids, text, _ = serve(workers, whole=True)
    assert ids == [10, 11, 12, 13, 14, 15] and text == "<abcde"
    assert workers.requests == [("d:1", [10], DECODE_BATCH_S)]


def test_a_streamed_run_asks_for_one_event_per_token() -> None:
    one = [pb.TokenEvent(index=1, token_id=11, text="a", finish_reason="length")]
    workers = Workers({"d:1": iter([Call(one)]), "d:2": iter([])})
    ids, _, _ = serve(workers, whole=False)
    assert ids == [10, 11]
    assert workers.requests == [("d:1", [10], 0.0)]


def test_a_broken_batched_stream_resumes_from_its_last_batch_with_no_token_twice() -> None:
    broken = Call([batch(1, [11, 12], "ab")], error=unavailable())
    # the other worker continues from the tokens it was given (a batch it sent before them
    # again would be skipped whole)
    rest = Call([batch(1, [11, 12], "ab"), batch(3, [13, 14, 15], "cde", "length")])
    workers = Workers({"d:1": iter([broken]), "d:2": iter([rest])})
    ids, text, dispatcher = serve(workers, whole=True)
    assert ids == [10, 11, 12, 13, 14, 15] and text == "<abcde"
    assert workers.failed == ["d:1"]
    assert workers.requests == [
        ("d:1", [10], DECODE_BATCH_S),
        ("d:2", [10, 11, 12], DECODE_BATCH_S),
    ]
    assert dispatcher.decode_resumes == 1


def test_a_batch_that_resends_part_of_what_the_router_has_fails_the_request() -> None:
    broken = Call([batch(1, [11, 12], "ab")], error=unavailable())
    overlap = Call([batch(2, [12, 13], "bc"), batch(4, [14, 15], "de", "length")])
    workers = Workers({"d:1": iter([broken]), "d:2": iter([overlap])})
    with pytest.raises(HttpError) as info:
        serve(workers, whole=True)
    assert info.value.kind is ErrorKind.upstream_failed and "resent" in info.value.message


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
    )


@dataclass
class EndingCall(Call):
    """A Decode call whose status arrives after its last event (done from then on), or never
    (`ends=False`: a worker that sent its last event and left the stream open)."""

    ends: bool = True
    ended: bool = False

    def __aiter__(self) -> AsyncIterator[pb.TokenEvent]:
        async def gen() -> AsyncIterator[pb.TokenEvent]:
            for i, event in enumerate(self.events):
                if i == len(self.events) - 1 and self.ends:
                    # the status arrives a moment after the last event
                    asyncio.get_running_loop().call_later(0.01, setattr, self, "ended", True)
                yield event

        return gen()

    def done(self) -> bool:
        return self.ended or self.cancelled

    def cancel(self) -> None:
        if not self.done():  # as grpc.aio: a call that has its status cannot be cancelled
            self.cancelled = True


def finish(call: EndingCall, grace_s: float) -> tuple[bool, bool]:
    """Run a request whose Decode is `call` on a dispatcher with `grace_s`: whether the call was
    cancelled when the run ended, and once the grace has passed."""
    workers = Workers({"d:1": iter([call]), "d:2": iter([])})
    core = RouterCore(build_policy("round_robin"), Admission(), MODEL)
    dispatcher = Dispatcher(
        cast(Registry, workers), StoreLookup(None), core, finished_stream_grace_s=grace_s
    )
    model = SimpleNamespace(model_id="m", scope=None, page_tokens=16, page_bytes=1024)
    job = Job("r", cast(Any, model), PROMPT, pb.SamplingParams(max_tokens=2), 2, whole=True)

    async def run() -> tuple[bool, bool]:
        started = await dispatcher.start(job)
        assert [t.token_id async for t in started.tokens()] == [10, 11]
        at_end = call.cancelled
        await asyncio.sleep(grace_s + 0.05)
        return at_end, call.cancelled

    return asyncio.run(run())


def test_a_finished_decode_stream_is_left_to_end_by_itself() -> None:
    # its last event came, and its status 10 ms later: nothing is cancelled, then or later
    call = EndingCall([batch(1, [11], "a", "length")])
    assert finish(call, grace_s=0.05) == (False, False)
    assert call.ended


def test_a_finished_decode_stream_still_open_after_the_grace_is_cancelled() -> None:
    # the last event came but the worker never ended the stream: cancelled once the grace is
    # over, not when the answer was complete
    call = EndingCall([batch(1, [11], "a", "length")], ends=False)
    assert finish(call, grace_s=0.05) == (False, True)
