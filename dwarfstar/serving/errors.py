"""Client-visible errors, written in the shape of the API the client speaks.

OpenAI (chat, completions, Responses): `{"error": {"message", "type", "param", "code"}}`.
Anthropic: `{"type": "error", "error": {"type", "message"}}`. The HTTP status says what went wrong
(400 bad request, 401 key, 404 route or model, 405 method, 413 body too large, 429 queue full); 500
is kept for the server's own failures, never for a client mistake. The rules behind each 400 are
written down, with their sources, in validation.py.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import orjson
from starlette.responses import Response

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class Dialect(Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ApiError(Exception):
    """An error answered to the client; `extra` adds fields next to the message (context sizes),
    `headers` HTTP headers (a 405's `Allow`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.extra, self.headers = extra or {}, headers


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_body(error: ApiError, dialect: Dialect) -> dict[str, Any]:
    if dialect is Dialect.ANTHROPIC:
        kind = ANTHROPIC_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message, **error.extra}}
    kind = OPENAI_TYPES.get(error.status, "server_error")
    body = {"message": error.message, "type": kind, "param": error.param, "code": error.code, **error.extra}
    return {"error": body}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def error_response(error: ApiError, dialect: Dialect) -> Response:
    return json_response(error_body(error, dialect), status=error.status, headers=error.headers)
