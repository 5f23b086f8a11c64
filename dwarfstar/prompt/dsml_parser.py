"""Streaming parser for generated assistant text: reasoning, visible content and DSML tool calls.

It is the inverse of the renderer. The text the model generates after the prompt's
`<think>`/`</think>` is `[reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>][EOS]`.
Feeding that text in any chunks yields the same events and the same `ParsedCompletion`, and the
completion's message renders back to the same bytes (for blocks the renderer itself could produce).

Grammar of the block (whitespace between tags is free; the renderer writes one newline):

    <｜DSML｜tool_calls> ( <｜DSML｜invoke name="NAME"> PARAM* </｜DSML｜invoke> )+ </｜DSML｜tool_calls>
    PARAM := <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>

Names and keys are single lines. A parameter without `string=` is a string. The official format does
not escape values, so a value ends at the first `</｜DSML｜parameter>` that is followed by the next
parameter or by `</｜DSML｜invoke>`; any other occurrence is part of the value. `escaped=True` reads
ds4's escaping (entities in names, `&lt;/｜DSML｜parameter>` in values).

Never raises on bad input: a malformed or unterminated block is reported as a `ParseProblem` and its
raw text becomes ordinary content, so no part of the answer is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from dwarfstar.prompt.dsml import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    BLOCK_SEPARATOR,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_CLOSE_ESCAPED,
    PARAM_OPEN,
    unescape_attribute,
)
from dwarfstar.tokenizer import specials

# A name or key longer than this without its closing quote is model drift, not a name.
MAX_NAME_CHARS = 1024
_HEADER_ENDS = (('" string="true">', True), ('" string="false">', False), ('">', True))


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgumentsDelta:
    """A piece of the call's arguments JSON; the pieces of one call concatenate to `arguments_json`."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]
    # Arguments as the official decoder writes them: {"key": value, ...} with values typed by `string=`.
    arguments_json: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    call: ParsedToolCall


@dataclass(frozen=True, slots=True)
class ParseProblem:
    """Something in the text did not follow the format. `abandoned_calls` calls announced by
    `ToolCallStart` events belong to a block that was given up; they are not tool calls."""

    message: str
    abandoned_calls: int = 0


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolArgumentsDelta | ToolCallEnd | ParseProblem


