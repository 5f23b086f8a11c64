"""OpenAI Chat Completions and legacy Completions through the official `openai` SDK."""

from __future__ import annotations

import json

from conftest import SCRIPTS, TOOLS, WEATHER_CALL

NOTHINK = {"thinking": {"type": "disabled"}}


def test_models_list_and_aliases(oai):
    assert [m.id for m in oai.models.list()] == ["deepseek-v4-flash"]
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        model = oai.models.retrieve(name)
        assert model.id == name and model.context_length == 4096


def test_chat_plain_is_deterministic_and_counts_tokens(oai):
    def ask():
        return oai.chat.completions.create(
            model="deepseek-v4-flash",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=6,
            temperature=0,
            extra_body=NOTHINK,
        )

    first, second = ask(), ask()
    choice = first.choices[0]
    assert choice.finish_reason == "length" and first.usage.completion_tokens == 6
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert not getattr(choice.message, "reasoning_content", None)
    assert second.choices[0].message.content == choice.message.content
    assert first.usage.total_tokens == first.usage.prompt_tokens + 6


def test_chat_streaming_matches_non_streaming(oai):
    request = dict(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "Stream this."}],
        max_tokens=6,
        temperature=0,
        extra_body=NOTHINK,
    )
    whole = oai.chat.completions.create(**request)
    chunks = list(oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_streams_reasoning_then_content(oai):
    chunks = list(
        oai.chat.completions.create(
            model="deepseek-v4-flash",
            messages=[{"role": "user", "content": "Hi [[script:think_hello]]"}],
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == "A greeting deserves a greeting." and content == "Hello!"
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])


def test_tool_round_trip_replays_the_sampled_dsml(oai, server):
    messages = [{"role": "user", "content": "Weather in Paris? [[script:weather]]"}]
    first = oai.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=200, extra_body=NOTHINK
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 37
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": {"n": 3}}

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    second = oai.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=4, extra_body=NOTHINK
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    # the second prompt holds the block exactly as sampled (its `{"n": 3}` is not canonical), so the
    # live session is a prefix of it: everything up to the end of the tool call is reused
    records = [r for r in server.trace_records() if r["api"] == "chat"]
    turn1 = next(r for r in records if r["dsml"] == WEATHER_CALL)
    turn2 = records[-1]
    assert turn2["replayed_tool_ids"] == [call.id]
    assert turn1["prompt"] + "Let me check." + WEATHER_CALL in turn2["prompt"]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 10


def test_tool_call_arguments_stream_before_the_call_ends(oai):
    chunks = list(
        oai.chat.completions.create(
            model="deepseek-v4-flash",
            messages=[{"role": "user", "content": "Weather? [[script:weather]]"}],
            tools=TOOLS,
            stream=True,
            extra_body=NOTHINK,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == ""
    pieces = [tc.function.arguments for tc in calls[1:]]
    assert len(pieces) > 3  # streamed in pieces, not in one go
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": {"n": 3}}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stop_string_cuts_the_text(oai):
    reply = oai.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "[[script:hello]]"}],
        stop=[", how"],
        extra_body=NOTHINK,
    )
    assert reply.choices[0].message.content == "Hello there" and reply.choices[0].finish_reason == "stop"


def test_completions_chat_wrapped_and_raw(oai):
    wrapped = oai.completions.create(
        model="deepseek-v4-flash", prompt="Hi [[script:hello]]", max_tokens=50, extra_body={"think": False}
    )
    assert wrapped.choices[0].text == SCRIPTS["hello"] and wrapped.choices[0].finish_reason == "stop"
    raw = oai.completions.create(
        model="deepseek-v4-flash",
        prompt="<｜begin▁of▁sentence｜><｜User｜>Hi [[script:hello]]<｜Assistant｜></think>",
        max_tokens=50,
        extra_body={"raw": True},
    )
    assert raw.choices[0].text == SCRIPTS["hello"]
    assert raw.usage.prompt_tokens == wrapped.usage.prompt_tokens - 5  # no "You are a helpful assistant"
    streamed = list(
        oai.completions.create(
            model="deepseek-v4-flash", prompt=[0, 5, 6, 7], max_tokens=3, stream=True, extra_body={"raw": True}
        )
    )
    assert streamed[-1].choices[0].finish_reason == "length"
