"""Exact DSML replay: an assistant tool call from history renders as the bytes the model sampled.

Clients send tool calls back as JSON, and the renderer writes JSON back as canonical DSML. The
model's own block often differs (spacing, key order, number spelling), so the re-rendered prompt
would leave the live KV at that turn and force a prefill of everything after it. The tool memory
maps each call id to the block sampled for it; when every id of an assistant message maps to the
same block, that block replaces the canonical one in the rendered prompt (DS4_SURFACE §2.9).

Reasoning replay: an assistant tool-call turn is rendered with its reasoning (thinking mode keeps it
when tools are in play), and the live KV holds the reasoning the model sampled. Clients drop it
(Codex without `include`, Anthropic clients that strip thinking blocks, chat clients that never
send `reasoning_content` back) or resend it trimmed. The tool memory also keeps each call's
sampled reasoning, and a turn whose reasoning is missing, empty or equal to it up to surrounding
whitespace renders with the sampled bytes, so the prompt stays a prefix of the live KV. Reasoning
the client sent otherwise is its own, rendered as sent; a turn the memory no longer knows (evicted,
or after a restart: the disk files keep the DSML, not the reasoning) renders as sent, which the
template allows, and the cache serves the prefix up to it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dwarfstar.prompt.conversation import to_turn
from dwarfstar.prompt.dsml import render_tool_calls
from dwarfstar.prompt.render import Prompt
from dwarfstar.prompt.render_options import RenderOptions
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import Control, PromptPart

MAX_MEMORY_BYTES = 512 * 1024 * 1024  # ds4's cap next to the id count


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # the cap is in bytes, as ds4 counts it


@dataclass(frozen=True, slots=True)
class _Sampled:
    dsml: str
    reasoning: str | None  # None: not known (thinking off, or the block came from a disk file)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dsml) + _nbytes(self.reasoning or "")


class ToolMemory:
    """Bounded map from tool-call id to the DSML block and reasoning sampled for it, least recently
    used dropped first; thread-safe."""

    def __init__(self, max_ids: int, max_bytes: int = MAX_MEMORY_BYTES) -> None:
        self.max_ids, self.max_bytes = max_ids, max_bytes
        self._calls: OrderedDict[str, _Sampled] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._calls)

    def remember(self, ids: Iterable[str], dsml: str, reasoning: str | None = None) -> None:
        """`reasoning` None keeps what is known for the same block (a disk file brings the DSML alone)."""
        with self._lock:
            for call_id in ids:
                known = self._calls.pop(call_id, None)
                if known is not None:
                    self._bytes -= known.nbytes
                    if reasoning is None and known.dsml == dsml:
                        reasoning = known.reasoning
                sampled = _Sampled(dsml, reasoning)
                self._calls[call_id] = sampled
                self._bytes += sampled.nbytes
            while self._calls and (len(self._calls) > self.max_ids or self._bytes > self.max_bytes):
                self._bytes -= self._calls.popitem(last=False)[1].nbytes

    def _recall(self, call_id: str) -> _Sampled | None:
        with self._lock:
            sampled = self._calls.get(call_id)
            if sampled is not None:
                self._calls.move_to_end(call_id)
            return sampled

    def get(self, call_id: str) -> str | None:
        """The DSML block sampled for the call."""
        sampled = self._recall(call_id)
        return None if sampled is None else sampled.dsml

    def reasoning(self, call_id: str) -> str | None:
        """The reasoning sampled before the call, when known."""
        sampled = self._recall(call_id)
        return None if sampled is None else sampled.reasoning


def history_tool_ids(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Ids of the tool calls in the assistant messages of a conversation."""
    return [
        call["id"]
        for message in messages
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list)
        for call in message["tool_calls"]
        if isinstance(call, Mapping) and isinstance(call.get("id"), str)
    ]


def _call_ids(message: Any) -> list[str]:
    """The tool-call ids of an assistant message (none for anything else; bad shapes are the renderer's to report)."""
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return []
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [call["id"] for call in calls if isinstance(call, Mapping) and isinstance(call.get("id"), str)]


def replay_reasoning(messages: Sequence[Mapping[str, Any]], memory: ToolMemory) -> list[Mapping[str, Any]]:
    """The messages with each assistant tool-call turn's dropped or trimmed reasoning put back as
    sampled (see the module docstring)."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        ids = _call_ids(message)
        known = {memory.reasoning(call_id) for call_id in ids}
        if len(known) == 1 and None not in known:  # every call of the turn came from one sampled turn
            sampled, sent = known.pop(), message.get("reasoning_content")
            if (
                (sent is None or isinstance(sent, str))
                and sent != sampled
                and (sent or "").strip() in ("", sampled.strip())
            ):
                message = {**message, "reasoning_content": sampled}
        out.append(message)
    return out


def _normalized(parts: Iterable[PromptPart]) -> list[PromptPart]:
    """Adjacent text runs merged and empty ones dropped, so equal prompts have equal part lists."""
    out: list[PromptPart] = []
    for part in parts:
        if isinstance(part, Control):
            out.append(part)
        elif part:
            if out and isinstance(out[-1], str):
                out[-1] += part
            else:
                out.append(part)
    return out


def dsml_parts(dsml: str) -> list[PromptPart]:
    """Sampled DSML text as prompt parts: every `｜DSML｜` is the control token the model emitted."""
    pieces = dsml.split(specials.DSML)
    parts: list[PromptPart] = [pieces[0]]
    for piece in pieces[1:]:
        parts += [Control(specials.DSML), piece]
    return parts


def _replace(parts: list[PromptPart], old: list[PromptPart], new: list[PromptPart], start: int) -> int | None:
    """Replace the first `old` at or after `start` in place; returns where to search next, None if absent.

    `old` starts and ends with text, which may be the tail and the head of longer text runs in `parts`.
    """
    head, middle, tail = old[0], old[1:-1], old[-1]
    span = len(old)
    for i in range(start, len(parts) - span + 1):
        first, last = parts[i], parts[i + span - 1]
        if (
            isinstance(first, str)
            and first.endswith(head)
            and isinstance(last, str)
            and last.startswith(tail)
            and parts[i + 1 : i + span - 1] == middle
        ):
            replacement = [first[: len(first) - len(head)] + new[0], *new[1:-1], new[-1] + last[len(tail) :]]
            parts[i : i + span] = replacement
            return i + len(replacement) - 1
    return None


def apply_exact_replay(
    prompt: Prompt, messages: Sequence[Mapping[str, Any]], memory: ToolMemory, options: RenderOptions
) -> tuple[Prompt, list[str]]:
    """The prompt with known tool-call blocks replaced by their sampled bytes; also the ids replayed."""
    parts = _normalized(prompt.parts)
    replayed: list[str] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        turn = to_turn(message, index)
        blocks = {memory.get(call_id) for call_id in turn.tool_call_ids}
        if len(blocks) != 1 or None in blocks:
            continue
        canonical = _normalized(
            render_tool_calls(turn.tool_calls, compact_json=options.compact_json, escape=options.escape_dsml)
        )
        sampled = dsml_parts(blocks.pop())
        at = _replace(parts, canonical, sampled, cursor)
        if at is not None:
            cursor = at
            replayed += turn.tool_call_ids
    return Prompt(tuple(_normalized(parts))), replayed
