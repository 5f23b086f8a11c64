"""Exact DSML replay: an assistant tool call from history renders as the bytes the model sampled.

Clients send tool calls back as JSON, and the renderer writes JSON back as canonical DSML. The
model's own block often differs (spacing, key order, number spelling), so the re-rendered prompt
would leave the live KV at that turn and force a prefill of everything after it. The tool memory
maps each call id to the block sampled for it; when every id of an assistant message maps to the
same block, that block replaces the canonical one in the rendered prompt (DS4_SURFACE §2.9).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dwarfstar.prompt.conversation import to_turn
from dwarfstar.prompt.dsml import render_tool_calls
from dwarfstar.prompt.options import RenderOptions
from dwarfstar.prompt.render import Prompt
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import Control, PromptPart

MAX_MEMORY_BYTES = 512 * 1024 * 1024  # ds4's cap next to the id count


def _nbytes(dsml: str) -> int:
    return len(dsml.encode("utf-8", "surrogatepass"))  # the cap is in bytes, as ds4 counts it


class ToolMemory:
    """Bounded map from tool-call id to sampled DSML block, oldest dropped first; thread-safe."""

    def __init__(self, max_ids: int, max_bytes: int = MAX_MEMORY_BYTES) -> None:
        self.max_ids, self.max_bytes = max_ids, max_bytes
        self._blocks: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def remember(self, ids: Iterable[str], dsml: str) -> None:
        with self._lock:
            for call_id in ids:
                if call_id in self._blocks:
                    self._bytes -= _nbytes(self._blocks.pop(call_id))
                self._blocks[call_id] = dsml
                self._bytes += _nbytes(dsml)
            while self._blocks and (len(self._blocks) > self.max_ids or self._bytes > self.max_bytes):
                self._bytes -= _nbytes(self._blocks.popitem(last=False)[1])

    def get(self, call_id: str) -> str | None:
        with self._lock:
            dsml = self._blocks.get(call_id)
            if dsml is not None:
                self._blocks.move_to_end(call_id)
            return dsml


def history_tool_ids(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Ids of the tool calls in the assistant messages of a conversation."""
    return [
        call["id"]
        for message in messages
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list)
        for call in message["tool_calls"]
        if isinstance(call, Mapping) and isinstance(call.get("id"), str)
    ]


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
