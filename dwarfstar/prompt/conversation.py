"""OpenAI-style messages checked and turned into the turns the renderer walks.

Accepted message shapes (anything else is a `PromptError` naming the message):
- `{"role": "system"|"developer", "content": ..., "tools"?: [...], "response_format"?: {...}}`;
  a system message may also carry `"in_place": true` (set by the Anthropic endpoint for a system
  entry inside `messages`): it renders where it stands under every template, never hoisted.
- `{"role": "user", "content": ..., "task"?: str}`
- `{"role": "assistant", "content"?: ..., "reasoning_content"?: str, "tool_calls"?: [...],
   "task"?: str, "wo_eos"?: bool}`
- `{"role": "tool", "tool_call_id"?: str, "content": ...}`
- `{"role": "latest_reminder", "content": str}`

`content` is a string, null, or a list of `{"type": "text", "text": ...}` parts, which are joined
with nothing between them. A tool message's list content follows the official encoder instead:
text parts joined by blank lines, any other part written as `[Unsupported TYPE]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.dsml import ToolCall, arguments_object
from dwarfstar.tokenizer.specials import TASK_TOKENS

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


class PromptError(DwarfStarError):
    """A conversation that cannot be rendered (unknown role, malformed tool call, ...)."""


@dataclass(slots=True)
class ToolResult:
    call_id: str
    content: str


@dataclass(slots=True)
class Turn:
    role: str
    text: str = ""
    # A user turn is a list of texts and tool results (several messages can merge into one turn).
    pieces: list[str | ToolResult] = field(default_factory=list)
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)
    tools: list[Mapping[str, Any]] = field(default_factory=list)
    response_format: Mapping[str, Any] | None = None
    task: str | None = None
    wo_eos: bool = False
    in_place: bool = False  # a system turn kept at its position even in ds4's hoisted system block


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise PromptError(f"{where}: only text content parts can be rendered, got {part!r:.80}")
            texts.append(part["text"])
        return "".join(texts)
    raise PromptError(f"{where}: content must be a string, null or a list of text parts")


def _tool_result_text(content: Any, where: str) -> str:
    if not isinstance(content, list):
        return _text(content, where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        texts.append((part.get("text") or "") if kind == "text" else f"[Unsupported {kind}]")
    return "\n\n".join(texts)


def tool_schema(tool: Any, where: str) -> Mapping[str, Any]:
    """The function object of an OpenAI tool (`{"type": "function", "function": {...}}`), or a bare one."""
    if isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
        return tool["function"]
    if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
        return tool
    raise PromptError(f"{where}: a tool must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.80}")


def _tool_calls(raw: Any, where: str) -> tuple[list[ToolCall], list[str]]:
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise PromptError(f"{where}: tool_calls must be a list")
    calls, ids = [], []
    for n, item in enumerate(raw):
        function = item.get("function") if isinstance(item, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptError(f"{where}: tool_calls[{n}] needs function.name")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str | Mapping):
            raise PromptError(f"{where}: tool_calls[{n}].function.arguments must be JSON text or an object")
        calls.append(ToolCall(function["name"], arguments_object(arguments)))
        ids.append(item.get("id") or function.get("id") or "")
    return calls, ids


def _task(message: Mapping[str, Any], where: str) -> str | None:
    task = message.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise PromptError(f"{where}: unknown task {task!r}; known: {', '.join(TASK_TOKENS)}")
    return task


def to_turn(message: Any, index: int) -> Turn:
    """One message as a turn; a tool message becomes a user turn holding one tool result."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise PromptError(f"{where}: a message must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise PromptError(f"{where}: unknown role {role!r}; known: {', '.join(ROLES)}")
    if message.get("tools") and role not in ("system", "developer"):
        raise PromptError(f"{where}: tools can only be given on a system or developer message")
    content = message.get("content")
    if role == "tool":
        result = ToolResult(str(message.get("tool_call_id") or ""), _tool_result_text(content, where))
        return Turn("user", pieces=[result])
    if role == "user":
        return Turn("user", pieces=[_text(content, where)], task=_task(message, where))
    text = _text(content, where)
    if role in ("system", "developer"):
        if role == "developer" and not text:
            raise PromptError(f"{where}: a developer message needs content")
        tools = message.get("tools") or []
        if not isinstance(tools, list):
            raise PromptError(f"{where}: tools must be a list")
        for n, tool in enumerate(tools):
            tool_schema(tool, f"{where}.tools[{n}]")
        response_format = message.get("response_format")
        if response_format is not None and not isinstance(response_format, Mapping):
            raise PromptError(f"{where}: response_format must be an object")
        in_place = role == "system" and message.get("in_place") is True
        return Turn(role, text=text, tools=list(tools), response_format=response_format, in_place=in_place)
    if role == "latest_reminder":
        return Turn(role, text=text)
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise PromptError(f"{where}: reasoning_content must be a string")
    calls, ids = _tool_calls(message.get("tool_calls"), where)
    return Turn(
        "assistant",
        text=text,
        reasoning=reasoning,
        tool_calls=calls,
        tool_call_ids=ids,
        task=_task(message, where),
        wo_eos=bool(message.get("wo_eos", False)),
    )


def to_turns(messages: Sequence[Any]) -> list[Turn]:
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise PromptError("messages must be a list of message objects")
    return [to_turn(message, i) for i, message in enumerate(messages)]
