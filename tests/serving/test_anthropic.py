"""Anthropic Messages API (Claude Code) through the official `anthropic` SDK."""

from __future__ import annotations

import anthropic
import pytest
from conftest import TOOLS

TOOL = {
    "name": "get_weather",
    "description": "Weather forecast for a city.",
    "input_schema": TOOLS[0]["function"]["parameters"],
}


def test_streaming_thinking_text_and_tool_use_blocks(claude):
    with claude.messages.stream(
        model="deepseek-v4-flash",
        max_tokens=300,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[{"role": "user", "content": "Weather? [[script:think_weather]]"}],
        tools=[TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        events = list(stream)
        message = stream.get_final_message()
    kinds = [
        e.type
        for e in events
        if e.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
    ]
    assert kinds == ["message_start"] + ["content_block_start", "content_block_stop"] * 3 + [
        "message_delta",
        "message_stop",
    ]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"}
    thinking, text, tool_use = message.content
    assert thinking.thinking == "The user wants weather, so call the tool." and thinking.signature == message.id
    assert text.text == "Checking."
    assert tool_use.id.startswith("toolu_") and tool_use.name == "get_weather"
    assert tool_use.input == {"city": "Paris", "days": {"n": 3}}
    assert message.stop_reason == "tool_use"
    assert message.usage.cache_creation_input_tokens > 0 and message.usage.output_tokens > 0


def test_tool_result_round_trip_and_prefix_reuse(claude, server):
    messages = [{"role": "user", "content": "Weather? [[script:weather]]"}]
    first = claude.messages.create(
        model="deepseek-v4-flash", max_tokens=300, messages=messages, tools=[TOOL], thinking={"type": "disabled"}
    )
    assert first.stop_reason == "tool_use"
    text, tool_use = first.content
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "Sunny"}]},
    ]
    second = claude.messages.create(
        model="deepseek-v4-flash", max_tokens=3, messages=messages, tools=[TOOL], thinking={"type": "disabled"}
    )
    assert second.stop_reason == "max_tokens" and len(second.content) == 1 and second.content[0].type == "text"
    assert server.trace_records()[-1]["replayed_tool_ids"] == [tool_use.id]
    first_total = first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= first_total + first.usage.output_tokens - 1


def test_plain_message_and_stop_sequence(claude):
    message = claude.messages.create(
        model="deepseek-v4-flash",
        max_tokens=50,
        messages=[{"role": "user", "content": "[[script:hello]]"}],
        stop_sequences=["how can"],
        thinking={"type": "disabled"},
    )
    assert message.content[0].text == "Hello there, "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "how can"


def test_count_tokens(claude):
    counted = claude.messages.count_tokens(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "Count me."}], tools=[TOOL]
    )
    sent = claude.messages.create(
        model="deepseek-v4-flash", max_tokens=1, messages=[{"role": "user", "content": "Count me."}], tools=[TOOL]
    )
    assert counted.input_tokens == sent.usage.cache_read_input_tokens + sent.usage.cache_creation_input_tokens


def test_errors_have_the_anthropic_shape(claude):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="gpt-4o", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="deepseek-v4-flash", max_tokens=-1, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in err.value.message


def test_models_in_the_anthropic_shape(claude):
    (model,) = claude.models.list().data
    assert model.id == "deepseek-v4-flash" and model.type == "model"
    assert claude.models.retrieve("deepseek-v4-pro").display_name == "DeepSeek V4 Flash"
