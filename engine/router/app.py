"""The router's HTTP edge: thin FastAPI routes over `RouterService` (OpenAI-compatible).

POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text), GET /debug/decisions (the latest decisions with
each candidate's predicted cost and why it lost), GET /debug/workers (the registry: source,
liveness, report age, last error) and FastAPI's GET /openapi.json. Every error,
the framework's own validation errors included, goes through `http_errors` (one table).
With API keys (engine.router.tenancy) the /v1 routes need `Authorization: Bearer KEY` (or
`x-api-key`) and /debug needs a key marked `debug`; /health and /metrics stay open.
Responses to a placed request carry `x-strata-prefill`, `x-strata-decode`, `x-strata-policy`,
`x-strata-hit-tokens`, `x-strata-predicted-ttft-ms`, `x-strata-predicted-tpot-ms` and
`x-request-id`.

`create_asgi` is what the server runs: the two completion routes answered by
`engine.router.completions.CompletionsFront` before Starlette sees them (the same handler the
FastAPI routes here declare and call), everything else by this app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.router.completions import CompletionsFront, complete, invalid_body
from engine.router.core.errors import ErrorKind, RouterError
from engine.router.http_errors import error_body, error_response
from engine.router.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from engine.router.service import SLO_HEADER, RouterService
from engine.router.tenancy import Grant

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "malformed body, bad field value, or a prompt past the context"),
        (401, "no API key, or a wrong one (when the router enforces keys)"),
        (403, "the API key may not use the SLO class"),
        (404, "unknown model"),
        (429, "refused by admission, or past the API key's rate limits (Retry-After)"),
        (503, "no worker can serve (Retry-After)"),
    )
}


async def caller(request: Request) -> Grant:
    """The request's API key (401 without a valid one when keys are enforced). Module level, so
    the routes' string annotations resolve it."""
    service: RouterService = request.app.state.service
    headers = request.headers
    return service.tenancy.authenticate(headers.get("authorization"), headers.get("x-api-key"))


async def debug_caller(request: Request, grant: Annotated[Grant, Depends(caller)]) -> Grant:
    """A caller that may read /debug (403 otherwise)."""
    service: RouterService = request.app.state.service
    service.tenancy.check_debug(grant)
    return grant


_REQUESTS = (CompletionRequest, ChatCompletionRequest)


def _body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body (`model`, in the components) and the SLO class header of a
    route that parses its body itself."""
    return {
        "parameters": [
            {
                "name": SLO_HEADER,
                "in": "header",
                "required": False,
                "schema": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "description": "the request's SLO class (else the body's slo_class, else the "
                "default class)",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        },
    }


def _with_request_schemas(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` with the request models (and the models they use) in the components."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = make()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _REQUESTS:
                own = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in own.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components[model.__name__] = own
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def create_asgi(
    service: RouterService, *, on_ready: Callable[[], None] | None = None
) -> CompletionsFront:
    """What the server runs: `CompletionsFront` (the two completion routes) over `create_app`."""
    return CompletionsFront(create_app(service, on_ready=on_ready), service)


def create_app(service: RouterService, *, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app over `service`; the service starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="Strata router",
        version="1",
        description="OpenAI-compatible completions over Strata's prefill and decode workers.",
        lifespan=lifespan,
    )
    app.state.service = service

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        service.metrics.observe_error(exc.kind.value)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        service.metrics.observe_error(ErrorKind.invalid_request.value)
        return error_response(invalid_body(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorKind.unknown_model if exc.status_code == 404 else ErrorKind.invalid_request
        body = error_body(RouterError(kind, str(exc.detail)))
        return JSONResponse(body, status_code=exc.status_code)

    # The two completion routes read their body themselves (pydantic's own JSON parser, no
    # dependency solving), through `complete`: their OpenAPI entries are written out
    # (`_body_openapi`), the same as FastAPI would have made them. In `strata router` these
    # declarations only publish the schema and serve an app run without its front:
    # `CompletionsFront` answers the two paths before Starlette sees them.
    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=ERRORS,
        openapi_extra=_body_openapi(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=ERRORS,
        openapi_extra=_body_openapi(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def _complete(request: Request, *, chat: bool) -> Response:
        headers = request.headers
        return await complete(
            service,
            chat=chat,
            raw=await request.body(),
            authorization=headers.get("authorization"),
            x_api_key=headers.get("x-api-key"),
            slo_header=headers.get(SLO_HEADER),
        )

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(caller)])
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=m.model_id, created=m.created, max_model_len=m.max_context)
                for m in service.registry.models.values()
            ]
        )

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        counts = service.registry.counts()
        serving = counts["colocated"] > 0 or (counts["prefill"] > 0 and counts["decode"] > 0)
        status: Literal["ok", "degraded", "unavailable"] = (
            "ok" if serving else ("degraded" if sum(counts.values()) else "unavailable")
        )
        body = Health(
            status=status,
            workers=sum(counts.values()),
            prefill=counts["prefill"],
            decode=counts["decode"],
            colocated=counts["colocated"],
            models=sorted(service.registry.models),
        )
        return JSONResponse(body.model_dump(), status_code=200 if serving else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        data, content_type = service.metrics.render()
        return Response(content=data, media_type=content_type)

    @app.get("/debug/decisions", dependencies=[Depends(debug_caller)])
    async def decisions(limit: int = 50) -> JSONResponse:
        records = list(service.dispatcher.decisions)[-max(1, min(limit, 1000)) :]
        return JSONResponse({"decisions": [r.as_dict() for r in records]})

    @app.get("/debug/workers", dependencies=[Depends(debug_caller)])
    async def workers() -> JSONResponse:
        now = service.registry.clock()
        live = {h.address for h in service.registry.live(now)}
        items = []
        for h in service.registry.workers.values():
            d = h.description
            items.append(
                {
                    "address": h.address,
                    "source": h.source,
                    "live": h.address in live,
                    "role": d.role if d is not None else "",
                    "model": d.model_id if d is not None else "",
                    "report_age_s": round(now - h.report_at, 3) if h.report is not None else None,
                    "last_error": h.last_error,
                }
            )
        return JSONResponse({"workers": items})

    app.openapi = _with_request_schemas(app)  # type: ignore[method-assign]
    return app
