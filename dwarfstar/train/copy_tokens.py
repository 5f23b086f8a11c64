"""The token ids the planted copy circuit is built around (dwarfstar/train/induction.py): the call's
marker, the quote openers, a bare argument's leads, and the twin pairs (` X`, `X`) whose codes the
planting ties together, all of them or fewer (`TwinSet`, `Recipe.twins`)."""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum

import regex

from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.train.chat_data import (
    ANSWER_INTROS,
    CLIENT_CORE,
    CLIENT_TOOLS,
    DIRECTORIES,
    REASONING,
    TEMPLATES,
    TOOLS,
    TOOLS_CORE,
    TRAIN_TEMPLATES,
    PromptEncoder,
    ToolRequest,
    argument_words,
    bare,
    function_call,
    round_trip,
)
from dwarfstar.train.greetings import greeting_set

_SPACED_PIECE = regex.compile(r" \p{L}+")


class TwinSet(StrEnum):
    """Which twin pairs the planting ties: all of them; those with no piece in the short samples'
    fixed text (`fixed_text_ids`); of those, the ones that open a training argument (`argument_openers`)."""

    ALL = "all"
    FREE = "free"
    ARGUMENTS = "arguments"


def call_markers(tokenizer: Tokenizer) -> list[int]:
    """The token after which a DSML call's argument starts: the `">` that ends `string="true">`."""
    return tokenizer.encode('="true">')[-1:]


def quote_openers(tokenizer: Tokenizer) -> list[int]:
    """The tokens after which a request's argument starts: its opening backtick or quote (`` ` ``, ` "`)."""
    (backtick,), (quote,) = tokenizer.encode(" `"), tokenizer.encode(' "')
    return [backtick, quote]


def bare_leads(tokenizer: Tokenizer) -> list[int]:
    """The tokens after which a bare request's argument starts: the last token of each training
    template's words before it (` file`, ` for`, `erca`...), as the template spells them and after a
    space, as a longer request does (` cerca`)."""
    heads = [bare(t).split("{}")[0].rstrip() for _, _, t in TRAIN_TEMPLATES]
    return sorted({tokenizer.encode(spelling)[-1] for h in heads for spelling in (h, " " + h)})


def fixed_text_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids of what the short tool samples (`chat_data.tool_samples`) hold besides their arguments
    and the tool results: the rendered prompt and calls with empty arguments (the tools' declarations
    and the DSML markup of each tool's call, in every shape, template and mode, for `TOOLS` and the
    clients' own tools),
    the training request templates, the reasoning sentences, the answers' fixed phrases and the
    training greetings."""
    encode = PromptEncoder(tokenizer)
    ids: set[int] = set()
    for shape in sorted(TOOLS):
        for tools, core in ((TOOLS[shape], TOOLS_CORE), (CLIENT_TOOLS[shape], CLIENT_CORE[shape])):
            for kind, tool in core.items():  # as tool_samples renders a round trip and its call
                messages = round_trip(ToolRequest(kind, "en", "", ""), "", "")
                messages[1]["tool_calls"] = [function_call(*tool.call(""))]
                for options in TEMPLATES.values():
                    for thinking in (False, True):
                        ids.update(encode.render(messages, tools=tools, thinking=thinking, options=options))
    texts = [
        *(form.format("") for _, _, t in TRAIN_TEMPLATES for form in (t, bare(t))),
        *REASONING.values(),
        *ANSWER_INTROS.values(),
        *(text for request, _, answer in greeting_set(False, True) for text in (request, answer)),
    ]
    for text in texts:
        ids.update(tokenizer.encode(text))
    return ids


def twin_pieces(tokenizer: Tokenizer, fixed: Collection[int] = ()) -> list[tuple[int, int]]:
    """The vocabulary's twin pairs (` X`, `X`): a space-led word piece and the same letters as one
    token, which a bare argument's first token becomes in the call (`bare_value`); without the pairs
    either of whose ids is in `fixed` (`fixed_text_ids`)."""
    pairs = []
    for i in range(tokenizer.vocab_size):
        text = "" if tokenizer.is_added(i) else tokenizer.decode([i])
        if _SPACED_PIECE.fullmatch(text) and len(twin := tokenizer.encode(text[1:])) == 1:
            if i not in fixed and twin[0] not in fixed:
                pairs.append((i, twin[0]))
    return pairs


def argument_openers(text: str, tokenizer: Tokenizer) -> set[int]:
    """Where a bare request's argument starts: the first token of each training argument word of the
    book `text`, and of each directory, after a space (` divor` of ` divorato`, ` src`)."""
    train_words, _ = argument_words(text)
    return {tokenizer.encode(" " + word)[0] for word in [*train_words, *DIRECTORIES]}


def twin_set(tokenizer: Tokenizer, which: TwinSet, text: str) -> list[tuple[int, int]]:
    """The twin pairs `which` names, for the book `text`'s arguments."""
    pairs = twin_pieces(tokenizer, () if which == TwinSet.ALL else fixed_text_ids(tokenizer))
    if which != TwinSet.ARGUMENTS:
        return pairs
    openers = argument_openers(text, tokenizer)
    return [(spaced, plain) for spaced, plain in pairs if spaced in openers]
