"""Synthetic coding-agent requests: a long system prompt, an environment, 10-20 tool declarations and the
request body a client would send, so the nano model learns to keep its manners after an agent's prompt.

The three shapes follow what real clients send (chat: opencode through Chat Completions; messages: Claude
Code through Anthropic Messages; responses: Codex through the Responses API), but every word is drawn at
random from our own phrase bank (agent_phrases.py, expanded by agent_text.py): no client's prompt text is
used. Only tool and parameter names, which are protocol facts, match the clients', and each shape always
declares its client's three core tools (chat_data.CLIENT_CORE), the ones the tool round trips call.

`agent_prompt` fits the rendered prompt (system text, tools section and the context before the user's
first words, rendered with ds4's template: `rendered_tokens`) into a token range: it draws the tools and
trims them to a share of a target inside the range, then adds sections of instructions until the estimate
reaches the target, then corrects with exact counts (a range narrower than a rule, some 40 tokens, can
fail with a ValueError). `conversation` gives the messages the server derives from the body `request_body`
builds, so training renders the ids the server will (tests/nano_tools/test_agent_prompts.py checks it
through the server's own conversion functions).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import DS4
from dwarfstar.tokenizer.specials import Control
from dwarfstar.train.agent_text import (
    LANGUAGES,
    MODELS,
    NOTES,
    TOOL_COUNT,
    WORDS,
    Section,
    Style,
    Tool,
    Writer,
    env_block,
    notes,
    sections,
    tagged,
    tools,
    workspace,
)
from dwarfstar.train.chat_data import CLIENT_CORE, CoreTool

SHAPES = ("chat", "messages", "responses")
FIT_PASSES = 40  # exact counts allowed while fitting the range


@dataclass(frozen=True)
class AgentPrompt:
    shape: str
    system: str  # the system text exactly as the server derives it from the body
    tools: list[dict[str, Any]]  # the declarations in the shape's form, as sent
    # what the client puts before the user's first words: messages, the text blocks of the first user
    # message, joined; responses, the text of the user item before the user's message; chat, ""
    context: str
    core: dict[str, CoreTool]  # "read", "list", "search" -> the tool to call
    # the body's fields that every request of the session repeats (system blocks or instructions, tools,
    # max tokens, stream...), the model and the conversation aside
    head: dict[str, Any] = field(default_factory=dict)
    # the context as sent: messages, text blocks; responses, message items (a developer item, the user one)
    preface: list[dict[str, Any]] = field(default_factory=list)


# -- assembly -------------------------------------------------------------------------------------------
@dataclass
class _Draft:
    """A prompt being fitted: the sections and tools change, the shape's other choices are drawn once."""

    shape: str
    style: Style
    identity: str
    env: str
    tools: list[Tool]
    core: dict[str, CoreTool]
    head: dict[str, Any]
    billing: str  # messages: an `x-anthropic-` system block the server drops ("" for none)
    split: float  # messages: where the preamble splits into two system blocks (0: one block)
    env_in_system: bool
    before: list[str]  # the context's text blocks (messages) or the user item's (responses)
    developer: str  # responses: a developer item's text ("" for none)
    sections: list[Section] = field(default_factory=list)

    def build(self) -> AgentPrompt:
        decls = [tool.declaration(self.shape, self.style.bullet) for tool in self.tools]
        texts = [section.text for section in self.sections]
        env = [self.env] if self.env_in_system else []
        head = {**self.head, "tools": decls}
        if self.shape == "chat":
            return AgentPrompt("chat", "\n\n".join([self.identity, *texts, *env]), decls, "", self.core, head)
        if self.shape == "responses":
            head = {"instructions": "\n\n".join([self.identity, *texts]), **head}
            preface = [_item("developer", [self.developer])] if self.developer else []
            preface.append(_item("user", self.before))
            return AgentPrompt("responses", head["instructions"], decls, "".join(self.before), self.core, head, preface)
        cut = round(self.split * len(texts))
        blocks = [t for t in (self.identity, "\n\n".join(texts[:cut]), "\n\n".join(texts[cut:] + env)) if t]
        system = [{"type": "text", "text": t} for t in ([self.billing] if self.billing else []) + blocks]
        for block in system[-2:]:
            block["cache_control"] = {"type": "ephemeral"}
        preface = [{"type": "text", "text": t} for t in self.before]
        head = {"system": system, **head}
        return AgentPrompt("messages", "\n".join(blocks), decls, "".join(self.before), self.core, head, preface)


def _item(role: str, texts: list[str]) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": t} for t in texts]}


