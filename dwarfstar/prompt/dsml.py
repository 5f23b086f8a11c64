"""DSML, DeepSeek V4's tool-call markup, rendered from tool calls.

A block as the official encoder writes it (after the assistant's visible text):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw string</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Invokes, and parameters inside an invoke, are separated by one newline; an invoke without
parameters has an empty line between its tags. `｜DSML｜` is a control token wherever it appears
in a tag; names and values are plain text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import Control, PromptPart

DSML = specials.DSML
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"
# ds4's escape for a string value that contains the closing tag itself.
PARAM_CLOSE_ESCAPED = f"&lt;/{DSML}parameter>"
PARAM_CLOSE_JSON_ESCAPED = f"\\u003c/{DSML}parameter>"
BLOCK_SEPARATOR = "\n\n"

_ATTRIBUTE_ESCAPES = (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call as rendered: the tool's name and its arguments, in order."""

    name: str
    arguments: Mapping[str, Any]


def to_json(value: Any, *, compact: bool = False) -> str:
    """JSON text as the official encoder writes it: non-ASCII kept, `", "`/`": "` separators unless compact."""
    separators = (",", ":") if compact else (", ", ": ")
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, separators=separators)


def arguments_object(arguments: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The argument mapping a tool call renders.

    OpenAI sends arguments as JSON text. Text that is not a JSON object renders as one string
    parameter named "arguments" holding it verbatim (the official encoder does this for invalid
    JSON; for valid non-object JSON it would crash). A mapping is taken as is, None as no arguments.
    """
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def escape_attribute(text: str) -> str:
    for raw, entity in _ATTRIBUTE_ESCAPES:
        text = text.replace(raw, entity)
    return text


def unescape_attribute(text: str) -> str:
    for raw, entity in reversed(_ATTRIBUTE_ESCAPES):
        text = text.replace(entity, raw)
    return text


def _tag(name: str) -> list[PromptPart]:
    """`<｜DSML｜name` or `</｜DSML｜name` split at the control token; `name` starts after the DSML token."""
    opener, rest = name.split(DSML, 1)
    return [opener, Control(DSML), rest]


def render_tool_calls(
    calls: Sequence[ToolCall], *, compact_json: bool = False, escape: bool = False
) -> list[PromptPart]:
    """The DSML block for `calls`, including the blank line that separates it from the visible text."""
    parts: list[PromptPart] = [BLOCK_SEPARATOR, *_tag(BLOCK_OPEN), "\n"]
    for index, call in enumerate(calls):
        if index:
            parts.append("\n")
        name = escape_attribute(call.name) if escape else call.name
        parts += [*_tag(INVOKE_OPEN), f'{name}">\n']
        for position, (key, value) in enumerate(call.arguments.items()):
            if position:
                parts.append("\n")
            is_string = isinstance(value, str)
            if is_string:
                text = value.replace(PARAM_CLOSE, PARAM_CLOSE_ESCAPED) if escape else value
            else:
                text = to_json(value, compact=compact_json)
                if escape:
                    text = text.replace(PARAM_CLOSE, PARAM_CLOSE_JSON_ESCAPED)
            key_text = escape_attribute(str(key)) if escape else str(key)
            flag = "true" if is_string else "false"
            parts += [*_tag(PARAM_OPEN), f'{key_text}" string="{flag}">', text, *_tag(PARAM_CLOSE)]
        parts += ["\n", *_tag(INVOKE_CLOSE)]
    parts += ["\n", *_tag(BLOCK_CLOSE)]
    return parts
