"""The tool-call guard in the in-process decode loops (`Session.generate`, `Speculator.generate`, which
`dwarfstar agent` replies through): a random model whose reply starts inside a tool-call block writes
only what the block may hold there, a declared tool's name first; greedy, the speculator emits what
plain decoding emits under the same guard."""

from __future__ import annotations

from conftest import PROMPT
from spec_support import CHUNK, CTX, speculative

from dwarfstar.prompt import dsml
from dwarfstar.prompt.dsml_guard import ToolGrammar, ToolGuard
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.mtp import load_draft

TOOLS = [
    {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
    {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
]
INVOKE = "\n" + dsml.INVOKE_OPEN


def opened(tokenizer) -> ToolGuard:
    """A guard whose block has just opened (the reply continues the model's `<｜DSML｜tool_calls>`)."""
    guard = ToolGuard(ToolGrammar(TOOLS), tokenizer, thinking=False)
    for token in tokenizer.encode(dsml.BLOCK_OPEN):
        guard.push(token)
    assert guard.in_block
    return guard


def check_block(tokenizer, tokens: list[int]) -> str:
    """The text of `tokens`, which a fresh copy of the opened guard allows one by one."""
    shadow = opened(tokenizer)
    for token in tokens:
        assert shadow.allows(token), tokenizer.decode(tokens)
        shadow.push(token)
    return tokenizer.decode(tokens)


def test_a_sampled_reply_inside_a_block_keeps_to_the_tools(engines):
    engine = engines("reference")
    session = Session(engine.backend, ctx=CTX, chunk=CHUNK)
    session.prefill(PROMPT)
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.0, seed=3))
    tokens = list(session.generate(40, sampler, guard=opened(engine.tokenizer)))
    text = check_block(engine.tokenizer, tokens)
    assert text.startswith((INVOKE + 'Read">\n', INVOKE + 'Bash">\n')), text
    unguarded = Session(engine.backend, ctx=CTX, chunk=CHUNK)
    unguarded.prefill(PROMPT)
    assert not engine.tokenizer.decode(list(unguarded.generate(40, Sampler(sampler.params)))).startswith(INVOKE)


def test_speculation_under_the_guard_emits_plain_decodings_tokens(engines):
    engine = engines("reference")
    session = Session(engine.backend, ctx=CTX, chunk=CHUNK)
    session.prefill(PROMPT)
    plain = list(session.generate(40, GREEDY, guard=opened(engine.tokenizer)))
    spec = speculative(engine.backend, load_draft(engine.backend, engine.model), PROMPT, 3)
    drafted = list(spec.generate(40, GREEDY, guard=opened(engine.tokenizer)))
    assert drafted == plain
    check_block(engine.tokenizer, drafted)
    assert sum(spec.stats.drafted) > 0