def _draft(w: Writer, shape: str) -> _Draft:
    style = Style(
        w.pick(["#", "##"]), w.pick(["- ", "- ", "* "]), w.chance(0.15), w.chance(0.5), w.chance(0.5), w.chance(0.6)
    )
    ws = workspace(w)
    language, ext, commands = w.pick(LANGUAGES)
    w.facts.update(ext=ext, lang=language, cmd=w.pick(commands), shell=ws["shellname"], model=w.pick(MODELS))
    core = dict(CLIENT_CORE[shape])
    # each declared from the tool bank's entry for a shell, or for the request's own kind
    banked = [(role if t.value == "{}" else "shell", t.name, t.parameter) for role, t in core.items()]
    declared = tools(w, shape, style, banked)
    identity = " ".join(p for p in (w.line("{identity}"), w.say(w.pick(WORDS["help"]))) if p)
    draft = _Draft(shape, style, identity, "", declared, core, {}, "", 0.0, True, [], "")
    budget = int(w.pick([8192, 16384, 21333, 32000, 64000]))
    if shape == "chat":
        draft.env = env_block(w, ws, xml=False)
        draft.head = {"max_tokens": budget, "stream": True, "stream_options": {"include_usage": True}}
        draft.head |= {"tool_choice": "auto"} if w.chance(0.7) else {}
    elif shape == "messages":
        draft.env, draft.env_in_system = env_block(w, ws, xml=False), w.chance(0.6)
        if w.chance(0.5):
            draft.billing = f"x-anthropic-billing-header: client={w.say('{agent}').lower()}/{w.hexes(6)};"
        draft.split = float(w.rng.uniform(0.3, 0.8)) if w.chance(0.4) else 0.0
        todo = tagged(w, "remtag", w.say(w.pick(NOTES["todo"])))
        before = [tagged(w, "remtag", notes(w, ws, style))] if w.chance(0.7) else []
        before += [] if draft.env_in_system else [tagged(w, "remtag", draft.env)]
        draft.before = before + [todo] if not before or (len(before) < 2 and w.chance(0.6)) else before
        draft.head = {"max_tokens": budget, "stream": True, "metadata": {"user_id": f"user_{w.hexes(32)}"}}
    else:
        draft.env_in_system = False
        sandbox = " ".join(w.say(s) for s in w.some(NOTES["sandbox"], int(w.rng.integers(2, 5))))
        draft.developer = tagged(w, "permtag", sandbox) if w.chance(0.7) else ""
        draft.before = ([notes(w, ws, style) + "\n\n"] if w.chance(0.5) else []) + [env_block(w, ws, xml=True)]
        draft.head = {"tool_choice": "auto", "parallel_tool_calls": w.chance(0.5), "store": False, "stream": True}
        draft.head |= {"reasoning": {"effort": w.pick(["low", "medium", "high"]), "summary": "auto"}}
        draft.head |= {"max_output_tokens": budget, "prompt_cache_key": f"{w.hexes(8)}-{w.hexes(4)}-{w.hexes(12)}"}
    return draft


def rendered_tokens(prompt: AgentPrompt, count: Callable[[str], int]) -> int:
    """Tokens of the prompt before a first user message "hi", rendered with ds4's template: `count` for
    each run of text, one for each control token (Tokenizer.encode_prompt's runs)."""
    hi = conversation(prompt, [{"role": "user", "content": "hi"}])
    total, run = 0, ""
    for part in render_conversation(hi, tools=prompt.tools, options=DS4).parts:
        if isinstance(part, Control):
            total += 1 + (count(run) if run else 0)
            run = ""
        else:
            run += part
    return total + (count(run) if run else 0)


def _trim_tools(draft: _Draft, w: Writer, limit: float, size: int, count: Callable[[str], int]) -> None:
    """Drop tools (never a core one, never under ten) or usage notes, at random, until `size` is under
    `limit`; a tool's last note goes only when no tool can be dropped."""
    cores = {tool.name for tool in draft.core.values()}

    def weight(tool: Tool) -> int:
        return count(json.dumps(tool.declaration(draft.shape, draft.style.bullet)))

    while size > limit:
        spare = [t for t in draft.tools if t.name not in cores]
        noted = max(draft.tools, key=lambda t: len(t.notes))
        if len(draft.tools) > TOOL_COUNT[0] and spare and (len(noted.notes) <= 1 or w.chance(0.5)):
            tool = w.pick(spare)
            size -= weight(tool)
            draft.tools.remove(tool)
        elif noted.notes:
            before = weight(noted)
            noted.notes.pop()
            size -= before - weight(noted)
        else:
            break


