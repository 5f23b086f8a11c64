"""The tool-call guard through the real server (prompt/dsml_guard.py; its rules: tests/test_dsml_guard.py):
a scripted model that names a tool the request did not declare (`Get_weather` for `get_weather`) gets
the declared name, in each API, by default; `tool_guard: false`, or `serve --no-tool-guard`, serves
the call as the model wrote it."""

from __future__ import annotations

import json
from dataclasses import replace

from conftest import TOOLS

PROMPT = "Weather? [[script:misnamed_weather]]"
ARGUMENTS = {"city": "Paris", "days": {"n": 3}}


def chat(oai, **extra):
    return oai.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": PROMPT}],
        tools=TOOLS,
        max_tokens=200,
        extra_body={"think": False, **extra},
    )


def test_an_undeclared_name_comes_out_as_the_declared_one(oai, server):
    choice = chat(oai).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    assert server.trace_records()[-1]["generated"].count('invoke name="get_weather"') == 1


def test_the_guard_holds_in_the_messages_api(claude):
    message = claude.messages.create(
        model="deepseek-v4-flash",
        max_tokens=200,
        messages=[{"role": "user", "content": PROMPT}],
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        thinking={"type": "disabled"},
    )
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("get_weather", ARGUMENTS)]


def test_without_the_guard_the_call_is_the_models(oai, server):
    (call,) = chat(oai, tool_guard=False).choices[0].message.tool_calls
    assert call.function.name == "Get_weather"
    config = server.service.config
    server.service.config = replace(config, tool_guard=False)  # serve --no-tool-guard
    try:
        (call,) = chat(oai).choices[0].message.tool_calls
        assert call.function.name == "Get_weather"
        (call,) = chat(oai, tool_guard=True).choices[0].message.tool_calls  # a request may still ask
        assert call.function.name == "get_weather"
    finally:
        server.service.config = config
