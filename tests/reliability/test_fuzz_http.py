"""Request bodies for all four APIs, mutated from valid ones (wrong types, huge strings, deep nesting,
invalid UTF-8, broken JSON): every one is answered, with a 4xx in that API's error shape or a normal
result, never a 5xx and never an exception out of the app; afterwards the server answers a normal
request of each API and has no job left. The app is called in process (`fuzz_app`), so `nox -s
reliability` can afford 10,000 inputs per route."""

from __future__ import annotations

import json
import time

import httpx2 as httpx
import pytest
from fuzz_support import FUZZ, tally
from hypothesis import given
from hypothesis import strategies as st

MODEL = "deepseek-v4-flash"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "tools": [TOOL],
        "stream": False,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["x"], "stream": False},
    "/v1/responses": {
        "model": MODEL,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "s",
        "max_output_tokens": 2,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "reasoning": {"effort": "low"},
        "stream": False,
    },
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 2,
        "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "thinking": {"type": "disabled"},
        "stream": False,
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["", "user", "assistant", "tool", "function", "text", "auto", "none", "enabled", "max"])
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
HUGE = "x" * 100_000
DEEP = "__deep__"  # placeholder for a nesting too deep to build as Python objects


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for n, item in enumerate(value):
            yield from paths(item, (*prefix, n))


def replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = replaced(value[head], rest, new)
    return copy


def removed(value, path):
    if len(path) == 1:
        copy = dict(value) if isinstance(value, dict) else list(value)
        del copy[path[0]]
        return copy
    return replaced(value, path[:1], removed(value[path[0]], path[1:]))


@st.composite
def bodies(draw, route: str) -> bytes:
    body, depth = VALID[route], 0
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(body))))
        op = draw(st.sampled_from(["replace"] * 6 + ["delete"] * 2 + ["add", "deep", "huge"]))
        if op == "delete" and where:
            body = removed(body, where)
        elif op == "add" and isinstance(body, dict):
            body = {**body, draw(st.text(max_size=10)): draw(json_values)}
        elif op == "deep" and not depth:
            depth = draw(st.integers(100, 5000))
            body = replaced(body, where, DEEP)
        elif op == "huge":
            body = replaced(body, where, HUGE)
        else:
            body = replaced(body, where, draw(json_values))
    raw = json.dumps(body).encode()  # the standard library writes integers of any size
    raw = raw.replace(f'"{DEEP}"'.encode(), b"[" * depth + b"]" * depth)
    kind = draw(st.sampled_from(["json"] * 6 + ["cut", "bad utf-8", "bytes"]))
    if kind == "cut":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "bad utf-8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])) + raw[at:]
    elif kind == "bytes":
        raw = draw(st.binary(max_size=64))
    return raw


def check_answer(route: str, response: httpx.Response) -> str:
    assert response.status_code < 500, (route, response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if route in ANTHROPIC:
            assert body["type"] == "error" and isinstance(body["error"]["message"], str) and body["error"]["type"]
        else:
            assert isinstance(body["error"]["message"], str) and body["error"]["type"]
        return f"{response.status_code}"
    if response.headers["content-type"].startswith("text/event-stream"):
        assert "data: " in response.text
        return "200 stream"
    assert isinstance(response.json(), dict)
    return "200"


@pytest.mark.parametrize("route", list(VALID))
def test_mutated_bodies_get_a_4xx_in_the_api_shape(fuzz_app, route):
    client, service = fuzz_app

    @FUZZ
    @given(raw=bodies(route))
    def case(raw):
        tally(f"http {route}", check_answer(route, client.post(route, content=raw)))

    case()
    for path, body in VALID.items():  # the server still answers normally
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while service.metrics.value("dwarfstar_active_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.metrics.value("dwarfstar_active_requests") == 0
    assert service.metrics.value("dwarfstar_queue_depth") == 0
