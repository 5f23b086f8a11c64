"""Reading a JSON request body with its types checked: a wrong type is a 400 that names the field.

JSON `null` counts as absent, as ds4 reads it. Unknown keys are ignored, so newer clients that
send fields this server does not use still work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from dwarfstar.serving.errors import ApiError, bad_request

MAX_BODY_BYTES = 64 * 1024 * 1024  # ds4's limit; a conversation near 1M tokens fits
INLINE_JSON_BYTES = 256 * 1024  # bodies up to this parse on the event loop (well under a millisecond)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused with a 413 as soon as it passes `limit`: a chunked body has no
    Content-Length, so the bytes are counted as they arrive, never buffered past the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    return orjson.loads(raw)


async def read_json_object(request: Request, limit: int = MAX_BODY_BYTES) -> Fields:
    raw = await read_body(request, limit)
    try:
        # a body of many MB takes tens of milliseconds to parse: off the loop, so streams go on
        body = parse_json(raw) if len(raw) <= INLINE_JSON_BYTES else await run_in_threadpool(parse_json, raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"invalid JSON request: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("invalid JSON request: the body must be a JSON object")
    return Fields(body)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


class Fields:
    """Typed getters over one JSON object; `where` prefixes field names in messages (`tools[0].`)."""

    def __init__(self, body: Mapping[str, Any], where: str = "") -> None:
        self.body, self.where = body, where

    def raw(self, key: str) -> Any:
        return self.body.get(key)

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def _wrong(self, key: str, expected: str) -> ApiError:
        value = self.body[key]
        name = self.where + key
        return bad_request(f"{name} must be {expected}, got {_type_name(value)}", param=name)

    def _typed(self, key: str, kind: type, expected: str) -> Any:
        """The field's value, None when absent; a value not of `kind` is a 400 saying it must be `expected`."""
        value = self.body.get(key)
        if value is not None and not isinstance(value, kind):
            raise self._wrong(key, expected)
        return value

    def _within(self, key: str, value: float, low: float, high: float) -> None:
        if not low <= value <= high:
            name = self.where + key
            raise bad_request(f"{name} must be between {low} and {high}, got {value}", param=name)

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self._typed(key, str, "a string")
        return default if value is None else value

    def flag(self, key: str, default: bool | None = None) -> bool | None:
        value = self._typed(key, bool, "a boolean")
        return default if value is None else value

    def integer(self, key: str, *, low: int, high: int = 2**31 - 1) -> int | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer")
        self._within(key, value, low, high)
        return value

    def number(self, key: str, *, low: float, high: float) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(key, "a number")
        self._within(key, value, low, high)
        return float(value)

    def array(self, key: str) -> list[Any] | None:
        return self._typed(key, list, "an array")

    def mapping(self, key: str) -> Fields | None:
        value = self._typed(key, dict, "an object")
        return None if value is None else Fields(value, f"{self.where}{key}.")

    def required(self, key: str, value: Any) -> Any:
        if value is None:
            raise bad_request(f"missing {self.where}{key}", param=self.where + key)
        return value
