"""Drifted DSML served as the calls the model meant; an unrepairable block as ds4's recoverable
invalid tool call (an ordinary end of turn, no calls, no DSML in the content), except that a stream
which already showed the call's start ends with an error instead of a partial call."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from conftest import SCRIPTS, TOOLS

NOTHINK = {"think": False}
CITY_ARGUMENTS = {"city": "Paris", "days": {"n": 3}}


def chat(oai, script: str, **extra):
    return oai.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": f"Weather? [[script:{script}]]"}],
        tools=TOOLS,
        max_tokens=200,
        extra_body=NOTHINK,
        **extra,
    )


def test_drifted_block_is_served_as_the_call(oai, server):
    choice = chat(oai, "drifted_weather").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CITY_ARGUMENTS
    record = next(r for r in reversed(server.trace_records()) if "drifted_weather" in json.dumps(r["request"]))
    # kept as generated (so its replay matches the live KV), the repairs noted in the trace
    assert record["dsml"] == SCRIPTS["drifted_weather"].removeprefix("Let me check.")
    assert any(p.startswith("repaired tool call") for p in record["problems"])


def test_drifted_block_streams_as_the_call(oai):
    chunks = list(chat(oai, "drifted_weather", stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments for tc in calls[1:])) == CITY_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_unrepairable_block_ends_the_turn_without_calls_or_dsml(oai, claude):
    choice = chat(oai, "broken_weather").choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Let me check." and not choice.message.tool_calls
    message = claude.messages.create(
        model="deepseek-v4-flash",
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather? [[script:broken_weather]]"}],
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        thinking={"type": "disabled"},
    )
    assert message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == "Let me check."


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_unrepairable_block_after_a_streamed_call_start_fails_the_stream(http, server, path):
    prompt = "Weather? [[script:broken_weather]]"
    body = {"model": "deepseek-v4-flash", "stream": True}
    if path == "/v1/responses":
        body |= {"input": prompt, "tools": [{"type": "function", **TOOLS[0]["function"]}]}
        body |= {"max_output_tokens": 200, "reasoning": {"effort": "none"}}
    elif path == "/v1/messages":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": 200}
        body["tools"] = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
        body["thinking"] = {"type": "disabled"}
    else:
        body |= {"messages": [{"role": "user", "content": prompt}], "tools": TOOLS, "max_tokens": 200, "think": False}
    before = server.metric("dwarfstar_finished_requests_total", reason="stop")
    with http.stream("POST", path, json=body) as response:
        text = response.read().decode()
    assert response.status_code == 200
    assert "get_weather" in text  # the call's start was streamed ...
    assert "invalid tool call: a parameter value was not closed" in text  # ... so the stream ends in an error
    assert "DSML" not in text
    assert server.metric("dwarfstar_finished_requests_total", reason="stop") == before + 1


def test_the_server_answers_normally_after_invalid_calls(http):
    body = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "[[script:hello]]"}], "think": False}
    reply = http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60))
    assert reply.json()["choices"][0]["message"]["content"] == SCRIPTS["hello"]
