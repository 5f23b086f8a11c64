"""A request refused with a 4xx leaves no job behind, and the body is read and parsed without holding
up the event loop. Regression tests for the defects of issue 14 in `serving/`."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from starlette.requests import Request

from dwarfstar.serving import fields as fields_module
from dwarfstar.serving import service as service_module
from dwarfstar.serving.errors import ApiError
from dwarfstar.serving.fields import read_body

LONG_SCRIPT = [{"role": "user", "content": "Tell me. [[script:hello]]"}]
MODEL = "deepseek-v4-flash"


def settled(server, name: str, want: float, **labels: str) -> float:
    """The gauge once the worker has caught up (it updates gauges at the end of each loop turn)."""
    deadline = time.monotonic() + 10
    while server.metric(name, **labels) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.metric(name, **labels)


# Each body has one bad field that the endpoint used to read only after submitting the job.
LATE_FIELDS = [
    ("/v1/messages", "messages", {"model": MODEL, "max_tokens": 50, "messages": LONG_SCRIPT, "stream": "yes"}),
    ("/v1/completions", "completions", {"prompt": "hi", "max_tokens": 50, "stream_options": {"include_usage": 1}}),
    ("/v1/completions", "completions", {"prompt": "hi", "max_tokens": 50, "stream": "yes"}),
    ("/v1/responses", "responses", {"input": "hi", "max_output_tokens": 50, "include": "everything"}),
    ("/v1/responses", "responses", {"input": "hi", "max_output_tokens": 50, "reasoning": {"summary": 3}}),
    ("/v1/responses", "responses", {"input": "hi", "max_output_tokens": 50, "stream": "yes"}),
    ("/v1/chat/completions", "chat", {"messages": LONG_SCRIPT, "max_tokens": 50, "stream": "yes"}),
]


@pytest.mark.parametrize(("path", "api", "body"), LATE_FIELDS)
def test_a_bad_field_never_leaves_a_running_job(http, server, path, api, body):
    submitted = server.metric("dwarfstar_requests_total", api=api)
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "must be" in response.text
    assert server.metric("dwarfstar_requests_total", api=api) == submitted  # refused before submission
    assert settled(server, "dwarfstar_active_requests", 0) == 0
    assert "# TYPE" in http.get("/metrics").text


def test_a_job_is_cancelled_when_its_response_cannot_be_built(http, server, monkeypatch):
    """Anything raising after submission cancels the job (here: the SSE writer cannot be made)."""
    from dwarfstar.serving import openai_chat

    def broken(*args, **kwargs):
        raise RuntimeError("writer construction failed")

    monkeypatch.setattr(openai_chat, "ChatStream", broken)
    phases = ("queued", "prefill", "decode")

    def cancelled_total() -> float:
        return sum(server.metric("dwarfstar_cancelled_requests_total", phase=p) for p in phases)

    cancelled = cancelled_total()
    finished = sum(server.metric("dwarfstar_finished_requests_total", reason=r) for r in ("stop", "length"))
    # the model's own output (no script), up to most of the context: it would run for many seconds
    long_run = [{"role": "user", "content": "Go on and on."}]
    response = http.post("/v1/chat/completions", json={"messages": long_run, "max_tokens": 3500, "stream": True})
    assert response.status_code == 500
    # the job may still be queued (the active gauge is 0 then too): wait for the worker to drop it
    deadline = time.monotonic() + 10
    while cancelled_total() <= cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled_total() > cancelled
    assert settled(server, "dwarfstar_active_requests", 0) == 0
    assert sum(server.metric("dwarfstar_finished_requests_total", reason=r) for r in ("stop", "length")) == finished


def chunked_request(chunks: list[bytes]) -> tuple[Request, list[int]]:
    """A request with no Content-Length whose body arrives in `chunks`; the list counts the reads."""
    reads = [0]
    pending = list(chunks)

    async def receive():
        reads[0] += 1
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive), reads


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    request, reads = chunked_request([b"x" * 1000] * 100)
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body(request, limit=4500))
    assert caught.value.status == 413
    assert reads[0] == 5  # stopped at the chunk that crossed 4,500 bytes, not after all 100


def test_a_chunked_body_under_the_limit_is_read_whole():
    request, _ = chunked_request([b'{"a": ', b"[1, 2]", b"}"])
    assert orjson.loads(asyncio.run(read_body(request, limit=100))) == {"a": [1, 2]}


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_large_body_is_parsed_off_the_event_loop(http, monkeypatch):
    where: dict[int, bool] = {}  # body size: parsed on the event loop

    def parse(raw: bytes):
        where[len(raw)] = on_event_loop()
        return orjson.loads(raw)

    monkeypatch.setattr(fields_module, "parse_json", parse)
    big = {"messages": [{"role": "user", "content": "x" * 400_000}], "n": 2}  # refused after parsing
    small = {"messages": [{"role": "user", "content": "x"}], "n": 2}
    assert http.post("/v1/chat/completions", json=big).status_code == 400
    assert http.post("/v1/chat/completions", json=small).status_code == 400
    assert where[len(orjson.dumps(big))] is False and where[len(orjson.dumps(small))] is True


def test_chat_wrapped_completions_render_off_the_event_loop(http, monkeypatch):
    where: list[bool] = []
    real = service_module.render_conversation

    def render(*args, **kwargs):
        where.append(on_event_loop())
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "render_conversation", render)
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert where == [False]
