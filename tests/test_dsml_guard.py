"""The tool-call guard (dwarfstar/prompt/dsml_guard.py), on the bundled tokenizer: a block the official
layout writes (dsml.render_tool_calls, an independent writer) passes untouched, token by token; what
the request's tools rule out (a name, a parameter twice, a missing required one, the wrong string
flag, a control token) never comes out; the structure is greedy, a value keeps its draw; nothing
before the block, nor in the reasoning, is touched; speculation applies the same choices."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.prompt import dsml
from dwarfstar.prompt.dsml_guard import SCAN, ToolGrammar, ToolGuard
from dwarfstar.speculative.decode import _guided
from dwarfstar.speculative.verify import Verdict
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json

VOCAB = 129_280
TOOLS = [
    {  # Anthropic's shape
        "name": "Read",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["file_path"],
        },
    },
    {  # OpenAI's
        "type": "function",
        "function": {
            "name": "Bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
    {"name": "Notes", "parameters": {"type": "object"}},  # no properties: any parameter name
]
CALLS = [
    dsml.ToolCall("Read", {"file_path": "src/caffè ☕.py", "limit": 30}),
    dsml.ToolCall("Bash", {"command": 'grep -rn "</a>" . | head'}),
    dsml.ToolCall("Notes", {}),
    dsml.ToolCall("Notes", {"tags": ["a", "b"], "text": "<b>bold</b> & more"}),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), VOCAB)


def guard(tok: Tokenizer, *, thinking: bool = False, escaped: bool = False) -> ToolGuard:
    return ToolGuard(ToolGrammar(TOOLS, escaped=escaped), tok, thinking=thinking)


def one_hot(token: int, value: float = 30.0) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[token] = value
    return row


def ids(tok: Tokenizer, *parts) -> list[int]:
    return tok.encode_prompt(list(parts))


def fed(g: ToolGuard, tokens: list[int]) -> ToolGuard:
    for token in tokens:
        assert g.allows(token)
        g.push(token)
    return g


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("escaped", [False, True])
def test_a_block_as_the_official_layout_writes_it_passes_untouched(tok, thinking, escaped):
    reasoning = ["I should read it first.", specials.THINK_END] if thinking else []
    block = dsml.render_tool_calls(CALLS, escape=escaped)
    tokens = ids(tok, *[specials.Control(p) if p == specials.THINK_END else p for p in reasoning], "Reading.", *block)
    g = guard(tok, thinking=thinking, escaped=escaped)
    for token in tokens:
        assert g.choose(token, one_hot(token)) == token, tok.decode([token])
        g.push(token)
    assert not g.in_block  # closed: free again


def at_name(tok: Tokenizer) -> ToolGuard:
    """A guard whose block has opened an invoke: the tool's name comes next."""
    opener = dsml.render_tool_calls([CALLS[0]])[:4]  # the separator and `<｜DSML｜tool_calls>`
    return fed(guard(tok), ids(tok, "Ok.", *opener, "\n", *dsml._tag(dsml.INVOKE_OPEN)))


def test_a_name_the_tools_do_not_declare_becomes_the_declared_one_ranked_best(tok):
    g = at_name(tok)
    read, lower, bash = (tok.encode(s)[0] for s in ("Read", "read", "Bash"))
    row = one_hot(lower, 9.0)
    row[read], row[bash] = 5.0, 6.0
    assert not g.allows(lower)
    assert g.choose(lower, row) == bash  # the best the model ranks among the declared names
    row[read] = 7.0
    assert g.choose(lower, row) == read


def test_the_structure_is_greedy_and_a_value_keeps_its_draw(tok):
    g = at_name(tok)
    b, read = tok.encode("B")[0], tok.encode("Read")[0]
    row = one_hot(read, 8.0)
    row[b] = 2.0
    assert g.allows(b) and g.choose(b, row) == read  # structure: the best allowed, not the draw
    header = dsml.render_tool_calls([CALLS[1]])
    g = fed(guard(tok), ids(tok, *header[: header.index('command" string="true">') + 1]))
    drawn, best = tok.encode(" ls")[0], tok.encode("grep")[0]
    row = one_hot(best, 8.0)
    row[drawn] = 2.0
    assert g.choose(drawn, row) == drawn  # a value: the request's sampling stands


