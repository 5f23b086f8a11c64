"""Render a conversation into the DeepSeek V4 prompt, following the official `encoding_dsv4` rules.

The rules, in the order they are applied:
1. Request-level `tools` and `response_format` belong to the leading system message; an empty one is
   put in front when the conversation does not start with a system message.
2. Tool messages become `<tool_result>` parts of a user turn. Consecutive user and tool messages
   share one turn, their parts joined by blank lines. Tool results are reordered to follow the
   tool calls of the assistant message before them.
3. In thinking mode, reasoning of assistant turns before the last user turn is dropped (and
   developer messages before it vanish), unless tools are defined or `drop_thinking` is off.
4. Each turn renders by role (system text; developer and user behind `<｜User｜>`; latest_reminder
   behind `<｜latest_reminder｜>`; assistant as `[reasoning</think>]content[DSML]<EOS>`), and a user
   or developer turn that ends the prompt or precedes an assistant/latest_reminder turn is followed
   by `<｜Assistant｜>` and `<think>` (thinking, reasoning kept) or `</think>`. A system turn inside a
   user turn's run (Claude Code puts its environment notes after the first user message) renders
   its text in place, as the official encoder does, and the opener moves after it: the official
   encoder gives no opener at all when such a system message ends the prompt, which leaves nothing
   to generate from, and keeping the opener after it makes every later turn render the same bytes.
5. In thinking mode the reasoning effort's preamble, if its release has one (efforts.py), opens the prompt.
6. V4.1 (a release with think levels): every system message opens with the `<｜System｜>` token, and in
   thinking mode the first message is one, holding the think level's prefix before its text (an empty
   one is put in front when the conversation does not start with a system message).

`RenderOptions` switches individual rules to ds4's server behaviour (see render_options.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dwarfstar.prompt import templates
from dwarfstar.prompt.conversation import PromptError, ToolResult, Turn, to_turns, tool_schema
from dwarfstar.prompt.dsml import render_tool_calls, to_json
from dwarfstar.prompt.efforts import Effort, check_effort, has_think_levels, preamble
from dwarfstar.prompt.render_options import OFFICIAL, RenderOptions
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.specials import TASK_TOKENS, Control, PromptPart

TOOL_RESULT_CLOSE = "</tool_result>"


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt: plain text runs and the control tokens the renderer placed between them."""

    parts: tuple[PromptPart, ...]

    @property
    def text(self) -> str:
        return "".join(str(part) for part in self.parts)


class _Builder:
    def __init__(self) -> None:
        self.parts: list[PromptPart] = []

    def add(self, *parts: PromptPart) -> None:
        for part in parts:
            if isinstance(part, Control):
                self.parts.append(part)
            elif part:
                if self.parts and isinstance(self.parts[-1], str):
                    self.parts[-1] += part
                else:
                    self.parts.append(part)


def _attach_request_extras(turns: list[Turn], tools: Sequence[Any] | None, response_format: Any) -> None:
    if not tools and not response_format:
        return
    if not turns or turns[0].role != "system":
        turns.insert(0, Turn("system"))
    if tools:
        for n, tool in enumerate(tools):
            tool_schema(tool, f"tools[{n}]")
        turns[0].tools = list(tools)
    if response_format:
        if not isinstance(response_format, Mapping):
            raise PromptError("response_format must be an object")
        turns[0].response_format = response_format


def _joins_previous(previous: Turn, turn: Turn, options: RenderOptions) -> bool:
    is_tool_result = isinstance(turn.pieces[0], ToolResult)
    if options.merge_user_turns:
        # Officially a tool result joins any user turn; user text joins one that carries no task.
        return is_tool_result or previous.task is None
    # ds4 chains tool results only.
    return is_tool_result and all(isinstance(piece, ToolResult) for piece in previous.pieces)


def _merge_user_turns(turns: list[Turn], options: RenderOptions) -> list[Turn]:
    merged: list[Turn] = []
    for turn in turns:
        previous = merged[-1] if merged and merged[-1].role == "user" else None
        if turn.role == "user" and previous is not None and _joins_previous(previous, turn, options):
            previous.pieces.extend(turn.pieces)
        else:
            merged.append(turn)
    return merged


def _sort_tool_results(turns: list[Turn]) -> None:
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {call_id: i for i, call_id in enumerate(turn.tool_call_ids) if call_id}
        elif turn.role == "user" and call_order:
            results = [p for p in turn.pieces if isinstance(p, ToolResult)]
            if len(results) > 1:
                # Stable sort; results whose id matches no call sort as if they answered the first one.
                ordered = iter(sorted(results, key=lambda r: call_order.get(r.call_id, 0)))
                turn.pieces = [next(ordered) if isinstance(p, ToolResult) else p for p in turn.pieces]


