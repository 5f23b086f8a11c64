"""Synthetic coding-agent prompts (dwarfstar/train/agent_prompts.py): their rendered length lies in the
asked range, the server turns each request body into exactly the ids training renders, every shape declares
its client's core tools, and a seed fixes the prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dwarfstar.prompt.conversation import tool_schema
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import DS4, OFFICIAL
from dwarfstar.serving.anthropic import HiddenThinking, anthropic_messages, anthropic_tools, system_text
from dwarfstar.serving.fields import Fields
from dwarfstar.serving.images import Images
from dwarfstar.serving.openai_chat import openai_messages, openai_tools
from dwarfstar.serving.responses import function_tools, input_messages
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.agent_prompts import SHAPES, AgentPrompt, agent_prompt, conversation, rendered_tokens, request_body
from dwarfstar.train.agent_text import BANK

RANGES = ((4000, 6000), (8000, 12000), (12000, 16000))
SEEDS = (0, 1)  # for the first range; the others take one seed each, 2 and 3
CASES = [(seed, RANGES[0]) for seed in SEEDS] + [(2, RANGES[1]), (3, RANGES[2])]
CORE = {  # the core tools: shape -> role -> (name, parameter, argument format)
    "messages": {
        "read": ("Read", "file_path", "{}"),
        "list": ("Bash", "command", "ls {}"),
        "search": ("Grep", "pattern", "{}"),
    },
    "responses": {
        "read": ("exec_command", "cmd", "cat {}"),
        "list": ("exec_command", "cmd", "ls {}"),
        "search": ("exec_command", "cmd", "grep -rn {} ."),
    },
    "chat": {"read": ("read", "filePath", "{}"), "list": ("list", "path", "{}"), "search": ("grep", "pattern", "{}")},
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), 129280)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> dict[tuple[str, int, tuple[int, int]], AgentPrompt]:
    count = lambda text: len(tok.encode(text))  # noqa: E731
    return {(s, seed, r): agent_prompt(s, seed, r, count) for s in SHAPES for seed, r in CASES}


def first_turn() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}]


def round_trip(prompt: AgentPrompt) -> list[dict[str, Any]]:
    read = prompt.core["read"]
    call = {"id": "call_0", "type": "function", "function": {"name": read.name}}
    call["function"]["arguments"] = {read.parameter: read.value.format("notes/todo.md")}
    return [
        {"role": "user", "content": "read the file `notes/todo.md`"},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants the file.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "- buy milk\n- call Lucia"},
        {"role": "assistant", "content": 'The file says: "buy milk".'},
    ]


def server_view(shape: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and tools the server's route for `shape` reads from the body, sent as JSON."""
    fields, images = Fields(json.loads(json.dumps(body))), Images(vision=False)
    if shape == "chat":
        return openai_messages(fields.array("messages"), images), openai_tools(fields)
    if shape == "messages":
        messages = anthropic_messages(fields.array("messages"), system_text(fields), images, HiddenThinking())
        return messages, anthropic_tools(fields)
    return input_messages(fields, images), function_tools(fields)


def test_rendered_tokens_lie_in_the_range(prompts: dict, tok: Tokenizer) -> None:
    for (shape, seed, (low, high)), prompt in prompts.items():
        parts = render_conversation(conversation(prompt, first_turn()), tools=prompt.tools, options=DS4).parts
        n = len(tok.encode_prompt(parts))
        assert low <= n <= high, (shape, seed, low, high, n)
        assert rendered_tokens(prompt, lambda text: len(tok.encode(text))) == n


@pytest.mark.parametrize("shape", SHAPES)
def test_the_server_renders_the_body_as_the_conversation(shape: str, prompts: dict, tok: Tokenizer) -> None:
    for seed in SEEDS:
        prompt = prompts[shape, seed, RANGES[0]]
        for turns in (first_turn(), round_trip(prompt)):
            messages, tools = server_view(shape, request_body(prompt, turns))
            assert tools == prompt.tools
            for options in (DS4, OFFICIAL):
                for thinking in (False, True):
                    ours = render_conversation(
                        conversation(prompt, turns), tools=prompt.tools, thinking=thinking, options=options
                    )
                    theirs = render_conversation(messages, tools=tools, thinking=thinking, options=options)
                    assert tok.encode_prompt(theirs.parts) == tok.encode_prompt(ours.parts)


