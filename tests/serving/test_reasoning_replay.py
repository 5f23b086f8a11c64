"""Reasoning replay: a client that drops or trims the reasoning of an assistant tool-call turn still
gets the turn rendered with the reasoning the model sampled, so the live KV stays a prefix of the
next prompt (a cache hit through the reasoning and the call) in chat, Responses and Messages."""

from __future__ import annotations

import json

from conftest import SCRIPTS, TOOLS

from dwarfstar.serving.replay import ToolMemory, replay_reasoning

REASONING = SCRIPTS["think_weather"].split("</think>")[0]
QUESTION = "Weather in Paris? [[script:think_weather]]"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def turn(reasoning=None, ids=("call_1",)) -> dict:
    message = {"role": "assistant", "content": "Checking.", "tool_calls": [{**CALL, "id": i} for i in ids]}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def test_dropped_empty_or_trimmed_reasoning_is_put_back_as_sampled():
    memory = ToolMemory(100)
    memory.remember(["call_1", "call_2"], "<dsml>", "  Think first.\n")
    for sent in (None, "", "Think first.", "\nThink first.  "):
        [message] = replay_reasoning([turn(sent)], memory)
        assert message["reasoning_content"] == "  Think first.\n"
    [both] = replay_reasoning([turn(None, ids=("call_1", "call_2"))], memory)
    assert both["reasoning_content"] == "  Think first.\n"


def test_reasoning_the_client_changed_or_the_memory_lost_is_rendered_as_sent():
    memory = ToolMemory(100)
    memory.remember(["call_1"], "<dsml>", "Think first.")
    memory.remember(["call_2"], "<other dsml>", "Another turn.")
    memory.remember(["call_3"], "<dsml from a disk file>")  # reasoning unknown
    messages = [
        turn("My own summary."),
        turn(None, ids=("call_1", "call_2")),  # calls from two turns: no one reasoning to put back
        turn(None, ids=("unknown",)),
        turn(None, ids=("call_3",)),
        {"role": "user", "content": "hi"},
    ]
    assert replay_reasoning(messages, memory) == messages


def test_a_disk_files_block_keeps_the_reasoning_known_for_it():
    memory = ToolMemory(100)
    memory.remember(["call_1"], "<dsml>", "Think first.")
    memory.remember(["call_1"], "<dsml>")  # the same block recalled from a file
    assert memory.reasoning("call_1") == "Think first."
    memory.remember(["call_1"], "<a new block>")
    assert memory.reasoning("call_1") is None


def cached(usage) -> int:
    details = getattr(usage, "prompt_tokens_details", None) or getattr(usage, "input_tokens_details", None)
    return details.cached_tokens


def test_chat_client_that_drops_reasoning_content_hits_the_cache(oai, server):
    messages = [{"role": "user", "content": QUESTION}]
    ask = dict(model="deepseek-v4-flash", tools=TOOLS, max_tokens=200, extra_body={"think": True})
    first = oai.chat.completions.create(messages=messages, **ask)
    message = first.choices[0].message
    assert message.reasoning_content == REASONING and message.tool_calls
    replayed = message.model_dump(exclude_none=True)
    del replayed["reasoning_content"]  # the client does not send it back
    (call,) = message.tool_calls
    messages += [replayed, {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    second = oai.chat.completions.create(messages=messages, **{**ask, "max_tokens": 2})
    assert REASONING + "</think>Checking." in server.trace_records()[-1]["prompt"]
    # the whole first turn is reused: its prompt, the reasoning, the text and the call
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 20


def test_responses_client_without_reasoning_items_hits_the_cache(oai, server):
    ask = dict(model="deepseek-v4-flash", tools=[{"type": "function", **TOOLS[0]["function"]}])
    ask["reasoning"] = {"effort": "high"}  # thinking on, no summary and no encrypted content asked
    first = oai.responses.create(input=QUESTION, max_output_tokens=200, **ask)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert not [item for item in first.output if item.type == "reasoning"]
    history = [
        {"type": "message", "role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    second = oai.responses.create(input=history, max_output_tokens=2, **ask)
    assert REASONING + "</think>Checking." in server.trace_records()[-1]["prompt"]
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + 20


def test_messages_client_that_strips_thinking_blocks_hits_the_cache(claude, server):
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    ask = dict(model="deepseek-v4-flash", tools=[tool], thinking={"type": "enabled", "budget_tokens": 1024})
    messages = [{"role": "user", "content": QUESTION}]
    first = claude.messages.create(messages=messages, max_tokens=200, **ask)
    kinds = [block.type for block in first.content]
    assert kinds == ["thinking", "text", "tool_use"]
    _, text, use = first.content
    assistant = [
        {"type": "text", "text": text.text},
        {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input},
    ]
    messages += [
        {"role": "assistant", "content": assistant},  # the thinking block stripped
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    second = claude.messages.create(messages=messages, max_tokens=2, **ask)
    assert REASONING + "</think>Checking." in server.trace_records()[-1]["prompt"]
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens + 20
    assert json.loads(json.dumps(use.input)) == {"city": "Paris", "days": {"n": 3}}
