"""Request shapes current Claude Code (2.1.x) sends to `/v1/messages`, checked against the rendered bytes.

Claude Code puts its environment notes in a `system` entry inside `messages`, after the first user
message, and sends `thinking: {"type": "adaptive", "display": "omitted"}`, `context_management` and
`output_config.effort` on every request. The expected prompts are written out from the DeepSeek V4
format (ds4 template: the top-level system text first, then the turns).
"""

from __future__ import annotations

import orjson

from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import OFFICIAL

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
ENV = "# Environment\nPrimary working directory: /tmp/work"
TOOL = {"name": "get_weather", "description": "Weather forecast for a city.", "input_schema": {"type": "object"}}
CLAUDE_CODE_FIELDS = {
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "someone"},
}


def post(http, body: dict):
    return http.post("/v1/messages", json={"model": "deepseek-v4-flash", "max_tokens": 64, **body})


def last_record(server, api: str = "messages") -> dict:
    return [r for r in server.trace_records() if r["api"] == api][-1]


def first_turn(marker: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": f"hi {marker}"}]},
        {"role": "system", "content": [{"type": "text", "text": ENV, "cache_control": {"type": "ephemeral"}}]},
    ]


def test_system_entry_renders_in_place_and_opens_the_answer_after_it(http, server):
    response = post(
        http, {"system": "Be brief.", "messages": first_turn("[[script:hello]]"), "thinking": {"type": "disabled"}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": "Hello there, how can I help?"}]
    expected = f"{BOS}Be brief.{USER}hi [[script:hello]]{ENV}{ASSISTANT}</think>"
    assert last_record(server)["prompt"] == expected


def test_system_entry_prompt_is_a_byte_prefix_of_the_next_turn(http, server):
    """Claude Code's shape over two turns (tools and adaptive thinking): turn 2 reuses turn 1's KV."""
    messages = first_turn("[[script:think_hello]]")
    body = {"system": "Be brief.", "tools": [TOOL], **CLAUDE_CODE_FIELDS}
    first = post(http, {**body, "messages": messages})
    assert first.status_code == 200, first.text
    turn1 = last_record(server)
    content = first.json()["content"]
    assert [block["type"] for block in content] == ["thinking", "text"]
    # display "omitted": the thinking block comes back empty, with its signature
    assert content[0]["thinking"] == "" and content[0]["signature"] == first.json()["id"]
    assert content[1]["text"] == "Hello!"
    assert turn1["prompt"].endswith(f"hi [[script:think_hello]]{ENV}{ASSISTANT}<think>")

    # Claude Code sends the hidden thinking back empty, with its signature: the server puts it back
    history = [{"role": "assistant", "content": [{**content[0]}, {"type": "text", "text": "Hello!"}]}]
    second = post(http, {**body, "messages": messages + history + [{"role": "user", "content": "again"}]})
    assert second.status_code == 200, second.text
    turn2 = last_record(server)
    assert turn1["generated"] == "A greeting deserves a greeting.</think>Hello!"
    assert turn2["prompt"] == turn1["prompt"] + turn1["generated"] + f"{EOS}{USER}again{ASSISTANT}<think>"
    # the whole first turn is reused, its sampled reasoning included
    assert turn2["cached_tokens"] >= turn1["prompt_tokens"] + turn1["completion_tokens"] - 1

    # an empty block whose signature this server never gave stays empty
    history[0]["content"][0] = {"type": "thinking", "thinking": "", "signature": "msg_unknown"}
    third = post(http, {**body, "messages": messages + history + [{"role": "user", "content": "again"}]})
    assert third.status_code == 200, third.text
    assert last_record(server)["prompt"] == turn1["prompt"] + f"</think>Hello!{EOS}{USER}again{ASSISTANT}<think>"


def test_adaptive_thinking_and_output_config_effort(http, server):
    messages = [{"role": "user", "content": "hi [[script:think_hello]]"}]
    response = post(http, {"messages": messages, "thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}})
    assert response.status_code == 200, response.text
    # thinking on, text shown; effort "max" needs a context of 393,216 tokens, so no Think-Max preamble at 4096
    assert response.json()["content"][0] == {
        "type": "thinking",
        "thinking": "A greeting deserves a greeting.",
        "signature": response.json()["id"],
    }
    assert last_record(server)["prompt"] == f"{BOS}{USER}hi [[script:think_hello]]{ASSISTANT}<think>"

    response = post(http, {"messages": messages, "thinking": {"type": "adaptive"}, "output_config": {"effort": "none"}})
    assert response.status_code == 200, response.text
    assert last_record(server)["prompt"] == f"{BOS}{USER}hi [[script:think_hello]]{ASSISTANT}</think>"


def test_context_management_is_accepted_and_leaves_the_prompt_alone(http, server):
    messages = [{"role": "user", "content": "hi [[script:hello]]"}]
    plain = post(http, {"messages": messages, "thinking": {"type": "disabled"}})
    assert plain.status_code == 200, plain.text
    without = last_record(server)["prompt"]
    managed = post(
        http,
        {
            "messages": messages,
            "thinking": {"type": "disabled"},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking"}]},
        },
    )
    assert managed.status_code == 200, managed.text
    assert last_record(server)["prompt"] == without == f"{BOS}{USER}hi [[script:hello]]{ASSISTANT}</think>"


def test_output_config_format_becomes_the_response_format(http, server):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    body = {
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi [[script:hello]]"}],
        "thinking": {"type": "disabled"},
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    response = post(http, body)
    assert response.status_code == 200, response.text
    schema_json = orjson.dumps({"type": "json_schema", "json_schema": {"schema": schema}}).decode()
    intro = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    expected = f"{BOS}Be brief.\n\n{intro}{schema_json}{USER}hi [[script:hello]]{ASSISTANT}</think>"
    assert last_record(server)["prompt"] == expected


def test_streamed_omitted_thinking_sends_the_block_without_its_text(http):
    body = {"messages": [{"role": "user", "content": "hi [[script:think_hello]]"}], "stream": True, "tools": [TOOL]}
    body["thinking"] = {"type": "adaptive", "display": "omitted"}
    with http.stream("POST", "/v1/messages", json={"model": "deepseek-v4-flash", "max_tokens": 64, **body}) as r:
        events = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and deltas[0] == "signature_delta" and "text_delta" in deltas
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]


def anthropic_400(response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_what_is_still_rejected_names_the_field(http):
    user = [{"role": "user", "content": "hi"}]
    assert "messages[1]" in anthropic_400(post(http, {"messages": [*user, {"role": "tool", "content": "x"}]}))
    bad_edit = {"messages": user, "context_management": {"edits": ["clear"]}}
    assert "context_management.edits[0]" in anthropic_400(post(http, bad_edit))
    bad_management = {"messages": user, "context_management": {"edits": {}}}
    assert "context_management.edits" in anthropic_400(post(http, bad_management))
    bad_format = {"messages": user, "output_config": {"format": {"type": "xml"}}}
    assert "output_config.format" in anthropic_400(post(http, bad_format))
    bad_effort = {"messages": user, "output_config": {"effort": "huge"}}
    assert "output_config.effort" in anthropic_400(post(http, bad_effort))
    bad_display = {"messages": user, "thinking": {"type": "adaptive", "display": "loud"}}
    assert "thinking.display" in anthropic_400(post(http, bad_display))
    bad_budget = {"messages": user, "thinking": {"type": "enabled", "budget_tokens": "lots"}}
    assert "thinking.budget_tokens" in anthropic_400(post(http, bad_budget))


def test_official_template_renders_a_trailing_system_entry_in_place():
    """Officially a system message that is not first is its bare text; the answer opens after it."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": ENV, "in_place": True},
    ]
    prompt = render_conversation(messages, thinking=True, options=OFFICIAL)
    assert prompt.text == f"{BOS}Be brief.{USER}hi{ENV}{ASSISTANT}<think>"
    messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]
    second = render_conversation(messages, thinking=False, options=OFFICIAL)
    assert second.text == f"{BOS}Be brief.{USER}hi{ENV}{ASSISTANT}</think>Hello!{EOS}{USER}again{ASSISTANT}</think>"
