"""The contract between the API dialects and the scheduler: one generation request and its events.

A dialect turns its request into a `GenerationRequest`; the scheduler answers with `Started`, then
text and tool-call events as tokens arrive, then exactly one `Finished` or `Failed`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from dwarfstar.engine.images import PlacedImage
from dwarfstar.prompt.dsml_guard import ToolGrammar
from dwarfstar.prompt.dsml_parser import (
    INVALID_TOOL_CALL,
    ContentDelta,
    ParsedCompletion,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallEnd,
)
from dwarfstar.prompt.render import Prompt
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.loopguard import LoopGuard
from dwarfstar.steering.direction import SteeringScale


@dataclass
class GenerationRequest:
    prompt: Prompt | None  # None for raw token prompts: prefix reuse then matches tokens only
    prompt_ids: list[int]
    max_tokens: int  # already clamped to the free context
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    parse: bool = True  # split reasoning, content and DSML tool calls; False: raw text (completions)
    thinking: bool = False  # the prompt opened `<think>`: the output starts with reasoning
    tools: bool = False  # tools were offered: a closed DSML block ends the turn
    escaped_dsml: bool = False
    tool_id_prefix: str = "call_"
    api: str = ""  # for the trace and metrics
    trace_body: Any = None  # the client's request, written to the trace
    steering: SteeringScale | None = None  # None: computed without steering (part of the KV cache key)
    loop_guard: LoopGuard | None = None  # None: off (session/loopguard.py)
    tool_loop: str | None = None  # the repeated tool call the guard found in the history, for the trace
    halted: bool = False  # the guard stops the turn before it is generated (a tool loop, `stop`)
    tool_grammar: ToolGrammar | None = None  # the tool-call guard's (prompt/dsml_guard.py); None: off
    images: tuple[PlacedImage, ...] = ()  # the prompt's images, placed among `prompt_ids` (engine/images.py)


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from a live session or the disk cache
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    draft_tokens: int = 0  # MTP drafts verified (serve --mtp)
    accepted_draft_tokens: int = 0  # of those, accepted

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Started:
    usage: Usage


@dataclass(frozen=True)
class ToolCallOpened:
    """A tool call's name is known (its arguments follow as `ToolArgumentsDelta`)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and its best alternatives (text, bytes, logprob), sent before the
    token's text (serving/logprobs.py)."""

    token: str
    bytes: list[int]
    logprob: float
    top: tuple[tuple[str, list[int], float], ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | tool_calls | repetition (the loop guard)
    usage: Usage
    completion: ParsedCompletion | None  # None when the request asked for raw text
    text: str  # the generated text, raw (stop string cut off)
    tool_ids: list[str] = field(default_factory=list)
    stop_sequence: str | None = None  # the client's stop string that ended the text
    logprobs: list[TokenLogprob] | None = None  # each generated token's, when the request asked

    @property
    def content(self) -> str:
        """The answer's text: the content, then a tool-call block the parser gave up, as the model wrote
        it (an invalid tool call is shown, never dropped: output.py)."""
        return self.completion.content + (self.completion.invalid_dsml or "")

    @property
    def invalid_tool_call(self) -> str | None:
        """Why the parser gave up the answer's tool-call block; None when it gave none up."""
        if self.completion is None or self.completion.invalid_dsml is None:
            return None
        why = [p.removeprefix(INVALID_TOOL_CALL) for p in self.completion.problems if p.startswith(INVALID_TOOL_CALL)]
        return why[-1] if why else "the tool-call block could not be read"


@dataclass(frozen=True)
class Failed:
    message: str
    usage: Usage


Event = (
    Started
    | TokenLogprob
    | ReasoningDelta
    | ContentDelta
    | ToolCallOpened
    | ToolArgumentsDelta
    | ToolCallEnd
    | Finished
    | Failed
)


def new_id(prefix: str, hex_chars: int = 24) -> str:
    """A response or item id in the style of its API (`chatcmpl-…`, `resp_…`, `msg_…`)."""
    return prefix + secrets.token_hex(hex_chars // 2)
