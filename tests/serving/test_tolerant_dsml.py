"""Drifted DSML served as the calls the model meant; an unrepairable block as an invalid tool call,
streamed or not: no calls, the block's text as the model wrote it after the content, and a flag in
each API's own shape (issue 36), never an empty success. A stream shows a block's calls only once
the parser accepts the block, so it never shows the start or the arguments of a call it would have
to take back, and ends as the unstreamed reply does (issue 37). The client sends the shown text back,
and the next turn extends the live KV through it, the block's control tokens included.

The tool-call guard, which keeps a block to its canonical spelling and its tools
(prompt/dsml_guard.py), is off here: these are a model's blocks as it wrote them."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from conftest import DSML, SCRIPTS, TOOLS

UNGUARDED = {"tool_guard": False}
NOTHINK = {"think": False} | UNGUARDED
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


def invalid_record(server, script: str) -> dict:
    return next(r for r in reversed(server.trace_records()) if f"script:{script}" in json.dumps(r["request"]))


def test_unrepairable_block_is_shown_and_flagged_in_each_api(oai, claude, server):
    """Through the SDKs: the whole text the model wrote, no call, and the flag each SDK reads."""
    text = SCRIPTS["broken_weather"]
    choice = chat(oai, "broken_weather").choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == text
    why = choice.message.model_extra["invalid_tool_call"]["explanation"]
    with oai.chat.completions.stream(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "Weather? [[script:broken_weather]]"}],
        tools=TOOLS,
        max_tokens=200,
        extra_body=NOTHINK,
    ) as stream:  # the SDK's own accumulation of the chunks
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.finish_reason, streamed.message.content) == ("stop", text) and not streamed.message.tool_calls
    assert streamed.message.model_extra["invalid_tool_call"] == {"explanation": why}
    record = invalid_record(server, "broken_weather")
    assert record["generated"] == text and f"invalid tool call: {why}" in record["problems"]

    ask = {
        "model": "deepseek-v4-flash",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Weather? [[script:broken_weather]]"}],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "thinking": {"type": "disabled"},
        "extra_body": UNGUARDED,
    }
    with claude.messages.stream(**ask) as stream:  # the SDK's own accumulation of the events
        streamed = stream.get_final_message()
    for message in (claude.messages.create(**ask), streamed):
        assert message.stop_reason == "end_turn"
        assert [block.type for block in message.content] == ["text"] and message.content[0].text == text
        assert (message.stop_details.type, message.stop_details.explanation) == ("invalid_tool_call", why)

    response = oai.responses.create(
        model="deepseek-v4-flash",
        input="Weather? [[script:broken_weather]]",
        tools=[{"type": "function", **TOOLS[0]["function"]}],
        max_output_tokens=200,
        reasoning={"effort": "none"},
        extra_body=UNGUARDED,
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "invalid_tool_call"
    assert response.incomplete_details.model_extra["explanation"] == why
    assert [item.type for item in response.output] == ["message"] and response.output_text == text


def body_for(path: str, script: str, stream: bool) -> dict:
    prompt = f"Weather? [[script:{script}]]"
    body = {"model": "deepseek-v4-flash", "stream": stream} | UNGUARDED
    if path == "/v1/responses":
        body |= {"input": prompt, "tools": [{"type": "function", **TOOLS[0]["function"]}]}
        return body | {"max_output_tokens": 200, "reasoning": {"effort": "none"}}
    if path == "/v1/messages":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": 200}
        body["tools"] = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
        return body | {"thinking": {"type": "disabled"}}
    return body | {"messages": [{"role": "user", "content": prompt}], "tools": TOOLS, "max_tokens": 200, "think": False}


def ending(path: str, reply: dict) -> tuple:
    """(finish, text, calls, flag) of a whole reply, in the API's own fields."""
    if path == "/v1/responses":
        text = [p["text"] for i in reply["output"] if i["type"] == "message" for p in i["content"]]
        calls = [i for i in reply["output"] if i["type"] == "function_call"]
        return reply["status"], "".join(text), calls, reply["incomplete_details"]
    if path == "/v1/messages":
        text = "".join(b["text"] for b in reply["content"] if b["type"] == "text")
        calls = [b for b in reply["content"] if b["type"] == "tool_use"]
        return reply["stop_reason"], text, calls, reply["stop_details"]
    choice = reply["choices"][0]
    message = choice["message"]
    return choice["finish_reason"], message["content"], message.get("tool_calls") or [], message["invalid_tool_call"]


