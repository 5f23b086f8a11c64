"""The ASGI layer in front of the routes: CORS headers, `OPTIONS` preflight, and the API key.

Written as plain ASGI, not Starlette's `BaseHTTPMiddleware`, which would buffer streams and hide a
client's disconnect from the streaming response that has to notice it.

The key (`--api-key` or `DWARFSTAR_API_KEY`) is accepted as `Authorization: Bearer KEY` (OpenAI
SDKs, Codex, opencode) or `x-api-key: KEY` (Anthropic SDK, Claude Code). `/health` stays open for
load balancers and supervisors.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dwarfstar.serving.errors import ApiError, Dialect, error_response

CORS_HEADERS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
    (b"access-control-allow-headers", b"*"),
]
OPEN_PATHS = ("/health",)


def dialect_of(path: str, headers: Headers) -> Dialect:
    """Anthropic clients get Anthropic-shaped errors even on routes that do not exist."""
    if path.startswith("/v1/messages") or "anthropic-version" in headers:
        return Dialect.ANTHROPIC
    return Dialect.OPENAI


def presented_key(headers: Headers) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


class Gate:
    def __init__(self, app: ASGIApp, *, api_key: str | None, cors: bool) -> None:
        self.app, self.api_key, self.cors = app, api_key, cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.cors:
            send = self._with_cors(send)
        if scope["method"] == "OPTIONS":
            await Response(status_code=204)(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            key = presented_key(headers)
            if key is None or not hmac.compare_digest(key.encode(), self.api_key.encode()):
                message = "missing API key" if key is None else "invalid API key"
                error = ApiError(401, message, code="invalid_api_key")
                await error_response(error, dialect_of(scope["path"], headers))(scope, receive, send)
                return
        completed = False

        async def send_tracked(message: Message) -> None:
            nonlocal completed
            await send(message)
            completed = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            # Starlette re-raises an unhandled error once its handler (`server_error`) has logged it
            # and sent the 500. Re-raised into uvicorn, it would be logged again and the connection
            # closed under a client that may already be sending its next request on it (a reset).
            # A response that was not completed still goes up, for uvicorn to close the connection.
            if not completed:
                raise

    @staticmethod
    def _with_cors(send: Send) -> Send:
        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *CORS_HEADERS]}
            await send(message)

        return send_with_cors
