"""OpenAI Responses API (Codex) through the official `openai` SDK."""

from __future__ import annotations

import json

from conftest import TOOLS

FUNCTION_TOOLS = [{"type": "function", **TOOLS[0]["function"]}, {"type": "web_search"}]


def test_stream_event_order_with_reasoning_and_a_tool_call(oai):
    events = list(
        oai.responses.create(
            model="deepseek-v4-flash",
            instructions="You are a coding agent.",
            input="Weather? [[script:think_weather]]",
            tools=FUNCTION_TOOLS,
            reasoning={"effort": "high", "summary": "auto"},
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    reasoning, message, call = final.output
    assert reasoning.summary[0].text == "The user wants weather, so call the tool."
    assert message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": {"n": 3}}
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    assert final.status == "completed" and final.usage.output_tokens > 0
    # the tools it was sent, echoed (hosted ones too), in the first event and the last
    assert [t.model_dump(exclude_none=True) for t in final.tools] == FUNCTION_TOOLS
    assert [t.model_dump(exclude_none=True) for t in events[0].response.tools] == FUNCTION_TOOLS


def test_round_trip_with_encrypted_reasoning_reuses_the_live_session(oai):
    request = dict(
        model="deepseek-v4-flash",
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Go [[script:think_weather]]"}],
            }
        ],
        tools=FUNCTION_TOOLS,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium"},
    )
    first = oai.responses.create(**request)
    reasoning, message, call = first.output
    assert reasoning.summary == [] and reasoning.encrypted_content  # hidden, but carried for replay
    replay = [item.model_dump(exclude_none=True) for item in first.output]
    second = oai.responses.create(
        **{
            **request,
            "input": request["input"]
            + replay
            + [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
            "max_output_tokens": 3,
        }
    )
    assert second.status == "incomplete" and second.incomplete_details.reason == "max_output_tokens"
    # the reasoning came back through encrypted_content, so the whole first turn is reused
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1


def test_plain_text_response(oai):
    response = oai.responses.create(
        model="deepseek-v4-flash", input="[[script:hello]]", reasoning={"effort": "none"}, max_output_tokens=50
    )
    assert response.output_text == "Hello there, how can I help?" and response.status == "completed"
    assert response.usage.output_tokens_details.reasoning_tokens == 0
