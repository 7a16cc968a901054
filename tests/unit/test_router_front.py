"""The completion routes' raw ASGI front (`engine.router.completions.CompletionsFront`) and the
dispatcher's bookkeeping left to after the answer: driven in-process, no server, no workers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from engine.router.completions import (
    ClientGone,
    CompletionsFront,
    _collect_while_connected,
    invalid_body,
)
from engine.router.core.admission import Admission
from engine.router.core.errors import ErrorKind
from engine.router.core.policies import build_policy
from engine.router.core.router import RouterCore
from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel
from engine.router.core.types import Placement
from engine.router.dispatch import Dispatcher, Job, Run, Token
from engine.router.http_errors import HttpError
from engine.router.lookup import StoreLookup
from engine.router.metrics import FinishedRequest
from engine.router.protocol import CompletionRequest
from engine.router.registry import Registry
from engine.router.service import RouterService

pytestmark = pytest.mark.unit


@dataclass
class Metrics:
    errors: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)

    def observe_error(self, kind: str) -> None:
        self.errors.append(kind)

    def observe_finished(self, done: FinishedRequest, *, now: float) -> None:
        self.finished.append(done)


@dataclass
class Tenancy:
    """Refuses every caller with `error` (the front's error paths; nothing is dispatched)."""

    error: Exception

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> object:
        raise self.error


@dataclass
class Service:
    tenancy: Tenancy
    metrics: Metrics = field(default_factory=Metrics)
    # the front stamps a request's receipt on the dispatcher's clock
    dispatcher: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(clock=lambda: 1.0))


@dataclass
class Inner:
    """The app behind the front: records what reaches it and answers 204."""

    seen: list[tuple[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers or [(b"content-type", b"application/json")],
        "query_string": b"",
    }


async def _call(
    front: CompletionsFront, scope: Scope, chunks: list[bytes], *, gone: bool = False
) -> tuple[int | None, dict[str, str], bytes]:
    """Send `chunks` as the body (or a disconnect first when `gone`); the status, headers and
    body the front answered (None: it sent nothing)."""
    messages: list[Message] = (
        [{"type": "http.disconnect"}]
        if gone
        else [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
    )

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await front(scope, receive, send)
    if not sent:
        return None, {}, b""
    head = sent[0]
    headers = {k.decode(): v.decode() for k, v in head.get("headers", [])}
    return head["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def _front(error: Exception) -> tuple[CompletionsFront, Inner, Service]:
    inner, service = Inner(), Service(Tenancy(error))
    return CompletionsFront(inner, cast(RouterService, service)), inner, service


def test_the_front_answers_only_posts_to_the_completion_paths() -> None:
    front, inner, service = _front(HttpError(ErrorKind.unauthorized, "no API key"))
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()

    async def run() -> list[int | None]:
        statuses = []
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/completions"),  # another method: the app's (405 there)
            ("POST", "/v1/completions/"),  # another path: the app's
            ("GET", "/health"),
        ):
            status, _, _ = await _call(front, _scope(method, path), [body])
            statuses.append(status)
        return statuses

    statuses = asyncio.run(run())
    assert statuses == [401, 400, 204, 204, 204]  # the chat body lacks `messages`: 400
    assert inner.seen == [
        ("GET", "/v1/completions"),
        ("POST", "/v1/completions/"),
        ("GET", "/health"),
    ]
    assert front.served == 2
    assert service.metrics.errors == ["unauthorized", "invalid_request"]


def test_a_body_in_several_messages_is_read_whole_and_errors_are_openai_json() -> None:
    front, _, service = _front(
        HttpError(ErrorKind.rate_limited, "slow down", retry_after_s=2.5, headers={"x-a": "1"})
    )
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3}).encode()
    status, headers, raw = asyncio.run(
        _call(front, _scope("POST", "/v1/completions"), [body[:7], body[7:20], body[20:]])
    )
    assert status == 429  # parsed whole (else a 400), then refused by the caller's key
    assert headers["retry-after"] == "3" and headers["x-a"] == "1"
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert error["type"] == "rate_limit_error" and error["message"] == "slow down"
    assert service.metrics.errors == ["rate_limited"]


def test_a_malformed_body_is_a_400_naming_the_field() -> None:
    front, _, _ = _front(AssertionError("not reached: the body fails first"))

    async def run() -> list[tuple[int | None, dict[str, Any]]]:
        out = []
        for raw in (b"{not json", json.dumps({"model": "m", "prompt": "x", "max_tokens": "many"})):
            body = raw if isinstance(raw, bytes) else raw.encode()
            status, _, answer = await _call(front, _scope("POST", "/v1/completions"), [body])
            out.append((status, json.loads(answer)["error"]))
        return out

    (bad_json, bad_field) = asyncio.run(run())
    assert bad_json[0] == 400 and bad_json[1]["code"] == "invalid_request"
    assert bad_field[0] == 400 and bad_field[1]["param"] == "max_tokens"
    assert bad_field[1]["message"].startswith("max_tokens: ")


