"""Pydantic models of the OpenAI API subset the router serves (requests and responses).

Only what a route parses or returns is modelled. Unknown request fields are ignored (clients
send fields of newer API versions); a known field with a value the router cannot honour is a
validation error (HTTP 400): `n` other than 1, a negative temperature, `top_p` outside (0, 1],
a `stop` that is neither a string nor a list of strings, more than 16 stop strings,
`stream_options` on a request that does not stream (as OpenAI and vLLM refuse it), a chat role
outside system/user/assistant/tool/developer. Strata's extensions: `slo_class` (also the `x-strata-slo-class`
header), `top_k`, `ignore_eos` and `return_token_ids` (the token ids in each choice, for tests
and tools that must compare tokens). `cache_salt` (as vLLM accepts it) keys the request's pages
in a namespace of their own within the caller's: requests with different salts share no page.
Nothing a request sends chooses its namespace: the API key does (engine.router.tenancy).

Imports pydantic only (nothing heavy).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 16
MAX_STOP_CHARS = 256


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The sampling and stopping fields both endpoints share."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] | None = None
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    slo_class: str | None = Field(default=None, max_length=128)
    return_token_ids: bool = False
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for item in items:
            if not item or len(item) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt` is text or a list of token ids."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0, lt=1 << 32)]], Field(min_length=1)]
    )


class TextPart(_Request):
    type: Literal["text"]
    text: str = Field(max_length=1 << 24)


class ChatMessage(_Request):
    """A message; `content` is text, or a list of text parts (joined), as clients send it."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str, Field(max_length=1 << 24)] | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None


# ---- responses ----------------------------------------------------------------------------

TIMINGS = (
    "Strata: where the request's time went, in ms, as the workers report it (prefill queue, "
    "lookup, KV pull, compute, sampling, publish wait; decode queue and KV pull) and the "
    "decode stream's own time (decode_ms). The last chunk of a streamed answer carries the "
    "same object."
)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    strata_timings: dict[str, float] | None = Field(default=None, description=TIMINGS)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    strata_timings: dict[str, float] | None = Field(default=None, description=TIMINGS)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    workers: int
    prefill: int
    decode: int
    colocated: int
    models: list[str]