def _last_user_index(turns: list[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _drop_old_reasoning(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: assistants lose their reasoning, developer messages disappear."""
    last_user = _last_user_index(turns)
    kept = []
    for i, turn in enumerate(turns):
        if turn.role == "developer" and i < last_user:
            continue
        if turn.role == "assistant" and i < last_user:
            turn.reasoning = None
        kept.append(turn)
    return kept


def _tools_section(tools: Sequence[Any], options: RenderOptions) -> list[PromptPart]:
    lines = [to_json(tool_schema(t, "tools"), compact=options.compact_json) for t in tools]
    return templates.tools_section(lines, options.tools_prompt)


def _response_format_section(response_format: Any, options: RenderOptions) -> list[PromptPart]:
    return [templates.RESPONSE_FORMAT_INTRO + to_json(response_format, compact=options.compact_json)]


def _ds4_system_block(turns: list[Turn], options: RenderOptions) -> tuple[list[PromptPart], list[Turn]]:
    """ds4: the tools section first, then every non-empty system/developer text, joined by blank lines."""
    hoisted = [t for t in turns if t.role in ("system", "developer") and not t.in_place]
    tools = [tool for t in hoisted for tool in t.tools]
    sections = [_tools_section(tools, options)] if tools else []
    sections += [[t.text] for t in hoisted if t.text]
    response_format = next((t.response_format for t in hoisted if t.response_format), None)
    if response_format:
        sections.append(_response_format_section(response_format, options))
    block: list[PromptPart] = []
    for n, section in enumerate(sections):
        block += ["\n\n", *section] if n else section
    return block, [t for t in turns if t.role not in ("system", "developer") or t.in_place]


def _user_pieces(turn: Turn, options: RenderOptions) -> list[PromptPart]:
    parts: list[PromptPart] = []
    for n, piece in enumerate(turn.pieces):
        if n:
            both_results = isinstance(piece, ToolResult) and isinstance(turn.pieces[n - 1], ToolResult)
            parts.append(options.tool_result_separator if both_results else "\n\n")
        if isinstance(piece, ToolResult):
            content = piece.content
            if options.escape_tool_results:
                content = content.replace(TOOL_RESULT_CLOSE, "&lt;/tool_result>")
            parts.append(f"<tool_result>{content}{TOOL_RESULT_CLOSE}")
        else:
            parts.append(piece)
    return parts


def render_conversation(
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    response_format: Any = None,
    thinking: bool = False,
    reasoning_effort: Effort = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    options: RenderOptions = OFFICIAL,
) -> Prompt:
    """The prompt for `messages` (OpenAI-style dicts, see conversation.py) ready to tokenize.
    `reasoning_effort`: a level of the release `options.efforts` (efforts.py; V4.1 also 1..100)."""
    check_effort(options.efforts, reasoning_effort)
    turns = to_turns(messages)
    _attach_request_extras(turns, tools, response_format)
    turns = _merge_user_turns(turns, options)
    if options.sort_tool_results:
        _sort_tool_results(turns)

    keep_reasoning = not drop_thinking or any(t.tools for t in turns)
    if options.keep_reasoning_with_tool_history:
        keep_reasoning = keep_reasoning or any(
            t.tool_calls or any(isinstance(p, ToolResult) for p in t.pieces) for t in turns
        )
    if thinking and not keep_reasoning:
        turns = _drop_old_reasoning(turns)

    lead = preamble(options.efforts, reasoning_effort) if thinking and turns else ""
    system_token = has_think_levels(options.efforts)
    if system_token and lead and turns[0].role != "system":
        turns.insert(0, Turn("system"))  # V4.1: the think level's prefix is a system message's start
    out = _Builder()
    if add_bos:
        out.add(Control(specials.BOS))
    if not system_token:
        out.add(lead)
        lead = ""
    if options.ds4_system_block:
        block, turns = _ds4_system_block(turns, options)
        if system_token and (lead or block):
            out.add(Control(specials.SYSTEM), lead)
        out.add(*block)
        lead = ""

    last_user = _last_user_index(turns)
    for i, turn in enumerate(turns):
        first = lead if i == 0 else ""
        _render_turn(out, turns, i, thinking=thinking, keep_reasoning=keep_reasoning, options=options, lead=first)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following not in (None, "assistant", "latest_reminder"):
            continue
        if turn.task is not None:
            task = Control(TASK_TOKENS[turn.task])
            if turn.task == "action":
                out.add(Control(specials.ASSISTANT), Control(specials.THINK_START if thinking else specials.THINK_END))
            out.add(task)
        elif turn.role in ("user", "developer") or _closes_user_run(turns, i):
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            out.add(
                Control(specials.ASSISTANT), Control(specials.THINK_START if opens_thinking else specials.THINK_END)
            )
    return Prompt(tuple(out.parts))


def _closes_user_run(turns: list[Turn], i: int) -> bool:
    """A system turn whose nearest earlier non-system turn is a user or developer turn."""
    if turns[i].role != "system":
        return False
    earlier = next((t.role for t in reversed(turns[:i]) if t.role != "system"), None)
    return earlier in ("user", "developer")


def _render_turn(
    out: _Builder,
    turns: list[Turn],
    i: int,
    *,
    thinking: bool,
    keep_reasoning: bool,
    options: RenderOptions,
    lead: str,
) -> None:
    """Turn `i`; `lead`: V4.1's think-level prefix, which starts the first system message."""
    turn = turns[i]
    if turn.role in ("system", "developer"):
        if turn.role == "developer":
            out.add(Control(specials.USER))
        elif has_think_levels(options.efforts):
            out.add(Control(specials.SYSTEM), lead)
        out.add(turn.text)
        if turn.tools:
            out.add("\n\n", *_tools_section(turn.tools, options))
        if turn.response_format:
            out.add("\n\n", *_response_format_section(turn.response_format, options))
    elif turn.role == "user":
        out.add(Control(specials.USER), *_user_pieces(turn, options))
    elif turn.role == "latest_reminder":
        out.add(Control(specials.LATEST_REMINDER), turn.text)
    else:
        answers_task = i > 0 and turns[i - 1].task is not None
        if thinking and not answers_task and (keep_reasoning or i > _last_user_index(turns)):
            out.add(turn.reasoning or "", Control(specials.THINK_END))
        out.add(turn.text)
        if turn.tool_calls:
            out.add(*render_tool_calls(turn.tool_calls, compact_json=options.compact_json, escape=options.escape_dsml))
        if not turn.wo_eos:
            out.add(Control(specials.EOS))