def test_an_unexpected_exception_is_a_500_and_the_front_keeps_serving() -> None:
    front, _, service = _front(RuntimeError("a bug"))
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()

    async def run() -> list[int | None]:
        return [(await _call(front, _scope("POST", "/v1/completions"), [body]))[0] for _ in "ab"]

    assert asyncio.run(run()) == [500, 500]
    assert service.metrics.errors == ["internal", "internal"]


def test_a_client_gone_before_its_body_gets_no_answer() -> None:
    front, _, service = _front(AssertionError("not reached"))
    status, _, _ = asyncio.run(_call(front, _scope("POST", "/v1/completions"), [], gone=True))
    assert status is None
    assert front.served == 0 and service.metrics.errors == []


def test_invalid_body_names_the_first_error_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b'{"model": "m", "prompt": "x", "top_k": "x"}')
    error = invalid_body(info.value.errors(include_url=False))
    assert error.kind is ErrorKind.invalid_request and error.param == "top_k"
    assert invalid_body([]).message == "invalid"


def test_a_finished_run_is_released_at_once_and_recorded_on_the_next_loop_turn() -> None:
    """`on_finish` frees the run's bookkeeping before it returns (the next decision sees it) and
    leaves its metrics to the loop's next turn, after the answer's bytes are written."""
    model = TimeModel(PrefillCoeffs(0.01, 0, 0, 0), DecodeCoeffs(0.01, 0, 0))
    core = RouterCore(build_policy("round_robin"), Admission(), model)
    metrics = Metrics()
    dispatcher = Dispatcher(Registry(), StoreLookup(None), core, metrics=cast(Any, metrics))
    done: list[str] = []
    dispatcher.on_done.append(lambda run: done.append(run.job.request_id))
    job = Job("r1", cast(Any, None), (1, 2, 3), cast(Any, None), 4, "default")
    run = Run(job, Placement("p:1", "d:1", 0.1, 0.01, "round_robin"), dispatcher, 0.0, "p:1", "d:1")
    run.finish_reason, run.produced = "length", [7, 8, 9, 10]
    run.first_token_at, run.last_token_at = 0.05, 0.08

    async def finish() -> tuple[bool, list[str], int, int]:
        dispatcher.in_flight["r1"] = run
        await run.close()
        at_once = ("r1" in dispatcher.in_flight, list(done), len(metrics.finished))
        await asyncio.sleep(0)  # one loop turn
        return (*at_once, len(metrics.finished))

    in_flight, hooks, recorded_at_once, recorded_after = asyncio.run(finish())
    assert not in_flight and hooks == ["r1"]
    assert recorded_at_once == 0 and recorded_after == 1
    assert metrics.finished[0].output_tokens == 4 and metrics.finished[0].outcome == "ok"


def test_without_a_running_loop_a_finished_run_is_recorded_at_once() -> None:
    model = TimeModel(PrefillCoeffs(0.01, 0, 0, 0), DecodeCoeffs(0.01, 0, 0))
    metrics = Metrics()
    core = RouterCore(build_policy("round_robin"), Admission(), model)
    dispatcher = Dispatcher(Registry(), StoreLookup(None), core, metrics=cast(Any, metrics))
    job = Job("r2", cast(Any, None), (1,), cast(Any, None), 1, "default")
    run = Run(job, Placement("p:1", "d:1", 0.1, 0.01, "round_robin"), dispatcher, 0.0, "p:1", "d:1")
    dispatcher.in_flight["r2"] = run
    dispatcher.on_finish(run)  # cancelled (no finish reason)
    assert [f.outcome for f in metrics.finished] == ["cancelled"]


@dataclass
class SlowRun:
    """A run for `collect`: one token, then (unless `finishes`) nothing until cancelled."""

    finishes: bool
    closed: int = 0

    async def tokens(self) -> Any:
        try:
            yield Token(0, 7, "a")
            if self.finishes:
                yield Token(1, 8, "b", "length")
                return
            await asyncio.Event().wait()  # a decode that never ends by itself
        finally:
            await self.close()

    async def close(self) -> None:
        self.closed += 1


def test_a_client_that_leaves_while_its_whole_answer_is_collected_cancels_the_run() -> None:
    async def run(finishes: bool, leave: bool) -> tuple[object, int, int]:
        left = asyncio.Event()

        async def receive() -> Message:
            if leave:
                await asyncio.sleep(0.01)
                left.set()
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()  # the client stays
            raise AssertionError

        fake = SlowRun(finishes)
        before = len(asyncio.all_tasks())
        try:
            got: object = await _collect_while_connected(cast(Run, fake), receive)
        except ClientGone:
            got = ClientGone
        await asyncio.sleep(0)  # the watcher's cancellation lands
        return got, fake.closed, len(asyncio.all_tasks()) - before

    # the answer is complete while the client stays: it is returned, the watcher is gone
    got, closed, tasks_left = asyncio.run(run(finishes=True, leave=False))
    assert getattr(got, "token_ids", None) == [7, 8] and getattr(got, "text", "") == "ab"
    assert getattr(got, "finish_reason", "") == "length"
    assert closed == 1 and tasks_left == 0
    # the client leaves mid-answer: the run is closed (its decode cancelled) and ClientGone
    got, closed, tasks_left = asyncio.run(run(finishes=False, leave=True))
    assert got is ClientGone and closed >= 1 and tasks_left == 0
