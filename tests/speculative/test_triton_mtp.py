"""MTP speculation on the Triton backend (its interpreter on a machine without a GPU), at the small
model's shapes: greedy output equal to the Triton backend's plain greedy decoding, with the MTP block
drafting (almost every step rolls back) and with a scripted drafter (steps accept all, some or none),
the 8-row raw window wrapping."""

from __future__ import annotations

import pytest
from conftest import PROMPT
from spec_support import ScriptedDrafter, first_gap, plain_greedy, speculative

from dwarfstar.sampling import GREEDY
from dwarfstar.speculative.mtp import load_draft

pytest.importorskip("triton")
N_TOKENS = 10  # the interpreter runs each kernel in Python: a few steps of each kind


@pytest.fixture(scope="module")
def triton_model(mtp_files):
    from triton_interpreter import apply_patches

    from dwarfstar.backends.triton import load_backend
    from dwarfstar.model.loader import open_model

    apply_patches()
    model = open_model(mtp_files["nextn"])
    return load_backend(model, qat=True, max_seq_len=1024), model


@pytest.fixture(scope="module")
def plain(triton_model):
    return plain_greedy(triton_model[0], PROMPT, N_TOKENS).tokens


# slow: about 20 minutes in the interpreter on two busy cores; tools/gpu_check.sh runs it on the GPU,
# and `pytest -m slow tests/speculative/test_triton_mtp.py` here
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["mtp", "scripted"])
def test_triton_speculation_is_greedy_exact(triton_model, plain, drafter):
    backend, model = triton_model
    spec = speculative(backend, load_draft(backend, model), PROMPT, 2)
    if drafter == "scripted":
        spec.drafter = ScriptedDrafter(plain, wrong_every=3)
    got = list(spec.generate(N_TOKENS, GREEDY))
    assert first_gap(got, plain[len(PROMPT) :]) is None and len(got) == N_TOKENS
    assert spec.session.tokens == plain
    assert spec.stats.rollbacks > 0
    if drafter == "scripted":
        assert 0 < sum(spec.stats.accepted) < sum(spec.stats.drafted)
