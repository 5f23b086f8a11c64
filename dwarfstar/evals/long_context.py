"""`dwarfstar test long-context`: ds4's long-context recall gate (`ds4_test --long-context`, §5.1).

The prompt file is already rendered (BOS, system, `<｜User｜>` story and task, `<｜Assistant｜></think>`),
so it is tokenized with its control tokens as written. It must be longer than 30,000 tokens; the
session holds 100,000; 350 tokens are decoded greedily (stopping at EOS). Each of the 16 facts must be
in the output:

- a `Name=number` fact follows ds4's rule: somewhere the name stands as a word (no letter, digit or
  `_` either side), followed by optional spaces or tabs, `=`, optional spaces or tabs and the number.
  A name assigned another number is reported as a wrong assignment, one never assigned as missing.
- any other fact line (in a `--facts` file) is a phrase that must appear verbatim: fixtures for models
  that do not write assignments (the bundled one) pin phrases of the output the reference produced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dwarfstar.engine.load import Engine
from dwarfstar.evals import EvalError, read_input
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer

DS4_FACTS = (
    "Bob=34", "Alice=52", "Clara=71", "Diego=93", "Elena=16", "Felix=88", "Greta=47", "Hugo=29",
    "Iris=64", "Jonas=12", "Kira=81", "Leo=39", "Marta=76", "Nadia=23", "Owen=58", "Priya=97",
)  # fmt: skip
DEFAULT_CTX = 100_000
DEFAULT_TOKENS = 350
MIN_PROMPT_TOKENS = 30_000
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=([0-9]+)$")


@dataclass
class LongContextResult:
    prompt_tokens: int
    output: str
    problems: list[str] = field(default_factory=list)
    found: int = 0

    @property
    def passed(self) -> bool:
        return not self.problems


def read_facts(path: Path | None) -> list[str]:
    if path is None:
        return list(DS4_FACTS)
    facts = [line.strip() for line in read_input(path, "facts file").splitlines()]
    facts = [f for f in facts if f and not f.startswith("#")]
    if not facts:
        raise EvalError(f"{path} lists no facts")
    return facts


def _assigned_values(text: str, name: str) -> list[int]:
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])[ \t]*=[ \t]*([0-9]+)")
    return [int(m.group(1)) for m in pattern.finditer(text)]


def check_fact(text: str, fact: str) -> str | None:
    """None when the fact is in the text, else what is wrong."""
    assignment = _ASSIGNMENT.match(fact)
    if assignment is None:
        return None if fact in text else f"missing phrase {fact!r}"
    name, number = assignment.group(1), int(assignment.group(2))
    values = _assigned_values(text, name)
    if number in values:
        return None
    if values:
        return f"wrong assignment for {name}: got {values[0]} expected {number}"
    return f"missing assignment {name}={number}"


def run_long_context(
    engine: Engine,
    prompt_file: Path,
    facts: list[str],
    ctx: int = DEFAULT_CTX,
    tokens: int = DEFAULT_TOKENS,
    min_prompt_tokens: int = MIN_PROMPT_TOKENS,
    on_chunk=None,
) -> LongContextResult:
    ids = engine.tokenizer.encode_with_specials(read_input(prompt_file, "prompt file"))
    result = LongContextResult(len(ids), "")
    if len(ids) <= min_prompt_tokens:
        result.problems.append(f"the prompt has {len(ids)} tokens, not more than {min_prompt_tokens}")
        return result
    if len(ids) + 1 > ctx:
        raise EvalError(f"the prompt ({len(ids)} tokens) does not fit a context of {ctx}")
    session = Session(engine.backend, ctx=ctx)
    session.prefill(ids, on_chunk)
    detok = IncrementalDetokenizer(engine.tokenizer)
    greedy = Sampler(SamplingParams(temperature=0.0))
    eos = engine.tokenizer.eos_id
    pieces = [detok.push(t) for t in session.generate(tokens, greedy, [eos]) if t != eos]
    result.output = "".join(pieces) + detok.flush()
    for fact in facts:
        problem = check_fact(result.output, fact)
        if problem:
            result.problems.append(problem)
        else:
            result.found += 1
    return result
