"""The bundled model with its trained MTP block (dwarfstar/data/nano-mtp.gguf): greedy speculation
with 1..4 drafts gives the plain greedy text for 300 tokens, while accepting real drafts at every
position. The model's raw window is 32 and it has ratio-128 layers, so the run wraps the window
and crosses positions 128 and 256.

Equality is bitwise without the QAT rounding. With it, a verifying pass over several tokens and a
one-token decode differ by float noise (different matmul shapes), which an FP8 step of the KV
rounding can turn into a logit change of ~1e-2: the texts may then part at a near-tie, and only there.
"""

from __future__ import annotations

import pytest
from spec_support import first_gap

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator
from dwarfstar.speculative.mtp import load_draft

N_TOKENS = 300
CTX = 1024
NEAR_TIE = 1e-2  # a top-1 / top-2 logit gap the QAT rounding's amplified noise can swap


def run_nano(qat: bool):
    engine = load_engine(EngineSpec(default_model_path(), "reference", ctx=CTX, qat=qat))
    prompt = engine.tokenizer.encode("Quel ramo del lago di Como, che volge a mezzogiorno")
    session = Session(engine.backend, ctx=CTX)
    session.prefill(prompt)
    want = list(session.generate(N_TOKENS, GREEDY))
    draft = load_draft(engine.backend, engine.model, default_model_path().with_name("nano-mtp.gguf"))
    return engine, draft, prompt, want


def speculate(nano, n_draft: int) -> tuple[list[int], Speculator]:
    engine, draft, prompt, _ = nano
    spec = Speculator(Session(engine.backend, ctx=CTX), draft, n_draft)
    spec.prefill(prompt)
    return list(spec.generate(N_TOKENS, GREEDY)), spec


@pytest.fixture(scope="module")
def nano_exact():
    return run_nano(qat=False)


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_trained_drafts_change_nothing(nano_exact, n_draft):
    got, spec = speculate(nano_exact, n_draft)
    assert first_gap(got, nano_exact[3]) is None and len(got) == N_TOKENS
    assert all(a > 0 for a in spec.stats.accepted[:n_draft])  # drafts accepted at every position


def test_with_qat_rounding_texts_part_only_at_a_near_tie():
    nano = run_nano(qat=True)
    engine, _, prompt, want = nano
    got, _ = speculate(nano, 3)
    gap = first_gap(got, want)
    position = len(got) if gap is None else gap
    logits = engine.backend.forward(prompt + want[:position], engine.backend.new_state())[len(prompt) - 1 :]
    top2 = logits.topk(2).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    assert got[:position] == want[:position]
    # where the texts part (if they do), the plain run's choice was a near-tie
    assert gap is None or margins[gap] < NEAR_TIE, margins[gap]
