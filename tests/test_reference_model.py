"""The reference forward pass on the tiny model: one full pass, chunked prefill and token-by-token
decode agree; the compressed and indexed paths are really exercised; bad input gets a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model

PROMPT = torch.randint(3, 120000, (300,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return open_model(path)


def run_chunks(model: ReferenceModel, tokens: list[int], sizes: list[int]) -> torch.Tensor:
    state, out, i = model.new_state(), [], 0
    while i < len(tokens):
        size = sizes[len(out) % len(sizes)]
        out.append(model.forward(tokens[i : i + size], state))
        i += size
    return torch.cat(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = p_logits.log_softmax(-1)
    return (p.exp() * (p - q_logits.log_softmax(-1))).sum(-1).mean().item()


def test_prefill_chunks_and_decode_match_one_pass_without_rounding(tiny):
    model = ReferenceModel(tiny, qat=False)
    full = model.forward(PROMPT, model.new_state())
    for sizes in ([1], [3, 64, 1, 17], [128], [299, 1]):
        assert rel_err(run_chunks(model, PROMPT, sizes), full) < 1e-5, sizes


def test_prefill_and_decode_agree_with_rounding(tiny):
    """Spec §9: with the QAT rounding on, fp32 noise legitimately flips a few rounding decisions.

    Here one raw KV row (position 223) rounds differently, which moves the 8 queries that see it by
    about 1e-3 relative; the spec's criteria are top-1 identical, mean KL < 1e-6, max rel ~1e-3.
    """
    model = ReferenceModel(tiny, qat=True)
    full = model.forward(PROMPT, model.new_state())
    decoded = run_chunks(model, PROMPT, [1])
    assert torch.equal(decoded.argmax(-1), full.argmax(-1))
    assert mean_kl(full, decoded) < 1e-6
    assert rel_err(decoded, full) < 2e-3


def test_long_prompt_fills_every_kind_of_state(tiny):
    model = ReferenceModel(tiny, qat=True)
    state = model.new_state()
    model.forward(PROMPT, state)
    window_only, ratio4, ratio128 = (state.host_parts(il) for il in (0, 2, 3))
    assert set(window_only) == {"raw"} and window_only["raw"].shape == (TINY.window, TINY.head_dim)
    assert ratio4["attn_rows"].shape == (300 // 4, TINY.head_dim)
    assert ratio4["indexer_rows"].shape == (300 // 4, TINY.index_head_dim)
    assert ratio128["attn_rows"].shape == (300 // 128, TINY.head_dim)
    # the window in progress (tokens 256..299) sits in frontier rows 0..43; the rest is unwritten
    gate = ratio128["attn_gate"]
    assert np.isfinite(gate[: 300 % 128]).all() and np.isinf(gate[300 % 128 :]).all()
    # ratio 4: rows 0..3 keep the last complete window (tokens 296..299), rows 4..7 are empty
    gate4 = ratio4["attn_gate"]
    assert np.isfinite(gate4[:4]).all() and np.isinf(gate4[4:]).all()


def test_indexer_selection_changes_the_output(tiny):
    """With 75 compressed rows and top-k 4 the indexer picks a strict subset; taking all rows differs."""
    sparse = ReferenceModel(tiny, qat=False)
    dense = ReferenceModel(tiny, qat=False)
    dense.ops.args = dense.ops.args.with_(index_topk=10_000)
    a = sparse.forward(PROMPT, sparse.new_state())
    b = dense.forward(PROMPT, dense.new_state())
    assert torch.allclose(a[:15], b[:15])  # before row 4 exists, every visible row is selected
    assert rel_err(a[200:], b[200:]) > 1e-3


def test_rounding_switch_changes_the_model(tiny):
    on = ReferenceModel(tiny, qat=True)
    off = ReferenceModel(tiny, qat=False)
    assert rel_err(on.forward(PROMPT, on.new_state()), off.forward(PROMPT, off.new_state())) > 1e-4


def test_context_overflow_is_a_clear_error(tiny):
    model = ReferenceModel(tiny, max_seq_len=16)
    state = model.new_state()
    model.forward(list(range(10)), state)
    with pytest.raises(ContextOverflowError, match="10 \\+ 7 tokens exceed the context of 16"):
        model.forward(list(range(7)), state)
    assert state.pos == 10  # the failed call changed nothing


def test_token_outside_vocabulary_is_rejected(tiny):
    model = ReferenceModel(tiny)
    with pytest.raises(DwarfStarError, match="token id 129280 is outside the vocabulary"):
        model.forward([1, 129280], model.new_state())
