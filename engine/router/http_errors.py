"""The one table from the core's `ErrorKind` to an HTTP status and an OpenAI-style error body.

Every error the router answers goes through here, as a JSON response before a stream starts and
as an SSE `data:` event (followed by `data: [DONE]`) once one has: no route picks a status of
its own. Refusals carry `Retry-After` (whole seconds, at least 1).
"""

from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse

from engine.router.core.errors import ErrorKind, RouterError

# kind -> (HTTP status, OpenAI error "type")
STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.invalid_request: (400, "invalid_request_error"),
    ErrorKind.context_length: (400, "invalid_request_error"),
    ErrorKind.unauthorized: (401, "invalid_request_error"),
    ErrorKind.forbidden: (403, "permission_error"),
    ErrorKind.unknown_model: (404, "not_found_error"),
    ErrorKind.rate_limited: (429, "rate_limit_error"),
    ErrorKind.upstream_failed: (502, "api_error"),
    ErrorKind.overloaded: (503, "overloaded_error"),
    ErrorKind.no_worker: (503, "overloaded_error"),
    ErrorKind.internal: (500, "api_error"),
}

# kind -> the OpenAI-style "code"
_CODES: dict[ErrorKind, str] = {
    ErrorKind.context_length: "context_length_exceeded",
    ErrorKind.unauthorized: "invalid_api_key",
    ErrorKind.forbidden: "permission_denied",
    ErrorKind.unknown_model: "model_not_found",
    ErrorKind.rate_limited: "rate_limit_exceeded",
    ErrorKind.no_worker: "no_worker",
    ErrorKind.overloaded: "overloaded",
    ErrorKind.upstream_failed: "upstream_failed",
}


class HttpError(RouterError):
    """A RouterError with an optional Retry-After (seconds) and the parameter at fault."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        retry_after_s: float | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(kind, message)
        self.retry_after_s = retry_after_s
        self.param = param
        self.headers = dict(headers or {})


def status_of(kind: ErrorKind) -> int:
    return STATUS[kind][0]


def error_body(error: RouterError) -> dict[str, object]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    _, kind_type = STATUS[error.kind]
    return {
        "error": {
            "message": error.message,
            "type": kind_type,
            "param": getattr(error, "param", None),
            "code": _CODES.get(error.kind, error.kind.value),
        }
    }


def headers_of(error: RouterError) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) when the error has one, and its own headers."""
    out = dict(getattr(error, "headers", {}))
    retry = getattr(error, "retry_after_s", None)
    if retry is not None:
        out["Retry-After"] = str(max(1, math.ceil(retry)))
    return out


def error_response(error: RouterError) -> JSONResponse:
    """The JSON response of `error`, with its status and headers."""
    return JSONResponse(
        error_body(error), status_code=status_of(error.kind), headers=headers_of(error)
    )


def sse_error(error: RouterError) -> str:
    """`error` as the SSE events of a stream that ends with it."""
    return f"data: {json.dumps(error_body(error))}\n\ndata: [DONE]\n\n"
