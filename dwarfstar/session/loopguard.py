"""The loop guard (`--loop-guard`, off by default): repetition at the end of an output, and an agent's
repeated tool call.

Repetition. DeepSeek V4 at low temperature can fall into a loop that repeats a span of tokens until
the output budget runs out (ds4 #195, #335, #1045). The guard ends the output once its tail is one
token n-gram, of at most MAX_PERIOD tokens, repeated at least MIN_REPEATS times in a row over at
least MIN_SPAN tokens: the finish reason is `repetition`. The span floor keeps short legitimate runs
(a markdown rule, "ha ha ha", a table's separator row) untouched; a loop of the model's reasoning
is hundreds of tokens long. `Repetition.push` is O(MAX_PERIOD) per token: for every period p it keeps
how many tokens in a row equal the token p before them, so the tail is periodic with period p over
`run[p] + p` tokens.

Tool loops. An agent that emits the same tool call, with identical arguments, in K consecutive
assistant turns is not making progress. With `tools="note"` the next prompt gets TOOL_LOOP_NOTE, a
short note in the form ds4 gives a model that wrote a broken call ("Tool error: ..."), naming the
repeated call; with `tools="stop"` the turn is not generated and ends with `repetition`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dwarfstar.errors import DwarfStarError

MAX_PERIOD = 256  # longest repeated unit looked for, in tokens
MIN_REPEATS = 4  # the unit at least this many times in a row
MIN_SPAN = 96  # covering at least this many tokens
TOOL_ACTIONS = ("note", "stop")
# in the form of ds4's note for an invalid tool call ("Tool error: invalid DSML tool call: <why>\n",
# ds4_agent.c), the reason naming the repeated call
TOOL_LOOP_NOTE = (
    "Tool error: repeated tool call: {name} was called with the same arguments {turns} times in a row. "
    "Change the arguments, use another tool, or answer.\n"
)


@dataclass(frozen=True)
class LoopGuard:
    """The guard's settings: the repetition thresholds, and the tool-loop turns and action."""

    max_period: int = MAX_PERIOD
    min_repeats: int = MIN_REPEATS
    min_span: int = MIN_SPAN
    tool_turns: int = 3  # K: the same call in this many consecutive assistant turns is a loop
    tools: str = "note"  # note | stop

    def __post_init__(self) -> None:
        if self.tools not in TOOL_ACTIONS:
            raise DwarfStarError(
                f"the loop guard's tool action is one of {', '.join(TOOL_ACTIONS)}, got {self.tools!r}"
            )
        if self.max_period < 1 or self.min_repeats < 2 or self.tool_turns < 2:
            raise DwarfStarError("the loop guard needs a period >= 1, repeats >= 2 and tool turns >= 2")


class Repetition:
    """Watches one output's tokens; `push` says when its tail has become a loop."""

    def __init__(self, guard: LoopGuard) -> None:
        self.guard = guard
        self.tokens: list[int] = []
        self._run = [0] * (guard.max_period + 1)  # per period p: tokens in a row equal to the one p back
        self.detail: str | None = None  # what was found, for the trace

    def push(self, token: int) -> bool:
        tokens, run, guard = self.tokens, self._run, self.guard
        tokens.append(token)
        n = len(tokens)
        for p in range(1, min(guard.max_period, n - 1) + 1):
            run[p] = run[p] + 1 if tokens[-1 - p] == token else 0
            span = run[p] + p
            if span >= guard.min_span and span >= guard.min_repeats * p:
                self.detail = f"a {p}-token unit repeated {span / p:.1f} times over the last {span} tokens"
                return True
        return False


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A tool call as compared: its name and its arguments in canonical JSON (a JSON string parsed first)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return name, json.dumps(arguments, sort_keys=True, ensure_ascii=False)


class ToolStreak:
    """How many assistant turns in a row made the same tool calls (the same set, each with the same
    arguments); a turn without calls ends a streak."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.turns = 0

    def push(self, calls: Sequence[tuple[str, str]]) -> int:
        key = sorted(calls)
        self.turns = self.turns + 1 if key and key == self.calls else int(bool(key))
        self.calls = key
        return self.turns

    @property
    def name(self) -> str:
        return self.calls[0][0] if self.calls else ""


def tool_loop(messages: Sequence[Any], turns: int) -> str | None:
    """The name of the call the last `turns` assistant turns of an API conversation (OpenAI-shaped
    `tool_calls`) all made; None when they did not."""
    streak = ToolStreak()
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "assistant":
            made = [c.get("function") for c in message.get("tool_calls") or () if isinstance(c, dict)]
            streak.push([call_key(str(f.get("name")), f.get("arguments")) for f in made if isinstance(f, dict)])
    return streak.name if streak.turns >= turns else None


def tool_loop_note(name: str, turns: int) -> str:
    return TOOL_LOOP_NOTE.format(name=name, turns=turns)
