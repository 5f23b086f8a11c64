"""The loop guard on the bundled model: at temperature 0, 20 everyday prompts of 128 tokens each are
never cut short. Marked slow (about 5 minutes on two cores): `nox -s slow -- -k loop_guard`."""

from __future__ import annotations

from pathlib import Path

import pytest

import dwarfstar
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.prompt import render_conversation
from dwarfstar.sampling import GREEDY
from dwarfstar.session.loopguard import LoopGuard, Repetition
from dwarfstar.session.session import Session

TOKENS = 128
PROMPTS = [
    "Tell me about Milan", "What is 2+2?", "Write a haiku about the sea", "Who wrote I promessi sposi?",
    "List three fruits", "Explain gravity briefly", "Translate 'good morning' to Italian", "What is Python?",
    "Name a planet", "Describe a cat", "How do I boil an egg?", "What is the capital of France?",
    "Give me a word that rhymes with light", "Why is the sky blue?", "Count to five", "What is a prime number?",
    "Say hello", "Summarize the plot of Hamlet", "What does a compiler do?", "Suggest a name for a dog",
]  # fmt: skip


@pytest.mark.slow
def test_the_bundled_model_at_temperature_0_is_not_cut_short() -> None:
    engine = load_engine(EngineSpec(Path(dwarfstar.__file__).parent / "data" / "nano.gguf", "reference", ctx=2048))
    eos = engine.model.args.eos_token_id
    cut = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode_prompt(render_conversation([{"role": "user", "content": prompt}]).parts)
        session = Session(engine.backend, ctx=2048)
        session.prefill(ids)
        guard = Repetition(LoopGuard())
        if any(guard.push(t) for t in session.generate(TOKENS, GREEDY, stop_tokens=[eos])):
            cut.append((prompt, guard.detail))
    assert cut == []