def streamed_ending(path: str, events: list[dict]) -> tuple:
    if path == "/v1/responses":
        return ending(path, events[-1]["response"])
    if path == "/v1/messages":
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        stop = next(e["delta"] for e in events if e["type"] == "message_delta")
        calls = [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
        return stop["stop_reason"], text, calls, stop["stop_details"]
    deltas = [c["choices"][0] for c in events if c.get("choices")]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    last = next(d for d in deltas if d["finish_reason"])
    return last["finish_reason"], text, calls, last["delta"]["invalid_tool_call"]


FINISH = {"/v1/chat/completions": "stop", "/v1/responses": "incomplete", "/v1/messages": "end_turn"}
# each flag's fields besides its `explanation`: chat's field is named for what it flags
LABEL = {
    "/v1/chat/completions": {},
    "/v1/responses": {"reason": "invalid_tool_call"},
    "/v1/messages": {"type": "invalid_tool_call"},
}


@pytest.mark.parametrize("script", ["broken_weather", "leaky_weather"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_an_unrepairable_block_ends_a_stream_as_it_ends_a_reply(http, server, path, script):
    """The same finish, text, (no) calls and flag, no error, and no call event in the stream: not an
    argument delta either (the leaky block's value runs into drifted structure before it is cut). The
    text is all the model wrote, the block as plain text after the words."""
    before = server.metric("dwarfstar_finished_requests_total", reason="stop")
    invalid = server.metric("dwarfstar_invalid_tool_calls_total")
    reply = http.post(path, json=body_for(path, script, stream=False))
    assert reply.status_code == 200
    with http.stream("POST", path, json=body_for(path, script, stream=True)) as response:
        text = response.read().decode()
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    call = {"/v1/chat/completions": '"tool_calls"', "/v1/responses": '"function_call', "/v1/messages": '"tool_use"'}
    assert call[path] not in text
    assert "event: error" not in text and not any(e.get("type") in ("error", "response.failed") for e in events)
    assert streamed_ending(path, events) == ending(path, reply.json())
    finish, shown, calls, flag = ending(path, reply.json())
    assert (finish, shown, calls) == (FINISH[path], SCRIPTS[script], [])
    why = flag.pop("explanation")
    assert flag == LABEL[path] and f"invalid tool call: {why}" in invalid_record(server, script)["problems"]
    assert server.metric("dwarfstar_finished_requests_total", reason="stop") == before + 2
    assert server.metric("dwarfstar_invalid_tool_calls_total") == invalid + 2


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_block_cut_by_the_budget_ends_as_the_budget_says_and_is_shown(http, engine, path):
    """The budget ends a valid block midway: the finish is the budget's, the cut text is shown, and the
    flag is there too where the API has a place for it besides the finish (Responses has one reason)."""
    ids = engine.tokenizer.encode_with_specials(SCRIPTS["weather"])
    cut = ids.index(engine.tokenizer.token_id(DSML), len(ids) // 2)  # inside the block, at a tag
    body = body_for(path, "weather", stream=False)
    body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = cut
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    finish, shown, calls, flag = ending(path, reply.json())
    assert (shown, calls) == (engine.tokenizer.decode(ids[:cut]), [])
    if path == "/v1/responses":
        assert (finish, flag) == ("incomplete", {"reason": "max_output_tokens"})
    else:
        assert finish == {"/v1/chat/completions": "length", "/v1/messages": "max_tokens"}[path]
        assert flag["explanation"]


def next_turn(path: str, reply: dict) -> dict:
    """The conversation sent back as a client would: the shown text as the assistant's turn, then a user turn."""
    body = body_for(path, "broken_weather", stream=False)
    _, shown, _, _ = ending(path, reply)
    again = "That call was broken. [[script:hello]]"
    if path == "/v1/responses":
        answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": shown}]}
        return body | {
            "input": [{"role": "user", "content": body["input"]}, answer, {"role": "user", "content": again}]
        }
    answer = {"role": "assistant", "content": [{"type": "text", "text": shown}] if path == "/v1/messages" else shown}
    return body | {"messages": [*body["messages"], answer, {"role": "user", "content": again}]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_the_next_turn_extends_the_live_kv_through_the_shown_block(http, server, path):
    """The block comes back as text, the bytes the model sampled: the whole first turn is reused."""
    first = http.post(path, json=body_for(path, "broken_weather", stream=False))
    turn1 = invalid_record(server, "broken_weather")
    second = http.post(path, json=next_turn(path, first.json()))
    assert second.status_code == 200, second.text
    turn2 = server.trace_records()[-1]
    assert turn2["prompt"].startswith(turn1["prompt"] + SCRIPTS["broken_weather"])
    # everything the first turn ran through the model (all it generated but the end-of-sentence)
    assert turn2["cached_tokens"] >= turn1["prompt_tokens"] + turn1["completion_tokens"] - 1


def test_the_server_answers_normally_after_invalid_calls(http):
    body = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "[[script:hello]]"}], "think": False}
    reply = http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60))
    assert reply.json()["choices"][0]["message"]["content"] == SCRIPTS["hello"]