def test_the_context_comes_before_the_first_words(prompts: dict) -> None:
    for (shape, _, _), prompt in prompts.items():
        words = conversation(prompt, first_turn())[-1]["content"]
        if shape == "responses":
            assert words == "hi" and prompt.preface[-1]["role"] == "user"
            assert "".join(b["text"] for b in prompt.preface[-1]["content"]) == prompt.context
        else:
            assert words == prompt.context + "hi"
        if shape == "chat":
            assert prompt.context == "" and not prompt.preface
            assert "<env>" in prompt.system or "\n# " in prompt.system
        if shape == "messages":
            body = request_body(prompt, first_turn())
            assert [b["text"] for b in body["messages"][0]["content"]] == [b["text"] for b in prompt.preface] + ["hi"]
            assert any("cache_control" in b for b in body["system"])


def test_core_tools_are_declared(prompts: dict) -> None:
    for (shape, _, _), prompt in prompts.items():
        declared = {tool_schema(t, "tools")["name"]: tool_schema(t, "tools") for t in prompt.tools}
        assert 10 <= len(prompt.tools) == len(declared) <= 20
        assert {role: (c.name, c.parameter, c.value) for role, c in prompt.core.items()} == CORE[shape]
        for core in prompt.core.values():
            schema = declared[core.name].get("parameters") or declared[core.name]["input_schema"]
            assert schema["properties"][core.parameter]["type"] == "string"
            assert core.parameter in schema["required"]
        key = {"chat": "function", "responses": "name", "messages": "input_schema"}[shape]
        assert all(key in t for t in prompt.tools)
        descriptions = [schema["description"] for schema in declared.values()]
        assert sum(d.count("\n- ") + d.count("\n* ") for d in descriptions) >= len(descriptions)  # usage notes


def test_bodies_are_valid_for_the_official_sdks(prompts: dict) -> None:
    pydantic = pytest.importorskip("pydantic")
    messages = pytest.importorskip("anthropic.types.message_create_params")
    chat = pytest.importorskip("openai.types.chat.completion_create_params")
    responses = pytest.importorskip("openai.types.responses.response_create_params")
    types = {
        "messages": messages.MessageCreateParamsStreaming,
        "chat": chat.CompletionCreateParamsStreaming,
        "responses": responses.ResponseCreateParamsStreaming,
    }
    for shape in SHAPES:
        prompt = prompts[shape, SEEDS[0], RANGES[0]]
        body = json.loads(json.dumps(request_body(prompt, round_trip(prompt))))
        pydantic.TypeAdapter(types[shape]).validate_python(body)
        assert body["stream"] is True and body["model"] == "deepseek-v4-flash"


def test_a_seed_fixes_the_prompt(prompts: dict, tok: Tokenizer) -> None:
    count = lambda text: len(tok.encode(text))  # noqa: E731
    for shape in SHAPES:
        again = agent_prompt(shape, SEEDS[0], RANGES[0], count)
        assert request_body(again, first_turn()) == request_body(prompts[shape, SEEDS[0], RANGES[0]], first_turn())
        one, two = (prompts[shape, seed, RANGES[0]] for seed in SEEDS)
        assert one.system != two.system and (shape == "chat" or one.context != two.context)
        assert [tool_schema(t, "tools")["description"] for t in one.tools] != [
            tool_schema(t, "tools")["description"] for t in two.tools
        ]


def test_a_range_too_small_for_the_tools_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="fits"):
        agent_prompt("chat", 0, (100, 200), lambda text: len(tok.encode(text)))
    with pytest.raises(ValueError, match="shape"):
        agent_prompt("completions", 0, (4000, 6000), len)


def test_each_condition_has_its_response() -> None:
    for name, block in BANK.items():
        assert len(block.get("cond", [])) == len(block.get("then", [])), name
