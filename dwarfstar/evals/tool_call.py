"""`dwarfstar test tool-call`: ds4's tool-call-quality gate (`ds4_test --tool-call-quality`, §5.1).

ds4's request, sent to the real server application in process (Starlette's TestClient over the same
routes, renderer, scheduler and streaming DSML parser `dwarfstar serve` runs): one `list_files(path)`
tool, `think: false`, temperature 0, 256 tokens, a 32,768-token context. The reply must carry a tool
call to `list_files` whose arguments parse as a JSON object; a DSML block the parser cannot read ends
the turn without calls, finish `stop`, the block shown as text in the content (the server's invalid
tool call, README "Invalid tool calls"), and fails.

The server runs without its tool-call guard (prompt/dsml_guard.py), as ds4's does: the gate judges
the call the model writes, not one the guard kept to the declared tool.

A model that cannot make this call (the bundled one, trained on other tools) is checked against an
expectation file instead: the reply the reference backend gave through the same path
(`tools/make_gate_fixtures.py`), which must come back identical, tool calls, text and finish reason
included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dwarfstar.engine.load import Engine
from dwarfstar.evals import EvalError

TOOL_NAME = "list_files"
REQUEST: dict[str, Any] = {
    "model": "deepseek-v4-flash",
    "messages": [
        {
            "role": "user",
            "content": "List the files in the current directory. Use the provided tool; do not answer in prose.",
        }
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "List files in a directory.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "Directory path to list."}},
                    "required": ["path"],
                },
            },
        }
    ],
    "tool_choice": "auto",
    "think": False,
    "temperature": 0,
    "max_tokens": 256,
    "stream": False,
}
DEFAULT_CTX = 32768


@dataclass
class ToolCallResult:
    reply: dict[str, Any]  # what the gate compares: finish reason, text, calls
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def reply_of(response: dict[str, Any]) -> dict[str, Any]:
    """The part of an OpenAI chat completion the gate judges, ids and timings left out."""
    choice = response["choices"][0]
    message = choice["message"]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]
    return {
        "finish_reason": choice["finish_reason"],
        "content": message.get("content") or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": calls,
        "completion_tokens": response["usage"]["completion_tokens"],
    }


def call_problems(reply: dict[str, Any]) -> list[str]:
    """ds4's judgement: a parsed call to list_files (here also: with JSON object arguments)."""
    calls = reply["tool_calls"]
    if not calls:
        text = (reply["content"] or "")[:120]
        return [f"no tool call (finish {reply['finish_reason']}; text {text!r})"]
    if calls[0]["name"] != TOOL_NAME:
        return [f"the first tool call is {calls[0]['name']!r}, not {TOOL_NAME!r}"]
    try:
        arguments = json.loads(calls[0]["arguments"])
    except ValueError:
        return [f"the arguments are not JSON: {calls[0]['arguments']!r}"]
    return [] if isinstance(arguments, dict) else [f"the arguments are not an object: {arguments!r}"]


def ask_server(engine: Engine, ctx: int = DEFAULT_CTX) -> dict[str, Any]:
    """Send ds4's request through the server application; the completion JSON."""
    from starlette.testclient import TestClient

    from dwarfstar.serving.app import create_app
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service

    service = Service(engine, ServerConfig(ctx=ctx, max_sessions=1, tool_guard=False))
    with TestClient(create_app(service)) as client:
        response = client.post("/v1/chat/completions", json=REQUEST)
    if response.status_code != 200:
        raise EvalError(f"the server answered {response.status_code}: {response.text[:300]}")
    return response.json()


def read_expectation(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EvalError(f"cannot read tool-call expectation {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("reply"), dict):
        raise EvalError(f"{path}: an expectation is an object with a 'reply' object")
    return doc


def judge_reply(reply: dict[str, Any], expectation: dict[str, Any] | None = None) -> ToolCallResult:
    """ds4's check on a reply, or, given an expectation document, an exact comparison with its reply."""
    result = ToolCallResult(reply)
    if expectation is None:
        result.problems = call_problems(reply)
        return result
    wanted = expectation["reply"]
    for key in sorted(set(wanted) | set(reply)):
        if wanted.get(key) != reply.get(key):
            result.problems.append(f"{key}: got {reply.get(key)!r}, expected {wanted.get(key)!r}")
    if wanted.get("tool_calls"):  # an expected call must also be one ds4's check accepts
        result.problems += call_problems(reply)
    return result


def run_tool_call(engine: Engine, ctx: int = DEFAULT_CTX, expect: Path | None = None) -> ToolCallResult:
    expectation = read_expectation(expect) if expect is not None else None
    return judge_reply(reply_of(ask_server(engine, ctx)), expectation)
