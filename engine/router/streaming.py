"""The OpenAI response shapes of one run, streamed (SSE) or whole.

`sse_events(...)` turns a run's tokens into `data: {chunk}` events — text completion chunks or
chat completion chunks (the first carries the assistant role), a final chunk with the finish
reason (and `strata_timings`: the workers' latency split in ms, see `Run.timings`), a usage
chunk when `stream_options.include_usage` asked for it — and `data: [DONE]`.
An error after the stream started is sent as an error event (the one table in `http_errors`),
then `[DONE]`. `collect(...)` drains a run for a non-streamed answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.router.core.errors import RouterError
from engine.router.dispatch import Run
from engine.router.http_errors import sse_error
from engine.router.protocol import PromptTokensDetails, Usage


@dataclass
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


def usage_of(run: Run) -> Usage:
    prompt = len(run.job.prompt_ids)
    completion = len(run.produced)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=run.cached_tokens),
    )


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


def _event(obj: dict[str, object]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_events(
    run: Run,
    *,
    chat: bool,
    response_id: str,
    created: int,
    model: str,
    include_usage: bool,
    token_ids: bool,
) -> AsyncIterator[str]:
    """The SSE stream of `run`, ending with `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        text: str,
        finish: str | None,
        ids: list[int] | None,
        first: bool,
        timings: dict[str, float] | None = None,
    ) -> str:
        choice: dict[str, object]
        if chat:
            delta: dict[str, object] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if ids is not None:
            choice["token_ids"] = ids
        body: dict[str, object] = {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        if timings is not None:
            body["strata_timings"] = timings
        return _event(body)

    first = True
    try:
        async for token in run.tokens():
            ids = [token.token_id] if token_ids and token.token_id is not None else None
            if token.token_id is not None or token.text:
                yield chunk(token.text, None, ids if token_ids else None, first)
                first = False
            if token.finish_reason:
                # the workers' latency split rides on the last chunk (clients ignore the field)
                yield chunk(
                    "", token.finish_reason, [] if token_ids else None, first, run.timings()
                )
                first = False
        if include_usage:
            yield _event(
                {
                    "id": response_id,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage_of(run).model_dump(),
                }
            )
        yield "data: [DONE]\n\n"
    except RouterError as exc:
        yield sse_error(exc)
