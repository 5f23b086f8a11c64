"""Agent-shaped training data for the nano model: turns after a coding agent's long system prompt.

A coding agent (Claude Code, Codex, opencode) sends a 6-16k-token system prompt with 10-20 tool
declarations before the user's words. The prompts here come from our own generator
(dwarfstar/train/agent_prompts.py), in each client's request shape, and the turns that follow are:

- a greeting or a question about the model: a short answer that ends the turn;
- a request that names a file, a directory or a text to search, with the argument bare, quoted or
  backticked: a DSML call of the prompt's core tool for it (`cat {}` for a shell tool, the argument
  quoted where the request quotes it: `CoreTool.call`), the tool's result, and an answer quoting the
  result (chat_data's round trip); a share stop after the call.

The clients ask for thinking, so most turns are in thinking mode with one short sentence of
reasoning. Requests, greetings and arguments are split into training and held-out parts as in
chat_data, so the evaluation (dwarfstar/train/agent_eval.py) asks what training never showed.
A sample's prefix is the system prompt with its tools: training runs it once per prompt and
continues every sample of that prompt from a copy of its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dwarfstar.prompt.render_options import DS4, RenderOptions
from dwarfstar.tokenizer.specials import USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.train.agent_prompts import AgentPrompt, conversation
from dwarfstar.train.chat_data import (
    HELDOUT_TEMPLATES,
    REASONING,
    TRAIN_TEMPLATES,
    PromptEncoder,
    Sample,
    ToolRequest,
    argument_words,
    assistant_targets,
    bare,
    book_sentences,
    copied_spelling,
    function_call,
    quoting_answer,
    tool_argument,
    tool_result,
)
from dwarfstar.train.greetings import greeting_set

THINKING_SHARE = 0.8  # every client asks for thinking; the rest without, as other clients send
GREETING_SHARE = 0.3
CALL_ONLY_SHARE = 0.3  # round trips cut after the call: the call is the hard part


def request_templates(heldout: bool) -> list[tuple[str, str, str]]:
    """Each template as written (quoted or backticked) and bare."""
    templates = HELDOUT_TEMPLATES if heldout else TRAIN_TEMPLATES
    return [(tool, lang, form) for tool, lang, t in templates for form in (t, bare(t))]


@dataclass(frozen=True)
class AgentTurn:
    """One user request after an agent prompt, with what the model should do."""

    kind: str  # "greeting", or the tool: "read", "list", "search"
    language: str
    text: str  # the user's words
    answer: str = ""  # a greeting's answer
    argument: str = ""  # a tool request's argument

    @property
    def request(self) -> ToolRequest:
        """A tool request's turn as chat_data's round trips take it."""
        return ToolRequest(self.kind, self.language, self.text, self.argument)


def agent_turns(
    book: str,
    n: int,
    seed: int,
    *,
    heldout: bool,
    composed_greetings: bool = False,
    greeting_share: float = GREETING_SHARE,
) -> list[AgentTurn]:
    """`n` requests, `greeting_share` of them greetings (`GREETINGS`, or `COMPOSED_GREETINGS`), the rest
    tool requests (bare, quoted or backticked) over training (or held-out) templates and argument words."""
    rng = np.random.default_rng(seed)
    train_words, heldout_words = argument_words(book)
    words = heldout_words if heldout else train_words
    greetings = greeting_set(heldout, composed_greetings)
    templates = request_templates(heldout)
    out = []
    for _ in range(n):
        if rng.random() < greeting_share:
            text, language, answer = greetings[int(rng.integers(len(greetings)))]
            out.append(AgentTurn("greeting", language, text, answer=answer))
            continue
        tool, language, template = templates[int(rng.integers(len(templates)))]
        argument = tool_argument(tool, lambda: str(words[int(rng.integers(len(words)))]), rng)
        out.append(AgentTurn(tool, language, template.format(argument), argument=argument))
    return out


def turn_messages(
    prompt: AgentPrompt,
    turn: AgentTurn,
    sentences: Sequence[str],
    rng: np.random.Generator,
    thinking: bool,
    reasoning_sentence: bool = True,
) -> list[dict]:
    """The conversation after the agent prompt: the request and the assistant's part (in thinking mode
    its reasoning is one sentence, or empty without `reasoning_sentence`)."""

    def reasoning(kind: str) -> dict:
        if not thinking:
            return {}
        return {"reasoning_content": REASONING[kind, turn.language] if reasoning_sentence else ""}

    user = {"role": "user", "content": turn.text}
    if turn.kind == "greeting":
        return [user, {"role": "assistant", "content": turn.answer, **reasoning("greeting")}]
    request = turn.request
    call = function_call(*prompt.core[turn.kind].call(turn.argument, request.quoted))
    messages = [user, {"role": "assistant", "content": "", "tool_calls": [call], **reasoning(turn.kind)}]
    if rng.random() < CALL_ONLY_SHARE:
        return messages
    result = tool_result(request, sentences, rng)
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
    messages.append({"role": "assistant", "content": quoting_answer(request, result, rng), **reasoning("answer")})
    return messages


def agent_samples(
    prompt: AgentPrompt,
    book: str,
    tokenizer: Tokenizer,
    n: int,
    seed: int,
    options: RenderOptions = DS4,
    *,
    heldout: bool = False,
    reasoning: bool = True,
    composed_greetings: bool = False,
    greeting_share: float = GREETING_SHARE,
) -> list[Sample]:
    """`n` rendered turns after `prompt` in the server template `options`, their prefix the system
    prompt with its tools (one per prompt and template, which training runs once for all of its
    samples), the assistant's output their targets; `reasoning`: a thinking turn reasons in one
    sentence, else its reasoning is empty (the reply then decides right after `</think>`);
    `composed_greetings`, `greeting_share`: agent_turns'."""
    rng = np.random.default_rng(seed + 1)
    sentences = book_sentences(book, tokenizer)
    encode = PromptEncoder(tokenizer)
    samples = []
    turns = agent_turns(
        book, n, seed, heldout=heldout, composed_greetings=composed_greetings, greeting_share=greeting_share
    )
    for turn in turns:
        thinking = bool(rng.random() < THINKING_SHARE)
        messages = conversation(prompt, turn_messages(prompt, turn, sentences, rng, thinking, reasoning))
        ids = encode.render(messages, tools=prompt.tools, thinking=thinking, options=options)
        prefix = ids.index(tokenizer.token_id(USER))
        ids, span = copied_spelling(ids, turn.request, tokenizer)
        samples.append(Sample(np.asarray(ids, dtype=np.int64), assistant_targets(ids, tokenizer), prefix, span))
    return samples
