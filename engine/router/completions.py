"""The two completion routes (`POST /v1/completions`, `POST /v1/chat/completions`): one handler,
and `CompletionsFront`, the raw ASGI app that serves them in front of the FastAPI app.

`complete(...)` is a whole completion from the request's bytes: the body parsed with pydantic's
own JSON parser, the caller's key checked, the request prepared and dispatched, then answered as
an SSE stream (`EventStream`) or in full. Every error is a `RouterError` (a malformed body is
`invalid_body`'s `HttpError`), answered through `http_errors` like every other route's.

`CompletionsFront` is what uvicorn runs. For exactly those two paths with POST it reads the body
off `receive` and sends the answer itself: no Starlette middleware stack, router, `Request`
object or exception middleware, which together cost a request about as much CPU as its parsing,
tokenizing and deciding. Everything else — the lifespan (the service's start and stop), the
other routes, another method or a trailing slash on those paths — goes to the FastAPI app
unchanged, which still declares the two routes (over the same `complete`), so the OpenAPI
document and what schemathesis checks stay as they were. An unexpected exception before the
answer starts is logged and answered as a 500 OpenAI-style error; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.router.core.errors import ErrorKind, RouterError
from engine.router.core.router import headers as placement_headers
from engine.router.dispatch import Run
from engine.router.http_errors import HttpError, error_response
from engine.router.protocol import ChatCompletionRequest, CompletionRequest
from engine.router.service import SLO_HEADER, RouterService
from engine.router.streaming import (
    Collected,
    EventStream,
    collect,
    completion_body,
    sse_events,
)

log = logging.getLogger(__name__)

# path -> chat?
PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
_WANTED = {b"authorization", b"x-api-key", SLO_HEADER.encode()}


def invalid_body(errors: list[ErrorDetails] | list[dict[str, object]]) -> HttpError:
    """The 400 of a body that failed validation: the first error's field and message (the same
    for FastAPI's own validation errors, through the app's handler)."""
    first: Mapping[str, object] = errors[0] if errors else {}
    loc = first.get("loc", ())
    where = ".".join(str(p) for p in loc if p != "body") if isinstance(loc, tuple | list) else ""
    msg = first.get("msg", "invalid")
    message = f"{where}: {msg}" if where else str(msg)
    return HttpError(ErrorKind.invalid_request, message, param=where or None)


def placement_headers_of(run: Run) -> dict[str, str]:
    """The core's `x-strata-*` headers of the placement (workers, policy, predictions, hit
    tokens), with the workers the run is on, and the request id."""
    return {
        "x-request-id": run.job.request_id,
        **placement_headers(run.placement),
        "x-strata-prefill": run.prefill_id,
        "x-strata-decode": run.decode_id,
    }


async def complete(
    service: RouterService,
    *,
    chat: bool,
    raw: bytes,
    authorization: str | None,
    x_api_key: str | None,
    slo_header: str | None,
    received_at: float = 0.0,
    receive: Receive | None = None,
) -> Response:
    """One completion from its body's bytes and headers: dispatched, then the SSE stream or the
    whole answer. `received_at`: when the request arrived, on the dispatcher's clock (0: now).
    `receive`: the request's ASGI receive, its body already read; while a whole answer is being
    collected it is watched, and a client that disconnects cancels the run (its decode stops
    and the worker frees its pages) and raises ClientGone.
    Raises RouterError (HttpError) for anything the caller is to be told."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        body: CompletionRequest | ChatCompletionRequest = model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_body(exc.errors(include_url=False)) from None
    grant = service.tenancy.authenticate(authorization, x_api_key)
    prepared = service.prepare(
        body, slo_header, grant, received_at=received_at or service.dispatcher.clock()
    )
    run = await service.dispatch(prepared)
    name = prepared.job.model.model_id
    if body.stream:
        headers = placement_headers_of(run)
        include = bool(body.stream_options and body.stream_options.include_usage)
        events = sse_events(
            run,
            chat=chat,
            response_id=prepared.response_id,
            created=prepared.created,
            model=name,
            include_usage=include,
            token_ids=body.return_token_ids,
        )
        # the response starts the events in this task, before it first waits: the run's own
        # cleanup (closing its open Decode) is in place from there on
        return EventStream(events, headers)
    got = await collect(run) if receive is None else await _collect_while_connected(run, receive)
    headers = placement_headers_of(run)  # after the answer: the decode worker that finished it
    content = completion_body(
        run,
        got,
        chat=chat,
        response_id=prepared.response_id,
        created=prepared.created,
        model=name,
        token_ids=body.return_token_ids,
    )
    return Response(content, media_type="application/json", headers=headers)


class ClientGone(Exception):
    """The client disconnected before its whole answer was ready; its run was cancelled."""


async def _collect_while_connected(run: Run, receive: Receive) -> Collected:
    """`collect(run)` in this task, unless the client disconnects first: then the run is closed
    (its Decode cancelled, counted as cancelled) and ClientGone raised. One watcher task reads
    `receive` and cancels this one on a disconnect (as `EventStream` does): the answer is
    collected where it is sent, with no task of its own to wait for (one task and one loop turn
    less at the end of every whole answer)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch(), name="strata-disconnect")
    try:
        got = await collect(run)
    except asyncio.CancelledError:
        if not gone:
            raise  # this task was cancelled (the server stops): the run's stream closed itself
        task.uncancel()
        await run.close()
        raise ClientGone from None
    finally:
        watcher.cancel()
    if gone:  # the client went away as its answer completed: nothing to send it
        await run.close()
        raise ClientGone
    return got


class CompletionsFront:
    """The ASGI app in front of `app` (see the module doc)."""

    def __init__(self, app: ASGIApp, service: RouterService) -> None:
        self.app = app
        self.service = service
        self.served = 0  # requests this front answered itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        received_at = self.service.dispatcher.clock()  # its TTFT counts from here
        raw = await _body(receive)
        if raw is None:
            return  # the client went away before its body was in
        self.served += 1
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in _WANTED and name not in found:
                found[name] = value.decode("latin-1")
        try:
            response = await complete(
                self.service,
                chat=chat,
                raw=raw,
                authorization=found.get(b"authorization"),
                x_api_key=found.get(b"x-api-key"),
                slo_header=found.get(_SLO),
                received_at=received_at,
                receive=receive,
            )
        except ClientGone:
            return  # nothing to answer: the run is cancelled and counted
        except RouterError as exc:
            self.service.metrics.observe_error(exc.kind.value)
            response = error_response(exc)
        except Exception:
            log.exception("%s failed before its answer started", scope["path"])
            self.service.metrics.observe_error(ErrorKind.internal.value)
            response = error_response(RouterError(ErrorKind.internal, "internal error"))
        await response(scope, receive, send)


_SLO = SLO_HEADER.encode()


async def _body(receive: Receive) -> bytes | None:
    """The request's body from `receive`'s messages; None when the client disconnected first."""
    parts: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)