@dataclass(slots=True)
class ParsedCompletion:
    reasoning: str | None
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # The exact bytes of the accepted DSML block (from its leading blank line), for exact replay.
    raw_dsml: str | None = None

    def to_openai_message(self, call_ids: list[str] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            ids = call_ids or [f"call_{i}" for i in range(len(self.tool_calls))]
            message["tool_calls"] = [call.to_openai(i) for call, i in zip(self.tool_calls, ids, strict=True)]
        return message


class _Phase(Enum):
    REASONING = auto()
    CONTENT = auto()
    BLOCK = auto()
    AFTER_BLOCK = auto()
    TEXT = auto()  # after a rejected block or stray text: everything is content
    END = auto()


class _In(Enum):
    INVOKES = auto()
    INVOKE_NAME = auto()
    PARAMS = auto()
    PARAM_HEADER = auto()
    PARAM_VALUE = auto()


def held_suffix(text: str, patterns: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `patterns`."""
    best = 0
    for pattern in patterns:
        for size in range(min(len(pattern) - 1, len(text)), best, -1):
            if text.endswith(pattern[:size]):
                best = size
                break
    return best


def _could_become(text: str, patterns: tuple[str, ...]) -> bool:
    return any(pattern.startswith(text) for pattern in patterns)


def _leading_space(text: str) -> int:
    return len(text) - len(text.lstrip())


class DsmlParser:
    """Feed generated text as it arrives; collect events; call `finish()` at the end of generation."""

    def __init__(self, *, thinking: bool, escaped: bool = False) -> None:
        self._escaped = escaped
        self._phase = _Phase.REASONING if thinking else _Phase.CONTENT
        self._buf = ""
        self._events: list[Event] = []
        self.completion = ParsedCompletion(reasoning="" if thinking else None)
        self._reset_block()

    def _reset_block(self) -> None:
        self._in = _In.INVOKES
        self._raw: list[str] = []
        self._calls: list[ParsedToolCall] = []
        self._name = ""
        self._args: dict[str, Any] = {}
        self._json_parts: list[str] = []
        self._key = ""
        self._is_string = True
        self._value_parts: list[str] = []
        self._scan = 0

    # -- public ---------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step(final=False):
            pass
        return self._drain()

    def finish(self) -> list[Event]:
        # Under `final` nothing waits any more: a block that is still open is rejected on the way.
        while self._step(final=True):
            pass
        return self._drain()

    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- event helpers --------------------------------------------------------------------------------------
    def _reasoning(self, text: str) -> None:
        if text:
            self.completion.reasoning = (self.completion.reasoning or "") + text
            self._events.append(ReasoningDelta(text))

    def _content(self, text: str) -> None:
        if text:
            self.completion.content += text
            self._events.append(ContentDelta(text))

    def _problem(self, message: str, abandoned: int = 0) -> None:
        self.completion.problems.append(message)
        self._events.append(ParseProblem(message, abandoned))

    def _arguments(self, text: str) -> None:
        self._json_parts.append(text)
        self._events.append(ToolArgumentsDelta(len(self._calls), text))

    def _take(self, size: int) -> str:
        """Consume `size` characters of block text, keeping them for replay or rejection."""
        taken, self._buf = self._buf[:size], self._buf[size:]
        self._raw.append(taken)
        return taken

    # -- phases ---------------------------------------------------------------------------------------------
    def _step(self, *, final: bool) -> bool:
        """Advance as far as the buffer allows; False when more text is needed (or there is nothing left)."""
        if self._phase is _Phase.REASONING:
            return self._step_reasoning(final)
        if self._phase in (_Phase.CONTENT, _Phase.TEXT):
            return self._step_content(final)
        if self._phase is _Phase.BLOCK:
            return self._step_block(final)
        if self._phase is _Phase.AFTER_BLOCK:
            return self._step_after_block(final)
        ignored = "text after the end-of-sentence token was ignored"
        if self._buf.strip() and ignored not in self.completion.problems:
            self._problem(ignored)
        self._buf = ""
        return False

    def _step_reasoning(self, final: bool) -> bool:
        buf = self._buf
        close, eos = buf.find(specials.THINK_END), buf.find(specials.EOS)
        if close >= 0 and (eos < 0 or close < eos):
            self._reasoning(buf[:close])
            self._buf = buf[close + len(specials.THINK_END) :]
            self._phase = _Phase.CONTENT
            return True
        if eos >= 0:
            self._reasoning(buf[:eos])
            self._buf = buf[eos + len(specials.EOS) :]
            self._problem("the reasoning was never closed with </think>")
            self._phase = _Phase.END
            return True
        keep = 0 if final else held_suffix(buf, (specials.THINK_END, specials.EOS))
        self._reasoning(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        if final and self.completion.reasoning is not None:
            self._problem("the reasoning was never closed with </think>")
            self._phase = _Phase.END
        return False

    def _step_content(self, final: bool) -> bool:
        buf = self._buf
        looks_for_block = self._phase is _Phase.CONTENT
        opener = buf.find(BLOCK_OPEN) if looks_for_block else -1
        eos = buf.find(specials.EOS)
        if opener >= 0 and (eos < 0 or opener < eos):
            start = opener - len(BLOCK_SEPARATOR) if buf[:opener].endswith(BLOCK_SEPARATOR) else opener
            self._content(buf[:start])
            self._buf = buf[start:]
            self._reset_block()
            self._take(opener - start + len(BLOCK_OPEN))
            self._phase = _Phase.BLOCK
            return True
        if eos >= 0:
            self._content(buf[:eos])
            self._buf = buf[eos + len(specials.EOS) :]
            self._phase = _Phase.END
            return True
        patterns = (BLOCK_SEPARATOR + BLOCK_OPEN, BLOCK_OPEN, specials.EOS) if looks_for_block else (specials.EOS,)
        keep = 0 if final else held_suffix(buf, patterns)
        self._content(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_after_block(self, final: bool) -> bool:
        rest = self._buf[_leading_space(self._buf) :]
        if rest.startswith(specials.EOS):
            self._buf = rest[len(specials.EOS) :]
            self._phase = _Phase.END
            return True
        if not rest:
            if final:
                self._buf = ""
            return False
        if not final and _could_become(rest, (specials.EOS,)):
            return False
        self._problem("text after the tool calls was kept as content")
        self._phase = _Phase.TEXT
        return True

    def _reject(self, why: str) -> None:
        """Give up on the block: its text so far becomes content; later text stays content."""
        inside_invoke = self._in in (_In.PARAMS, _In.PARAM_HEADER, _In.PARAM_VALUE)  # its start was announced
        self._problem(f"malformed tool-call block: {why}", abandoned=len(self._calls) + inside_invoke)
        self._content("".join(self._raw))
        self._reset_block()
        self._phase = _Phase.TEXT

    def _accept(self) -> None:
        if not self._calls:
            self._reject("it holds no invoke")
            return
        self.completion.tool_calls.extend(self._calls)
        self.completion.raw_dsml = "".join(self._raw)
        self._phase = _Phase.AFTER_BLOCK

    # -- inside the block -----------------------------------------------------------------------------------
    def _step_block(self, final: bool) -> bool:
        if self._in is _In.INVOKES:
            return self._expect((INVOKE_OPEN, BLOCK_CLOSE), final, "expected an invoke or the end of the block")
        if self._in is _In.PARAMS:
            return self._expect((PARAM_OPEN, INVOKE_CLOSE), final, "expected a parameter or the end of the invoke")
        if self._in is _In.INVOKE_NAME:
            return self._read_name((('">', True),), final)
        if self._in is _In.PARAM_HEADER:
            return self._read_name(_HEADER_ENDS, final)
        return self._read_value(final)

    def _expect(self, tags: tuple[str, str], final: bool, why: str) -> bool:
        self._take(_leading_space(self._buf))
        opener, closer = tags
        if self._buf.startswith(opener):
            self._take(len(opener))
            self._in = _In.INVOKE_NAME if opener == INVOKE_OPEN else _In.PARAM_HEADER
            return True
        if self._buf.startswith(closer):
            self._take(len(closer))
            if closer == BLOCK_CLOSE:
                self._accept()
            else:
                self._end_invoke()
            return True
        if not final and _could_become(self._buf, tags):
            return False
        self._reject(why if self._buf else "the tool-call block was not closed")
        return True

    def _read_name(self, ends: tuple[tuple[str, bool], ...], final: bool) -> bool:
        found = [(self._buf.find(end), end, is_string) for end, is_string in ends]
        found = [hit for hit in found if hit[0] >= 0]
        newline = self._buf.find("\n")
        if not found:
            if final or newline >= 0 or len(self._buf) > MAX_NAME_CHARS:
                self._reject("a name is not closed on its line")
                return True
            return False
        at, end, is_string = min(found, key=lambda hit: hit[0])
        if 0 <= newline < at:
            self._reject("a name is not closed on its line")
            return True
        name = self._take(at)
        self._take(len(end))
        if self._escaped:
            name = unescape_attribute(name)
        if self._in is _In.INVOKE_NAME:
            self._name, self._args, self._json_parts = name, {}, []
            self._events.append(ToolCallStart(len(self._calls), name))
            self._arguments("{")
            self._in = _In.PARAMS
            return True
        if name in self._args:
            self._reject(f"parameter {name!r} is given twice")
            return True
        self._key, self._is_string, self._value_parts, self._scan = name, is_string, [], 0
        self._args[name] = None  # reserve the key's place, in document order
        separator = ", " if len(self._args) > 1 else ""
        self._arguments(f"{separator}{json.dumps(name, ensure_ascii=False)}: " + ('"' if is_string else ""))
        self._in = _In.PARAM_VALUE
        return True

    def _value_text(self, size: int) -> None:
        """Move `size` characters of the value out of the buffer, streaming them if it is a string."""
        if not size:
            return
        text = self._take(size)
        if self._escaped:
            text = text.replace(PARAM_CLOSE_ESCAPED, PARAM_CLOSE)
        self._value_parts.append(text)
        if self._is_string:
            self._arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        self._scan = max(0, self._scan - size)

    def _read_value(self, final: bool) -> bool:
        while True:
            close = self._buf.find(PARAM_CLOSE, self._scan)
            if close < 0:
                if final:
                    self._reject("a parameter value was not closed")
                    return True
                closers = (PARAM_CLOSE, PARAM_CLOSE_ESCAPED) if self._escaped else (PARAM_CLOSE,)
                self._value_text(len(self._buf) - held_suffix(self._buf, closers))
                return False
            after = close + len(PARAM_CLOSE)
            tail = self._buf[after:].lstrip()
            if tail.startswith((PARAM_OPEN, INVOKE_CLOSE)):
                self._value_text(close)
                self._take(len(PARAM_CLOSE))
                self._end_param()
                return True
            if not final and _could_become(tail, (PARAM_OPEN, INVOKE_CLOSE)):
                self._value_text(close)  # the value surely runs up to here; whether it ends here waits
                return False
            self._scan = after  # a closing tag inside the value: it does not end the value

    def _end_param(self) -> None:
        value = "".join(self._value_parts)
        if self._is_string:
            self._args[self._key] = value
            self._arguments('"')
        else:
            try:
                self._args[self._key] = json.loads(value)
                self._arguments(value)
            except ValueError:
                self._problem(f'parameter {self._key!r} is marked string="false" but is not JSON; kept as text')
                self._args[self._key] = value
                self._arguments(json.dumps(value, ensure_ascii=False))
        self._in = _In.PARAMS

    def _end_invoke(self) -> None:
        self._arguments("}")
        call = ParsedToolCall(self._name, self._args, "".join(self._json_parts))
        self._events.append(ToolCallEnd(len(self._calls), call))
        self._calls.append(call)
        self._in = _In.INVOKES


def parse_completion(text: str, *, thinking: bool, escaped: bool = False) -> ParsedCompletion:
    """Parse a whole generated text at once (same result as streaming it)."""
    parser = DsmlParser(thinking=thinking, escaped=escaped)
    parser.feed(text)
    parser.finish()
    return parser.completion