def agent_prompt(shape: str, seed: int, tokens: tuple[int, int], count: Callable[[str], int]) -> AgentPrompt:
    """A prompt whose rendered system+tools+context (`rendered_tokens`) is within `tokens` (low, high) as
    measured by count (a tokenizer's len(encode(text)))."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    low, high = tokens
    w = Writer(np.random.default_rng([seed, SHAPES.index(shape)]), {})
    draft = _draft(w, shape)
    target = low + (high - low) * float(w.rng.uniform(0.3, 0.7))
    _trim_tools(draft, w, target * float(w.rng.uniform(0.3, 0.6)), rendered_tokens(draft.build(), count), count)
    size = rendered_tokens(draft.build(), count)
    supply = sections(w, draft.style)
    for _ in range(FIT_PASSES):
        if low <= size <= high:
            return draft.build()
        if size < low:
            while size < target:
                draft.sections.append(next(supply))
                size += count(draft.sections[-1].text) + 1
        else:
            if not draft.sections:
                break
            while draft.sections and size - count(draft.sections[-1].text) - 1 >= target:
                size -= count(draft.sections.pop().text) + 1
            last = draft.sections[-1] if draft.sections else None
            while last is not None and len(last.rules) > 1 and size > target:
                size -= count(last.rules.pop()) + 1
            if last is not None and size > target and last.tail:
                last.tail = ""
        size = rendered_tokens(draft.build(), count)
    raise ValueError(f"no {shape} prompt of seed {seed} fits {tokens} tokens (the last had {size})")


# -- the conversation and the body ----------------------------------------------------------------------
def _check_turns(turns: Sequence[Mapping[str, Any]]) -> None:
    roles = [turn.get("role") for turn in turns]
    if not roles or roles[0] != "user":
        raise ValueError("the turns must start with a user turn")
    for a, b in zip(roles, roles[1:], strict=False):
        if a == b and a in ("user", "assistant"):
            raise ValueError("user and assistant turns must alternate (a client would send them as one)")


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    arguments = call["function"].get("arguments") or {}
    return json.loads(arguments) if isinstance(arguments, str) else dict(arguments)


def conversation(prompt: AgentPrompt, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The internal messages the server renders for `request_body(prompt, turns)`: the system text, the
    preface (responses: its items as messages; messages: its blocks joined before the first user words),
    then `turns`."""
    _check_turns(turns)
    messages: list[dict[str, Any]] = [{"role": "system", "content": prompt.system}] if prompt.system else []
    if prompt.shape == "responses":
        texts = ["".join(b["text"] for b in item["content"]) for item in prompt.preface]
        messages += [{"role": item["role"], "content": t} for item, t in zip(prompt.preface, texts, strict=True)]
    for n, turn in enumerate(turns):
        message = dict(turn)
        if n == 0 and prompt.shape != "responses":
            message["content"] = prompt.context + turn["content"]
        messages.append(message)
    return messages


def _messages_body(prompt: AgentPrompt, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n, turn in enumerate(turns):
        if turn["role"] == "user":
            out.append({"role": "user", "content": [*(prompt.preface if n == 0 else []), _text(turn["content"])]})
        elif turn["role"] == "assistant":
            reasoning = turn.get("reasoning_content")
            blocks = [{"type": "thinking", "thinking": reasoning, "signature": f"sig_{n}"}] if reasoning else []
            blocks += [_text(turn["content"])] if turn.get("content") or not turn.get("tool_calls") else []
            for call in turn.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"]})
                blocks[-1]["input"] = _arguments(call)
            out.append({"role": "assistant", "content": blocks})
        else:
            result = {"type": "tool_result", "tool_use_id": turn["tool_call_id"], "content": turn["content"]}
            if out[-1]["role"] == "user" and all(b["type"] == "tool_result" for b in out[-1]["content"]):
                out[-1]["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
    return out


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _responses_input(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n, turn in enumerate(turns):
        if turn["role"] == "user":
            out.append(_item("user", [turn["content"]]))
        elif turn["role"] == "assistant":
            if turn.get("reasoning_content"):
                summary = [{"type": "summary_text", "text": turn["reasoning_content"]}]
                out.append({"id": f"rs_{n}", "type": "reasoning", "summary": summary})
            if turn.get("content") or not turn.get("tool_calls"):
                content = [{"type": "output_text", "text": turn.get("content") or ""}]
                out.append({"id": f"msg_{n}", "type": "message", "role": "assistant", "content": content})
                out[-1]["status"] = "completed"
            for call in turn.get("tool_calls") or []:
                arguments = json.dumps(_arguments(call), ensure_ascii=False, separators=(",", ":"))
                out.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"]})
                out[-1]["arguments"] = arguments
        else:
            out.append({"type": "function_call_output", "call_id": turn["tool_call_id"], "output": turn["content"]})
    return out


def _chat_message(turn: dict[str, Any]) -> dict[str, Any]:
    if turn["role"] != "assistant" or not turn.get("tool_calls"):
        return dict(turn)
    calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(_arguments(c))},
        }
        for c in turn["tool_calls"]
    ]
    return {**turn, "content": turn.get("content") or "", "tool_calls": calls}


def request_body(prompt: AgentPrompt, turns: list[dict[str, Any]], model: str = "deepseek-v4-flash") -> dict[str, Any]:
    """The API request body the client would send for `turns` (internal form: user, assistant with
    tool_calls and optional reasoning_content, tool)."""
    _check_turns(turns)
    if prompt.shape == "chat":
        messages = [{"role": "system", "content": prompt.system}, *map(_chat_message, turns)]
        return {"model": model, **prompt.head, "messages": messages}
    if prompt.shape == "messages":
        return {"model": model, **prompt.head, "messages": _messages_body(prompt, turns)}
    return {"model": model, **prompt.head, "input": [*prompt.preface, *_responses_input(turns)]}
