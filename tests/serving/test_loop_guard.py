"""The loop guard (dwarfstar/session/loopguard.py): a scripted output that loops is ended with finish
`repetition` (each API's nearest stop reason), a normal one never is, and a tool call repeated in K
assistant turns gets the note or is stopped, through the real HTTP stack."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import dwarfstar
from dwarfstar.session.loopguard import MIN_SPAN, LoopGuard, Repetition, ToolStreak, call_key, tool_loop

MODEL = "deepseek-v4-flash"
LOOP = "[[script:loop]]"
NOTE = "Tool error: repeated tool call: get_weather"
SPAN = 24  # the server's guard here ends a loop sooner than the default's MIN_SPAN, so the tests are short
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture
def guarded(server) -> Iterator[None]:
    """`serve --loop-guard` with a shorter span (a request's `loop_guard: false` turns it off)."""
    config = server.service.config
    server.service.config = replace(config, loop_guard=LoopGuard(min_span=SPAN))
    yield
    server.service.config = config


def ask(http, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "thinking": False, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def fires(tokens: list[int]) -> bool:
    guard = Repetition(LoopGuard())
    return any(guard.push(t) for t in tokens)


def test_repetition_needs_a_long_periodic_tail(engine):
    unit = [5, 6, 7, 8, 9, 10]
    assert fires([1, 2, 3] + unit * (MIN_SPAN // len(unit) + 1))
    assert not fires(unit * (MIN_SPAN // len(unit) - 1))  # too short a span
    assert not fires([1, 2] * 20 + [3] * 30)  # "ha ha ha", a markdown rule
    text = (Path(dwarfstar.__file__).parent / "data" / "promessi_sposi_excerpt.txt").read_text(encoding="utf-8")
    assert not fires(engine.tokenizer.encode(text))  # real prose never


def test_tool_streak_counts_identical_calls_in_a_row():
    streak = ToolStreak()
    paris, rome = call_key("get_weather", '{"city": "Paris"}'), call_key("get_weather", {"city": "Rome"})
    assert [streak.push(c) for c in ([paris], [paris], [rome], [rome], [], [rome])] == [1, 2, 1, 2, 0, 1]
    assert call_key("f", '{"b": 1, "a": 2}') == call_key("f", {"a": 2, "b": 1})


def test_a_looping_output_is_ended_and_traced(http, server, guarded):
    before = server.metric("dwarfstar_loop_guard_total", kind="repetition")
    unguarded = ask(http, LOOP, loop_guard=False)
    guarded = ask(http, LOOP)
    assert unguarded["choices"][0]["finish_reason"] == "stop"  # the script ran to its EOS
    assert guarded["choices"][0]["finish_reason"] == "stop"  # OpenAI's nearest reason
    assert guarded["usage"]["completion_tokens"] < unguarded["usage"]["completion_tokens"] - SPAN // 2
    record = [r for r in server.trace_records() if r["api"] == "chat"][-1]
    assert record["finish"] == "repetition" and "repeated" in record["loop_guard"]
    assert server.metric("dwarfstar_loop_guard_total", kind="repetition") == before + 1


def test_a_normal_reply_is_not_cut(http, server, guarded):
    done = ask(http, "[[script:long_story]]", max_tokens=3 * SPAN)
    assert done["choices"][0]["finish_reason"] == "length"  # the whole budget: not cut
    record = [r for r in server.trace_records() if r["api"] == "chat"][-1]
    assert record["finish"] == "length" and record["loop_guard"] is None


def test_each_api_names_the_repetition(http, guarded):
    body = {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": LOOP}]}
    messages = http.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}}).json()
    assert messages["stop_reason"] == "end_turn"
    response = http.post("/v1/responses", json={"model": MODEL, "input": LOOP}).json()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "repetition"}
    stream = http.post("/v1/chat/completions", json={**body, "thinking": False, "stream": True})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def looping_history(turns: int) -> list[dict]:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for n in range(turns):
        call = {**CALL, "id": f"call_{n}"}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]}]
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]
    return messages


def test_a_repeated_tool_call_gets_the_note(http, server):
    assert tool_loop(looping_history(3), 3) == "get_weather" and tool_loop(looping_history(2), 3) is None
    body = {"model": MODEL, "messages": looping_history(3), "thinking": False, "max_tokens": 4}
    before = server.metric("dwarfstar_loop_guard_total", kind="tool_note")
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert NOTE not in server.trace_records()[-1]["prompt"]
    assert http.post("/v1/chat/completions", json={**body, "loop_guard": True}).status_code == 200
    record = server.trace_records()[-1]
    assert NOTE in record["prompt"] and "get_weather" in record["loop_guard"]
    assert server.metric("dwarfstar_loop_guard_total", kind="tool_note") == before + 1


def test_a_repeated_tool_call_is_stopped(http, server):
    config = server.service.config
    server.service.config = replace(config, loop_guard=LoopGuard(tools="stop"))  # `--loop-guard-tools stop`
    try:
        body = {"model": MODEL, "messages": looping_history(3), "thinking": False, "max_tokens": 4}
        done = http.post("/v1/chat/completions", json=body).json()
    finally:
        server.service.config = config
    assert done["choices"][0]["finish_reason"] == "stop" and done["usage"]["completion_tokens"] == 0
    assert server.trace_records()[-1]["finish"] == "repetition"
