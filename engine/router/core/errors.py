"""The router's one neutral error vocabulary.

The core and the shell raise or return these kinds; the HTTP shell maps each to a status code and
an OpenAI-style error body in a single table (for JSON responses and SSE streams alike), so no
route invents its own status.
"""

from __future__ import annotations

from enum import StrEnum

from engine.router.core.types import RefusalReason


class ErrorKind(StrEnum):
    invalid_request = "invalid_request"  # malformed body, bad field value (400)
    unknown_model = "unknown_model"  # the model is not served here (404)
    context_length = "context_length"  # prompt + max_tokens past the model's context (400)
    unauthorized = "unauthorized"  # missing or unknown API key (401)
    forbidden = "forbidden"  # the key may not do this (an SLO class it is not allowed) (403)
    rate_limited = "rate_limited"  # admission refused: SLO, class share or tenant limit (429)
    overloaded = "overloaded"  # workers exist but none can take more now (503)
    no_worker = "no_worker"  # no healthy worker for the model (503)
    upstream_failed = "upstream_failed"  # a worker failed and no retry could recover (502)
    internal = "internal"  # a bug (500)


class RouterError(Exception):
    """An error the shell turns into an HTTP response through its one table."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class UnknownSloClass(RouterError):
    """A request named an SLO class the configuration does not have."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(
            ErrorKind.invalid_request,
            f"unknown SLO class {name!r} (known: {', '.join(known)})",
        )
        self.name = name


def error_kind_of(reason: RefusalReason) -> ErrorKind:
    """The error kind of a refusal: no worker is a 503, every other refusal a 429."""
    if reason is RefusalReason.no_worker:
        return ErrorKind.no_worker
    return ErrorKind.rate_limited