def test_required_parameters_come_before_the_invoke_closes(tok):
    close = tok.encode("\n")[0]
    for name, may_close in (("Read", False), ("Notes", True)):
        block = dsml.render_tool_calls([dsml.ToolCall(name, {})])
        g = fed(guard(tok), ids(tok, *block[: block.index(f'{name}">\n') + 1]))
        assert g.allows(close) is may_close, name


def fits(g: ToolGuard, tok: Tokenizer, text: str) -> bool:
    trial = g.copy()
    for token in tok.encode(text):
        if not trial.allows(token):
            return False
        trial.push(token)
    return True


def test_a_parameter_comes_once_with_the_flag_of_its_type(tok):
    block = dsml.render_tool_calls([dsml.ToolCall("Read", {"file_path": "a"})])
    g = fed(guard(tok), ids(tok, *block[: block.index('file_path" string="true">')]))
    assert fits(g, tok, 'file_path" string="true">') and not fits(g, tok, 'file_path" string="false">')
    g = fed(g, ids(tok, 'file_path" string="true">a', *dsml._tag(dsml.PARAM_CLOSE), "\n", *dsml._tag(dsml.PARAM_OPEN)))
    assert not fits(g, tok, 'file_path" string="true">')
    assert fits(g, tok, 'limit" string="false">') and not fits(g, tok, 'limit" string="true">')


def test_control_tokens_are_refused_inside_a_block_only(tok):
    eos, user = tok.eos_id, tok.token_id(specials.USER)
    g = guard(tok)
    assert g.allows(eos) and g.allows(user)  # before a block: the model's choice
    block = dsml.render_tool_calls([CALLS[1]])
    value = block.index('command" string="true">') + 1
    g = fed(g, ids(tok, *block[:value], "ls"))
    assert not g.allows(eos) and not g.allows(user)  # not even in a value
    assert g.choose(eos, one_hot(eos)) != eos
    g = fed(g, ids(tok, *block[value + 1 :]))
    assert g.allows(eos) and not g.in_block  # closed


def test_reasoning_is_never_touched(tok):
    g = guard(tok, thinking=True)
    block = ids(tok, "Plan: ", *dsml.render_tool_calls([dsml.ToolCall("read", {"path": "x"})]))
    for token in block:  # a block written inside the reasoning is reasoning text
        assert g.choose(token, one_hot(token)) == token
        g.push(token)
    assert not g.in_block


def test_a_row_with_no_allowed_token_among_its_best_gets_the_continuation(tok):
    g = fed(guard(tok), ids(tok, *dsml.render_tool_calls([CALLS[1]])[:4]))  # after the opener
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    best = row.topk(SCAN).indices.tolist()
    assert not any(g.allows(t) for t in best)
    chosen = g.choose(best[0], row)
    assert g.allows(chosen) and tok.decode([chosen]).startswith("\n")


def test_speculation_makes_the_choice_plain_decoding_makes(tok):
    g = at_name(tok)
    read, lower, quote, lt = (tok.encode(s)[0] for s in ("Read", "read", '">\n', "<"))
    rows = torch.stack([one_hot(lower), one_hot(quote), one_hot(lt)])
    rows[0, read] = 10.0
    # the draft wrote the undeclared name and the target agreed: the round ends at the guard's choice
    assert _guided(g, [lower, quote], Verdict(2, lt), rows) == Verdict(0, read)
    assert g.choose(lower, rows[0]) == read and not g.allows(lower)  # as plain decoding; the guard not moved
    right = fed(g.copy(), [read])
    assert _guided(right, [quote], Verdict(1, lt), rows[1:]) == Verdict(1, lt)


def test_a_dsml_closing_tag_in_a_value_closes_the_parameter(tok):
    block = dsml.render_tool_calls([CALLS[1]])
    g = fed(guard(tok), ids(tok, *block[: block.index('command" string="true">') + 1], "ls ｜DSML｜ </a> "))
    assert fits(g, tok, "x")  # plain text that spells the bar or another closing tag stays in the value
    g = fed(g, ids(tok, "</", specials.Control(dsml.DSML)))
    skipped, closing = tok.encode("invoke>")[0], tok.encode("parameter>")[0]
    assert not g.allows(skipped) and g.allows(closing)
    assert g.choose(skipped, one_hot(skipped)) == closing  # the model's close, made the parameter's
