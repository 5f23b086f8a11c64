"""Streaming parser for generated assistant text: reasoning, visible content and DSML tool calls.

It is the inverse of the renderer. The text the model generates after the prompt's
`<think>`/`</think>` is `[reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>][EOS]`.
Feeding that text in any chunks yields the same events and the same `ParsedCompletion`, and the
completion's message renders back to the same bytes (for blocks the renderer itself could produce).

Grammar of the block (whitespace between tags is free; the renderer writes one newline):

    <｜DSML｜tool_calls> ( <｜DSML｜invoke name="NAME"> PARAM* </｜DSML｜invoke> )+ </｜DSML｜tool_calls>
    PARAM := <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>

Names and keys are single lines. A parameter without `string=` is a string. The official format does
not escape values, so a value ends at the first `</｜DSML｜parameter>` that is followed by structure:
the next parameter or `</｜DSML｜invoke>` (or, as repairs, the next invoke, the block's end or the end
of generation); any other occurrence is part of the value. `escaped=True` reads
ds4's escaping (entities in names, `&lt;/｜DSML｜parameter>` in values).

Tolerant of the drift long contexts bring (see `dsml_tags`): a misspelled tag reads as its canonical
self, an invoke left open ends at the next invoke or the block's end, and a block the model ended
(end-of-sentence, or `finish(ended=True)`) at a tag boundary is closed there. Each repair is noted in
`problems`; the calls are exact, and `raw_dsml` keeps the bytes as generated for replay.

Never raises on bad input. A block that cannot be repaired is an invalid tool call (ds4's term): it is
reported as a `ParseProblem`, its raw text, up to the end of generation, goes to `invalid_dsml` and
never into `content`, and it yields no calls (the server shows that text after the content and flags
the answer: serving/output.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from dwarfstar.prompt import dsml_tags
from dwarfstar.prompt.dsml import BLOCK_SEPARATOR, PARAM_CLOSE, PARAM_CLOSE_ESCAPED, unescape_attribute
from dwarfstar.prompt.dsml_tags import Tag
from dwarfstar.tokenizer import specials

# A name or key longer than this without its closing quote is model drift, not a name.
MAX_NAME_CHARS = 1024
_HEADER_ENDS = (('" string="true">', True), ('" string="false">', False), ('">', True))
INVALID_TOOL_CALL = "invalid tool call: "  # the problem that gives a block up starts so, then says why


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
    # The raw text of a block given up as an invalid tool call, to the end of generation.
    invalid_dsml: str | None = None

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
    TEXT = auto()  # after stray text following the block: everything is content
    INVALID = auto()  # after a block given up: everything up to the end-of-sentence is its text
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
        self._ended = False  # the model ended generation itself (so a block left open may be closed)
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

    def finish(self, *, ended: bool = False) -> list[Event]:
        """`ended`: the model ended the turn itself (its end-of-sentence token, not fed as text), as
        opposed to a length limit or stop string; a block it left open at a tag boundary is then closed."""
        # Under `final` nothing waits any more: a block that is still open is closed or given up on the way.
        self._ended = ended
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
        if self._phase is _Phase.INVALID:
            return self._step_invalid(final)
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
        opener = dsml_tags.BLOCK_OPEN.find(buf) if looks_for_block else None
        eos = buf.find(specials.EOS)
        if opener is not None and not opener.partial and (eos < 0 or opener.at < eos):
            start = self._separator_start(buf, opener.at)
            self._content(buf[:start])
            self._buf = buf[start:]
            self._reset_block()
            self._take(opener.at - start)
            self._take_tag(dsml_tags.BLOCK_OPEN, opener.size)
            self._phase = _Phase.BLOCK
            return True
        if eos >= 0:
            self._content(buf[:eos])
            self._buf = buf[eos + len(specials.EOS) :]
            self._phase = _Phase.END
            return True
        keep = 0
        if not final:
            # a trailing blank line may be the separator of a block still to come
            keep = held_suffix(buf, (BLOCK_SEPARATOR + "<", specials.EOS) if looks_for_block else (specials.EOS,))
            if opener is not None:  # the text ends inside what may be the block's opening tag
                keep = max(keep, len(buf) - self._separator_start(buf, opener.at))
        self._content(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    @staticmethod
    def _separator_start(buf: str, opener: int) -> int:
        """Where the block opening at `opener` starts: at its leading blank line when it has one."""
        return opener - len(BLOCK_SEPARATOR) if buf[:opener].endswith(BLOCK_SEPARATOR) else opener

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

    def _step_invalid(self, final: bool) -> bool:
        buf = self._buf
        eos = buf.find(specials.EOS)
        size = eos if eos >= 0 else len(buf) - (0 if final else held_suffix(buf, (specials.EOS,)))
        self.completion.invalid_dsml = (self.completion.invalid_dsml or "") + buf[:size]
        if eos >= 0:
            self._buf = buf[eos + len(specials.EOS) :]
            self._phase = _Phase.END
            return True
        self._buf = buf[size:]
        return False

    def _reject(self, why: str) -> None:
        """Give up on the block as an invalid tool call: its text, and all text after it, is kept aside."""
        inside_invoke = self._in in (_In.PARAMS, _In.PARAM_HEADER, _In.PARAM_VALUE)  # its start was announced
        self._problem(INVALID_TOOL_CALL + why, abandoned=len(self._calls) + inside_invoke)
        self.completion.invalid_dsml = "".join(self._raw)
        self._reset_block()
        self._phase = _Phase.INVALID

    def _repaired(self, what: str) -> None:
        self._problem(f"repaired tool call: {what}")

    def _take_tag(self, tag: Tag, size: int) -> None:
        if self._take(size) != tag.canonical:
            self._repaired(f"{tag.canonical!r} was misspelled")

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
            return self._expect(_BETWEEN_INVOKES, final, "expected an invoke or the end of the block")
        if self._in is _In.PARAMS:
            return self._expect(_BETWEEN_PARAMS, final, "expected a parameter or the end of the invoke")
        if self._in is _In.INVOKE_NAME:
            return self._read_name((('">', True),), final)
        if self._in is _In.PARAM_HEADER:
            return self._read_name(_HEADER_ENDS, final)
        return self._read_value(final)

    def _expect(self, tags: tuple[Tag, ...], final: bool, why: str) -> bool:
        """Read the next tag between invokes or parameters (an invoke left open closes at the next
        invoke or at the block's end), or close a block the model ended at this boundary."""
        self._take(_leading_space(self._buf))
        waiting = False
        for tag in tags:
            size = tag.match(self._buf)
            if size:
                if self._in is _In.PARAMS and tag in (dsml_tags.INVOKE_OPEN, dsml_tags.BLOCK_CLOSE):
                    self._repaired(f"invoke {self._name!r} was not closed")
                    self._end_invoke()
                self._take_tag(tag, size)
                self._after_tag(tag)
                return True
            waiting = waiting or size == 0
        ended = self._buf.startswith(specials.EOS) or (final and not self._buf and self._ended)
        if ended and (self._calls or self._in is _In.PARAMS):
            self._repaired("the tool-call block was not closed")
            if self._in is _In.PARAMS:
                self._end_invoke()
            self._accept()
            return True
        if not final and (waiting or _could_become(self._buf, (specials.EOS,))):
            return False
        self._reject(why if self._buf else "the tool-call block was not closed")
        return True

    def _after_tag(self, tag: Tag) -> None:
        if tag is dsml_tags.INVOKE_OPEN:
            self._in = _In.INVOKE_NAME
        elif tag is dsml_tags.PARAM_OPEN:
            self._in = _In.PARAM_HEADER
        elif tag is dsml_tags.INVOKE_CLOSE:
            self._end_invoke()
        else:
            self._accept()

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
            close = dsml_tags.PARAM_CLOSE.find(self._buf, self._scan)
            eos = self._buf.find(specials.EOS, self._scan)
            if 0 <= eos and (close is None or eos < close.at):
                self._value_text(eos)
                self._reject("a parameter value was not closed")  # the model ended inside it
                return True
            if close is None or close.partial:
                if final:
                    self._reject("a parameter value was not closed")
                    return True
                closers = (PARAM_CLOSE_ESCAPED, specials.EOS) if self._escaped else (specials.EOS,)
                held = held_suffix(self._buf, closers)
                self._value_text(min(len(self._buf) - held, len(self._buf) if close is None else close.at))
                return False
            after = close.at + close.size
            tail = self._buf[after:].lstrip()
            sizes = [tag.match(tail) for tag in _AFTER_VALUE]
            model_ended = tail.startswith(specials.EOS) or (final and not tail and self._ended)
            if any(sizes) or model_ended:
                self._value_text(close.at)
                self._take_tag(dsml_tags.PARAM_CLOSE, close.size)
                self._end_param()
                return True
            if not final and (0 in sizes or _could_become(tail, (specials.EOS,))):
                self._value_text(close.at)  # the value surely runs up to here; whether it ends here waits
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


_BETWEEN_INVOKES = (dsml_tags.INVOKE_OPEN, dsml_tags.BLOCK_CLOSE)
_BETWEEN_PARAMS = (dsml_tags.PARAM_OPEN, dsml_tags.INVOKE_CLOSE, dsml_tags.INVOKE_OPEN, dsml_tags.BLOCK_CLOSE)
# What may follow a parameter's closing tag for it to end the value (anything else is value text).
_AFTER_VALUE = _BETWEEN_PARAMS


def parse_completion(text: str, *, thinking: bool, escaped: bool = False, ended: bool = False) -> ParsedCompletion:
    """Parse a whole generated text at once (same result as streaming it)."""
    parser = DsmlParser(thinking=thinking, escaped=escaped)
    parser.feed(text)
    parser.finish(ended=ended)
    return parser.completion
