"""Generated tokens to client events: UTF-8-safe text, stop strings, then reasoning/content/tool calls.

Stop strings are matched on the raw generated text (as ds4 does), before the DSML parser, so a stop
string cuts wherever it appears. Text that might be the start of a stop string is held back until
the next token decides; the parser holds back partial tags the same way. Tool calls get their ids
here, when their name is known, so streamed and final ids agree.

Control tokens never reach a client as text. A templated request refuses every control token but the
ones an answer is made of (`refused_ids`: all but `<｜end▁of▁sentence｜>`, which ends the turn,
`</think>`, which ends the reasoning, and `｜DSML｜`, which tool-call tags are made of), and its
sampler never draws those (`sampling.redraw_refused`): a role token such as `<｜User｜>`
inside an answer becomes the model's next choice. Should one still come (MTP speculation accepts
tokens without that sampler), it is dropped here and noted in the trace, as is a `</think>` once the
reasoning has ended. A raw completion (`"raw": true`, the client's own template) keeps every token.

A tool-call block's events (each call's start, its arguments, its end) are held until the parser
accepts the block, and dropped if it gives the block up (an invalid tool call): a client, streamed or
not, sees only calls it can run, and a request ends the same way either way (issue 37). A stream
shows a block's calls when the block closes, as ds4 does when its live projection never started.

A block given up is not dropped in silence (issue 36): its text, as the model wrote it, follows the
content as more content (`Finished.content`), streamed from the moment the parser gives up, and each
API flags the answer in its own shape (`Finished.invalid_tool_call`: why), so a reply never looks like
an empty success. The client sends that text back as the assistant's content; its bytes are the ones
sampled, so the next prompt keeps the live KV through the whole turn, `｜DSML｜` control tokens
included (the rendered-bytes match, session/prefix.py), though the renderer spells them as plain text.
"""

from __future__ import annotations

from collections.abc import Sequence

from dwarfstar.prompt.dsml_parser import (
    ContentDelta,
    DsmlParser,
    ParsedCompletion,
    ParseProblem,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    held_suffix,
)
from dwarfstar.serving.generation import Event, GenerationRequest, ToolCallOpened, new_id
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer
from dwarfstar.tokenizer.tokenizer import Tokenizer


def refused_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The control tokens a templated answer never holds: all but EOS, `</think>` and `｜DSML｜`."""
    kept = {tokenizer.token_id(text) for text in (specials.EOS, specials.THINK_END, specials.DSML)}
    return tokenizer.added_ids - kept


class StopScanner:
    """Passes text through until the first stop string, holding back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        buf = self._held + text
        found = [(at, stop) for stop in self.stops if (at := buf.find(stop)) >= 0]
        if found:
            at, self.matched = min(found)
            self._held = ""
            return buf[:at]
        keep = held_suffix(buf, self.stops) if self.stops else 0
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class OutputDecoder:
    def __init__(self, tokenizer: Tokenizer, request: GenerationRequest) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopScanner(request.stop)
        self._parser = DsmlParser(thinking=request.thinking, escaped=request.escaped_dsml) if request.parse else None
        self._id_prefix = request.tool_id_prefix
        self._think_end = tokenizer.token_id(specials.THINK_END)
        self._refused, self._piece = request.sampling.refused, tokenizer.piece
        self._reasoning = request.thinking
        self._text: list[str] = []
        self.tool_ids: list[str] = []
        self.problems: list[str] = []
        self.reasoning_tokens = 0
        self._calls: list[Event] = []  # the open block's call events, until the parser accepts it
        self._invalid_shown = 0  # how much of a given-up block's text has been sent as content

    @property
    def stop_sequence(self) -> str | None:
        """The stop string generated, which ends the turn; None while there is none."""
        return self._stops.matched

    @property
    def tool_block_closed(self) -> bool:
        return self._parser is not None and self._parser.completion.raw_dsml is not None

    @property
    def in_tool_call(self) -> bool:
        """Inside a DSML block whose calls have started: its bytes are not settled yet."""
        return bool(self.tool_ids) and not self.tool_block_closed

    @property
    def completion(self) -> ParsedCompletion | None:
        return None if self._parser is None else self._parser.completion

    @property
    def text(self) -> str:
        return "".join(self._text)

    def push(self, token: int) -> list[Event]:
        stray_close = token == self._think_end and not self._reasoning and self._parser is not None
        if token in self._refused or stray_close:
            self.problems.append(f"control token {self._piece(token)} ({token}) dropped from the answer")
            return []
        if self._reasoning:
            self.reasoning_tokens += 1
            self._reasoning = token != self._think_end
        return self._feed(self._stops.feed(self._detok.push(token)))

    def finish(self, *, ended: bool = False) -> list[Event]:
        """`ended`: the model generated its end-of-sentence token (a DSML block it left open may be closed)."""
        events = self._feed(self._stops.feed(self._detok.flush()))
        events += self._feed(self._stops.flush())
        if self._parser is not None:
            events += self._convert(self._parser.finish(ended=ended and self.stop_sequence is None))
        return events

    def _feed(self, text: str) -> list[Event]:
        if not text:
            return []
        self._text.append(text)
        if self._parser is None:
            return [ContentDelta(text)]
        return self._convert(self._parser.feed(text))

    def _convert(self, events: list) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                call_id = new_id(self._id_prefix, 32)
                self.tool_ids.append(call_id)
                self._calls.append(ToolCallOpened(event.index, call_id, event.name))
            elif isinstance(event, ToolArgumentsDelta | ToolCallEnd):
                self._calls.append(event)
            elif isinstance(event, ParseProblem):
                self.problems.append(event.message)
            else:
                out += self._settled_calls()
                out.append(event)
        return out + self._settled_calls() + self._invalid_text()

    def _invalid_text(self) -> list[Event]:
        """The text of a block the parser gave up, as content, from where the last call left off."""
        invalid = self.completion.invalid_dsml if self.completion is not None else None
        if invalid is None or len(invalid) == self._invalid_shown:
            return []
        text, self._invalid_shown = invalid[self._invalid_shown :], len(invalid)
        return [ContentDelta(text)]

    def _settled_calls(self) -> list[Event]:
        """The held call events once their block is settled: all of them if the parser accepted it,
        none if it gave the block up (its calls were never calls)."""
        completion = self.completion
        if completion is None or (completion.raw_dsml is None and completion.invalid_dsml is None):
            return []
        calls, self._calls = self._calls, []
        return calls if completion.invalid_dsml is None else []
