"""The Starlette application: routes, error handling and the engine worker's lifetime.

Routes: `GET /health`, `GET /metrics`, `GET /v1/models[/NAME]`, `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/responses`, `POST /v1/messages`, `POST /v1/messages/count_tokens`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from dwarfstar.serving.anthropic import count_tokens, messages_endpoint
from dwarfstar.serving.errors import ApiError, Dialect, error_response, json_response
from dwarfstar.serving.gate import Gate, dialect_of
from dwarfstar.serving.metrics import Metric
from dwarfstar.serving.openai_chat import chat_completions
from dwarfstar.serving.openai_completions import completions
from dwarfstar.serving.responses import responses_endpoint
from dwarfstar.serving.service import Service
from dwarfstar.serving.sse import ClientGone

log = logging.getLogger(__name__)


def _service(request: Request) -> Service:
    return request.app.state.service


async def health(request: Request) -> Response:
    service = _service(request)
    return json_response({"status": "ok", "model": service.models.id, "backend": service.engine.backend_name})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(_service(request).metrics.render(), media_type="text/plain; version=0.0.4")


async def list_models(request: Request) -> Response:
    models = _service(request).models
    if dialect_of(request.url.path, request.headers) is Dialect.ANTHROPIC:
        data = [models.anthropic_object(models.id)]
        return json_response({"data": data, "has_more": False, "first_id": models.id, "last_id": models.id})
    return json_response({"object": "list", "data": [models.openai_object(models.id)]})


async def get_model(request: Request) -> Response:
    models = _service(request).models
    name = request.path_params["name"]
    if not models.knows(name):
        raise ApiError(404, f"model {name!r} not found", param="model", code="model_not_found")
    if dialect_of(request.url.path, request.headers) is Dialect.ANTHROPIC:
        return json_response(models.anthropic_object(name))
    return json_response(models.openai_object(name))


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    _service(request).metrics.inc(Metric.REJECTED_REQUESTS_TOTAL, status=str(exc.status))
    return error_response(exc, dialect_of(request.url.path, request.headers))


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = "unknown endpoint" if exc.status_code == 404 else exc.detail
    return await api_error(request, ApiError(exc.status_code, message))


async def client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; the job was cancelled


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    error = ApiError(500, f"internal server error: {type(exc).__name__}")
    return error_response(error, dialect_of(request.url.path, request.headers))


# An idle keep-alive connection is closed after this long. Clients drop theirs after their own expiry
# (httpx and the OpenAI/Anthropic SDKs: 5 s, Node: 4-5 s); a server that closes at the same moment
# races their next request, which then dies with a connection reset (uvicorn's default is 5 s).
KEEP_ALIVE_SECONDS = 75


def create_app(service: Service) -> ASGIApp:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{name:path}", get_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses_endpoint, methods=["POST"]),
        Route("/v1/messages", messages_endpoint, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
    handlers = {ApiError: api_error, HTTPException: http_error, ClientGone: client_gone, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.service = service
    return Gate(app, api_key=service.config.api_key, cors=service.config.cors)
