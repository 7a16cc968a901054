"""The OpenAI response shapes of one run, streamed (SSE) or whole, encoded once, as bytes.

`sse_events(...)` turns a run's tokens into `data: {chunk}` events — text completion chunks or
chat completion chunks (the first carries the assistant role), a final chunk with the finish
reason (and `strata_timings`: the workers' latency split in ms, see `Run.timings`), a usage
chunk when `stream_options.include_usage` asked for it — and `data: [DONE]`. A token's chunk is
a pre-encoded head and tail around the token's JSON-escaped text (`ChunkFormat`): the parts that
do not change within a response are encoded once per response, not once per token.
An error after the stream started is sent as an error event (the one table in `http_errors`),
then `[DONE]`.

`EventStream` is the ASGI response that sends those events: it takes the first event before it
starts the response, so the status line, the headers and the first token leave in one burst of
writes (the client reads them together), and it watches for the client's disconnect itself (one
task; a disconnect cancels the stream, and so the worker's decode).

`collect(...)` drains a run for a non-streamed answer, and `completion_body(...)` encodes that
answer, with the same `strata_timings` as the streamed one's last chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.router.core.errors import RouterError
from engine.router.dispatch import Run
from engine.router.http_errors import sse_error

DONE = b"data: [DONE]\n\n"


@dataclass
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


def usage_of(run: Run) -> dict[str, object]:
    """The OpenAI `usage` object of `run` (prompt, completion and cached tokens)."""
    prompt = len(run.job.prompt_ids)
    completion = len(run.produced)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
    }


async def collect(run: Run) -> Collected:
    """Every token of `run` (raises the run's HttpError)."""
    out = Collected()
    pieces: list[str] = []
    async for token in run.tokens():
        pieces.append(token.text)
        if token.token_id is not None:
            out.token_ids.append(token.token_id)
        if token.finish_reason:
            out.finish_reason = token.finish_reason
    out.text = "".join(pieces)
    return out


def _json(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def completion_body(
    run: Run,
    got: Collected,
    *,
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    token_ids: bool,
) -> bytes:
    """The non-streamed response of `run` (a text or chat completion) as JSON bytes, with
    `strata_timings` (the latency split, as the streamed answer's last chunk has it)."""
    choice: dict[str, object] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": got.text}
    else:
        choice["text"] = got.text
    choice["finish_reason"] = got.finish_reason or None
    choice["logprobs"] = None
    if token_ids:
        choice["token_ids"] = got.token_ids
    body = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_of(run),
        "strata_timings": run.timings(),
    }
    return _json(body).encode()


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """The constant parts of one response's chunks, encoded once: a token's chunk is
    `head + json(text) + tail` (the first chat chunk's tail also names the assistant role)."""

    chat: bool
    response_id: str
    created: int
    model: str
    include_usage: bool
    head: bytes
    tail: bytes
    first_tail: bytes
    end: bytes

    @classmethod
    def of(
        cls, *, chat: bool, response_id: str, created: int, model: str, include_usage: bool
    ) -> ChunkFormat:
        kind = "chat.completion.chunk" if chat else "text_completion"
        envelope = (
            f'data: {{"id":{_json(response_id)},"object":"{kind}","created":{int(created)},'
            f'"model":{_json(model)},"choices":[{{"index":0,'
        )
        close = ',"finish_reason":null,"logprobs":null'
        end = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"
        if chat:
            head = envelope + '"delta":{"content":'
            tail, first_tail = "}" + close, ',"role":"assistant"}' + close
        else:
            head = envelope + '"text":'
            tail = first_tail = close
        return cls(
            chat, response_id, created, model, include_usage,
            head.encode(), tail.encode(), first_tail.encode(), end.encode(),
        )  # fmt: skip

    def token(self, text: str, token_id: int | None, *, first: bool) -> bytes:
        """The chunk of one token; `token_id` is given when the request asked for the ids."""
        ids = b"" if token_id is None else b',"token_ids":[%d]' % token_id
        tail = self.first_tail if first else self.tail
        return b"".join((self.head, _json(text).encode(), tail, ids, self.end))

    def _chunk(self, choices: list[dict[str, object]], **extra: object) -> bytes:
        body: dict[str, object] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {_json(body)}\n\n".encode()

    def finish(
        self, reason: str, *, first: bool, token_ids: bool, timings: Mapping[str, float]
    ) -> bytes:
        """The last chunk: the finish reason and the latency split (`strata_timings`)."""
        choice: dict[str, object] = {"index": 0}
        if self.chat:
            delta: dict[str, object] = {"content": ""}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = ""
        choice["finish_reason"] = reason
        choice["logprobs"] = None
        if token_ids:
            choice["token_ids"] = []
        extra: dict[str, object] = {"usage": None} if self.include_usage else {}
        return self._chunk([choice], **extra, strata_timings=dict(timings))

    def usage(self, usage: dict[str, object]) -> bytes:
        """The usage chunk (`stream_options.include_usage`): no choices."""
        return self._chunk([], usage=usage)


async def sse_events(
    run: Run,
    *,
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    include_usage: bool,
    token_ids: bool,
) -> AsyncGenerator[bytes, None]:
    """The SSE stream of `run`, ending with `data: [DONE]`."""
    fmt = ChunkFormat.of(
        chat=chat,
        response_id=response_id,
        created=created,
        model=model,
        include_usage=include_usage,
    )
    first = True
    try:
        async for token in run.tokens():
            if token.token_id is not None or token.text:
                ids = token.token_id if token_ids else None
                yield fmt.token(token.text, ids, first=first)
                first = False
            if token.finish_reason:
                # the workers' latency split rides on the last chunk (clients ignore the field)
                yield fmt.finish(
                    token.finish_reason, first=first, token_ids=token_ids, timings=run.timings()
                )
                first = False
        if include_usage:
            yield fmt.usage(usage_of(run))
        yield DONE
    except RouterError as exc:
        yield sse_error(exc).encode()


class EventStream(Response):
    """A `text/event-stream` response over `events` (bytes). The first event is taken before
    the response starts, so the headers and the first token go out together; a client that
    disconnects cancels the stream (the events' generator closes, and with it the run)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.create_task(watch(), name="strata-sse-disconnect")
        events = self.events
        try:
            first = await anext(events, DONE)
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            if first is not DONE:
                async for event in events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client went away: nothing to send, nothing to raise
        finally:
            watcher.cancel()
            await events.aclose()
