"""Delivering a job's events: as a server-sent event stream, or as one final result.

Both notice a client that leaves and cancel its job, so the worker stops at its next prefill slice or
decode step (ds4 #333: prefill went on for minutes after the client was gone). A stream sends its
headers at once and an SSE comment whenever nothing else was sent for `keepalive` seconds, so
clients and proxies do not time out during a long prefill or while queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dwarfstar.serving.errors import ApiError, json_response
from dwarfstar.serving.generation import Event, Failed, Finished
from dwarfstar.serving.jobs import Job

KEEPALIVE = b": keepalive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Writer = Callable[[Event], list[bytes]]


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


def sse(data: Any, event: str | None = None) -> bytes:
    body = data if isinstance(data, bytes) else orjson.dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + body + b"\n\n"


async def _events(job: Job, writer: Writer, keepalive: float) -> AsyncIterator[bytes]:
    try:
        while True:
            event = await job.next_event(keepalive)
            if event is None:
                yield KEEPALIVE
                continue
            for chunk in writer(event):
                yield chunk
            if isinstance(event, Finished | Failed):
                return
    finally:
        # Reached when the stream ends and also when Starlette cancels it because the client left.
        job.cancel()


class JobStream(StreamingResponse):
    """The SSE response of one job, which cancels the job however the response ends: a client that
    leaves before the first byte never starts the event generator, so its `finally` alone would not."""

    def __init__(self, job: Job, writer: Writer, keepalive: float) -> None:
        super().__init__(_events(job, writer, keepalive), media_type="text/event-stream", headers=HEADERS)
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def event_stream(job: Job, writer: Writer, keepalive: float) -> StreamingResponse:
    return JobStream(job, writer, keepalive)


@contextmanager
def cancelled_on_error(job: Job) -> Iterator[None]:
    """Cancel a submitted job if building its response raises: no generation outlives its request."""
    try:
        yield
    except BaseException:
        job.cancel()
        raise


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def final_event(job: Job, request: Request) -> Finished | Failed:
    """The job's outcome; raises ClientGone (and cancels the job) if the client disconnects first."""

    async def outcome() -> Finished | Failed:
        while True:
            event = await job.next_event()
            if isinstance(event, Finished | Failed):
                return event

    result = asyncio.ensure_future(outcome())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        raise ClientGone
    finally:
        result.cancel()
        gone.cancel()
        job.cancel()


async def respond(
    job: Job,
    request: Request,
    stream: bool,
    writer: Callable[[], Writer],
    body: Callable[[Finished], dict[str, Any]],
) -> Response:
    """A submitted job's answer, in any API: with `stream`, its events as SSE through the writer that
    `writer` makes, else the JSON `body` of its outcome; a failed job is a 500 error. The job is
    cancelled if the answer cannot be built."""
    with cancelled_on_error(job):
        if stream:
            return event_stream(job, writer(), request.app.state.service.config.keepalive_seconds)
        outcome = await final_event(job, request)
        if isinstance(outcome, Failed):
            raise ApiError(500, outcome.message, code="server_error")
        return json_response(body(outcome))
