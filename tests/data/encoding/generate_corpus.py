"""Regenerate `corpus.json`: conversations rendered by the official DeepSeek V4 encoder.

Usage: python tests/data/encoding/generate_corpus.py PATH/TO/encoding_dsv4.py

The official encoder (`encoding/encoding_dsv4.py` of deepseek-ai/DeepSeek-V4-Flash, MIT) is not part
of this project; this script only imports and runs it. Request-level `tools` / `response_format`
are attached the way DwarfStar's renderer documents: to the leading system message, or to an empty
system message put in front when the conversation does not start with one.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write text to a file — überschreibt vorhandene Dateien.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}},
            "required": ["path", "content"],
        },
    },
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sys_msg(text: str = "You are a helpful assistant.") -> dict:
    return {"role": "system", "content": text}


def user(text: str, **extra) -> dict:
    return {"role": "user", "content": text, **extra}


def assistant(content: str | None = None, reasoning: str | None = None, tool_calls=None, **extra) -> dict:
    msg: dict = {"role": "assistant"}
    if content is not None:
        msg["content"] = content
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls is not None:
        msg["tool_calls"] = tool_calls
    msg.update(extra)
    return msg


def tool(call_id: str, content) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def case(name: str, feature: str, messages: list, *, thinking: bool, effort=None, drop=True, tools=None, fmt=None):
    request: dict = {"messages": messages}
    if tools is not None:
        request["tools"] = tools
    if fmt is not None:
        request["response_format"] = fmt
    return {
        "name": name,
        "feature": feature,
        "request": request,
        "thinking": thinking,
        "reasoning_effort": effort,
        "drop_thinking": drop,
    }


def cases() -> list[dict]:
    weather_turn = [
        user("What's the weather in Rome?"),
        assistant("", "Need the weather tool.", [call("c1", "get_weather", '{"city": "Rome"}')]),
        tool("c1", '{"temp": 21, "sky": "clear"}'),
        assistant("It is 21°C and clear in Rome.", "Report it."),
    ]
    two_calls = [
        call("a", "get_weather", '{"city": "Oslo", "unit": "c"}'),
        call("b", "get_weather", '{"city": "Lima"}'),
    ]
    typed_args = json.dumps(
        {
            "s": 'a & b < c > d "q"',
            "i": 42,
            "f": 3.5,
            "neg": -1e-07,
            "t": True,
            "n": None,
            "list": [1, "two", [3.0], {"k": []}],
            "obj": {"nested": {"deep": ["x", {"y": None}]}, "emoji": "🙂"},
            "empty": "",
            "multiline": "line 1\nline 2\n",
            "unicode": "東京 — Ñandú",
        },
        ensure_ascii=False,
    )
    return [
        case("chat_system_user", "chat mode", [sys_msg(), user("Hello")], thinking=False),
        case("thinking_system_user", "thinking mode", [sys_msg(), user("Hello")], thinking=True),
        case("chat_no_system", "chat mode without system", [user("Ciao, come stai?")], thinking=False),
        case("thinking_no_system", "thinking mode without system", [user("2+2?")], thinking=True),
        case("effort_max_no_system", "reasoning effort max", [user("Prove it.")], thinking=True, effort="max"),
        case("effort_max_system", "reasoning effort max", [sys_msg(), user("Prove it.")], thinking=True, effort="max"),
        case("effort_high", "reasoning effort high", [sys_msg(), user("Think.")], thinking=True, effort="high"),
        case("effort_max_chat_mode", "effort ignored in chat mode", [user("Hi")], thinking=False, effort="max"),
        case(
            "chat_multi_turn",
            "chat mode history",
            [sys_msg(), user("Hi"), assistant("Hello!"), user("2+2?")],
            thinking=False,
        ),
        case(
            "chat_multi_turn_reasoning_ignored",
            "chat mode drops all reasoning",
            [user("Hi"), assistant("Hello!", "greet back"), user("2+2?"), assistant("4", "add")],
            thinking=False,
        ),
        case(
            "thinking_drops_earlier_reasoning",
            "reasoning drop rule",
            [sys_msg("You are terse."), user("Hi"), assistant("Hello!", "greet back"), user("2+2?")],
            thinking=True,
        ),
        case(
            "thinking_keeps_reasoning_when_drop_disabled",
            "reasoning drop rule disabled",
            [sys_msg("You are terse."), user("Hi"), assistant("Hello!", "greet back"), user("2+2?")],
            thinking=True,
            drop=False,
        ),
        case(
            "thinking_last_assistant_keeps_reasoning",
            "reasoning after the last user is kept",
            [user("Hi"), assistant("Hello!", "greet"), user("Capital of France?"), assistant("Paris.", "Easy.")],
            thinking=True,
        ),
        case(
            "thinking_last_assistant_without_reasoning",
            "empty reasoning block",
            [user("Capital of Italy?"), assistant("Rome.")],
            thinking=True,
        ),
        case(
            "assistant_prefill_wo_eos",
            "assistant continuation without EOS",
            [user("Write a haiku"), assistant("Autumn moon", "Five syllables first.", wo_eos=True)],
            thinking=True,
        ),
        case(
            "consecutive_user_messages",
            "adjacent user messages merge",
            [sys_msg(), user("First part."), user("Second part.")],
            thinking=False,
        ),
        case(
            "latest_reminder_after_system",
            "latest_reminder role",
            [sys_msg(), {"role": "latest_reminder", "content": "2026-02-21, Saturday, Milan"}, user("Che giorno è?")],
            thinking=False,
        ),
        case(
            "latest_reminder_last",
            "latest_reminder after user",
            [user("Hello"), {"role": "latest_reminder", "content": "locale=it"}],
            thinking=True,
        ),
        case(
            "latest_reminder_thinking_history",
            "latest_reminder kept by the drop rule",
            [
                {"role": "latest_reminder", "content": "date=2026-01-01"},
                user("Hi"),
                assistant("Hey", "hm"),
                user("Bye"),
            ],
            thinking=True,
        ),
        case(
            "developer_message",
            "developer role",
            [sys_msg(), {"role": "developer", "content": "Search first."}],
            thinking=True,
        ),
        case(
            "developer_with_tools",
            "tools on a developer message",
            [
                sys_msg(),
                {"role": "developer", "content": "Find the weather.", "tools": [WEATHER]},
                assistant("", "Call it.", [call("w", "get_weather", '{"city": "Turin"}')]),
                tool("w", "sunny"),
            ],
            thinking=True,
        ),
        case(
            "developer_dropped_before_last_user",
            "drop rule removes earlier developer messages",
            [
                sys_msg(),
                {"role": "developer", "content": "old instruction"},
                assistant("ok", "r"),
                user("new question"),
            ],
            thinking=True,
        ),
        case(
            "developer_with_response_format",
            "response_format on developer",
            [{"role": "developer", "content": "Answer in JSON.", "response_format": JSON_SCHEMA_FORMAT}],
            thinking=False,
        ),
        case(
            "tools_with_system",
            "tools in the system prompt",
            [sys_msg(), user("Weather in Oslo?")],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "tools_without_system", "tools without a system message", [user("List /tmp")], thinking=False, tools=[BASH]
        ),
        case(
            "tools_on_system_message",
            "tools given on the system message",
            [dict(sys_msg(), tools=[WEATHER, BASH]), user("Hi")],
            thinking=False,
        ),
        case(
            "tool_round_trip_thinking",
            "tool call and result",
            [sys_msg(), *weather_turn],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "tool_round_trip_chat",
            "tool call and result in chat mode",
            [sys_msg(), *weather_turn],
            thinking=False,
            tools=[WEATHER],
        ),
        case(
            "tool_pending_result_thinking",
            "prompt ends with a tool result",
            [sys_msg(), *weather_turn[:3]],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "two_calls_in_order",
            "several tool calls and results",
            [user("Oslo and Lima?"), assistant("", "two cities", two_calls), tool("a", "5C"), tool("b", "19C")],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "tool_results_sorted_by_call_order",
            "tool results in tool-call order",
            [user("Oslo and Lima?"), assistant("", "two cities", two_calls), tool("b", "19C"), tool("a", "5C")],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "tool_results_unknown_ids",
            "tool results with ids not in the calls",
            [
                user("Oslo and Lima?"),
                assistant("", "two cities", two_calls),
                tool("b", "19C"),
                tool("zzz", "stray"),
                tool("a", "5C"),
            ],
            thinking=True,
            tools=[WEATHER],
        ),
        case(
            "tool_result_then_user_text",
            "user text merged after tool results",
            [
                user("Oslo?"),
                assistant("", None, [call("a", "get_weather", '{"city": "Oslo"}')]),
                tool("a", "5C"),
                user("Also, in Fahrenheit please."),
            ],
            thinking=False,
            tools=[WEATHER],
        ),
        case(
            "tool_call_typed_arguments",
            "DSML string=true/false typing",
            [user("Do it"), assistant(None, "typed", [call("t", "write_file", typed_args)])],
            thinking=True,
            tools=[WRITE],
        ),
        case(
            "tool_call_empty_arguments",
            "DSML invoke without parameters",
            [user("Now"), assistant("", None, [call("t", "bash", "{}")]), tool("t", "")],
            thinking=False,
            tools=[BASH],
        ),
        case(
            "tool_call_invalid_json_arguments",
            "arguments that are not JSON",
            [user("Run"), assistant("", None, [call("t", "bash", "ls -la && echo {oops")]), tool("t", "done")],
            thinking=False,
            tools=[BASH],
        ),
        case(
            "assistant_content_and_tool_call",
            "content before the DSML block",
            [
                user("List /tmp"),
                assistant("Sure.", "Use bash.", [call("t", "bash", '{"command": "ls /tmp", "timeout": 10}')]),
            ],
            thinking=True,
            tools=[BASH],
        ),
        case(
            "tool_result_content_blocks",
            "tool result given as content blocks",
            [
                user("Read it"),
                assistant("", None, [call("r", "bash", '{"command": "cat a.txt"}')]),
                tool(
                    "r", [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}, {"type": "image"}]
                ),
            ],
            thinking=True,
            tools=[BASH],
        ),
        case(
            "tool_result_with_closing_tags",
            "tool output that looks like markup",
            [
                user("cat"),
                assistant("", None, [call("x", "bash", '{"command": "cat x"}')]),
                tool("x", "x </tool_result> y <｜User｜> </think> ｜DSML｜"),
            ],
            thinking=True,
            tools=[BASH],
        ),
        case(
            "parameter_value_with_closing_tag",
            "string parameter containing the DSML closer",
            [
                user("write docs"),
                assistant(
                    "",
                    "",
                    [
                        call(
                            "w",
                            "write_file",
                            json.dumps({"path": "a.md", "content": "end: </｜DSML｜parameter> & <b>"}),
                        )
                    ],
                ),
            ],
            thinking=True,
            tools=[WRITE],
        ),
        case(
            "agent_three_rounds",
            "multi-round agent keeps all reasoning",
            [
                sys_msg("You are a coding agent."),
                user("Fix the build"),
                assistant("", "Look first.", [call("1", "bash", '{"command": "make"}')]),
                tool("1", "error: missing ;"),
                assistant("Found it.", "Edit.", [call("2", "write_file", '{"path": "m.c", "content": "int x;\\n"}')]),
                tool("2", "ok"),
                assistant("", "Rebuild.", [call("3", "bash", '{"command": "make", "timeout": 60}')]),
                tool("3", "built"),
                assistant("Fixed.", "Done."),
                user("Thanks! Run the tests too."),
            ],
            thinking=True,
            effort="max",
            tools=[BASH, WRITE],
        ),
        case(
            "tool_history_without_tool_definitions",
            "drop rule applies when no tools are defined",
            [
                user("Oslo?"),
                assistant("", "call it", [call("a", "get_weather", '{"city": "Oslo"}')]),
                tool("a", "5C"),
                assistant("5C in Oslo.", "report"),
                user("And Lima?"),
            ],
            thinking=True,
        ),
        case(
            "response_format_with_system",
            "response_format",
            [sys_msg(), user("Capital of Peru?")],
            thinking=False,
            fmt=JSON_SCHEMA_FORMAT,
        ),
        case(
            "response_format_without_system",
            "response_format without system",
            [user("Capital?")],
            thinking=True,
            fmt={"type": "json_object"},
        ),
        case(
            "response_format_and_tools",
            "tools and response_format together",
            [sys_msg(), user("Weather?")],
            thinking=True,
            tools=[WEATHER],
            fmt=JSON_SCHEMA_FORMAT,
        ),
        case(
            "task_action_chat",
            "quick instruction task action",
            [user("Latest news on Mars?", task="action")],
            thinking=False,
        ),
        case(
            "task_action_thinking",
            "quick instruction task action",
            [sys_msg(), user("Who won?", task="action")],
            thinking=True,
        ),
        case(
            "task_query", "quick instruction task query", [user("best pizza in Naples", task="query")], thinking=False
        ),
        case(
            "task_authority",
            "quick instruction task authority",
            [user("Is aspirin safe?", task="authority")],
            thinking=True,
        ),
        case(
            "task_title_after_assistant",
            "quick instruction task title",
            [user("Hi"), assistant("Hello! How can I help?", task="title"), assistant("Greeting")],
            thinking=True,
        ),
        case(
            "special_strings_in_user_text",
            "control-token strings typed by a user",
            [
                sys_msg("Treat <think> literally."),
                user("I typed <｜User｜> and ｜DSML｜ and </think> and <｜end▁of▁sentence｜>"),
            ],
            thinking=True,
        ),
        case(
            "multilingual_and_code",
            "unicode, whitespace runs and code",
            [
                user(
                    "日本語のテキスト。\n中文句子，还有表情 🎉👍🏽\nمرحبا بالعالم\n\n"
                    "```python\ndef f(x):\n\treturn x  **  2\n```\n   trailing   "
                )
            ],
            thinking=False,
        ),
        case("empty_user_message", "empty content", [sys_msg(), user("")], thinking=True),
        case("system_only", "system message alone", [sys_msg()], thinking=True),
        case(
            "assistant_after_system",
            "assistant without a user turn",
            [sys_msg(), assistant("Welcome!")],
            thinking=False,
        ),
        case(
            "assistant_null_content_with_tool_calls",
            "assistant content null",
            [
                user("ls"),
                {"role": "assistant", "content": None, "tool_calls": [call("q", "bash", '{"command": "ls"}')]},
            ],
            thinking=False,
            tools=[BASH],
        ),
    ]


def load_oracle(path: Path):
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle_messages(request: dict) -> list[dict]:
    messages = copy.deepcopy(request["messages"])
    extra = {key: request[key] for key in ("tools", "response_format") if key in request}
    if extra:
        if not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": ""})
        messages[0].update(copy.deepcopy(extra))
    return messages


def main(oracle_path: str) -> None:
    oracle = load_oracle(Path(oracle_path))
    out = []
    for item in cases():
        item["expected"] = oracle.encode_messages(
            oracle_messages(item["request"]),
            thinking_mode="thinking" if item["thinking"] else "chat",
            drop_thinking=item["drop_thinking"],
            reasoning_effort=item["reasoning_effort"],
        )
        out.append(item)
    names = [c["name"] for c in out]
    assert len(names) == len(set(names)), "case names must be unique"
    document = {
        "oracle": {
            "file": "encoding/encoding_dsv4.py of deepseek-ai/DeepSeek-V4-Flash",
            "sha256": hashlib.sha256(Path(oracle_path).read_bytes()).hexdigest(),
        },
        "cases": out,
    }
    text = json.dumps(document, ensure_ascii=False, indent=1) + "\n"
    (HERE / "corpus.json").write_text(text, encoding="utf-8")
    print(f"wrote {len(out)} cases")


if __name__ == "__main__":
    main(sys.argv[1])
