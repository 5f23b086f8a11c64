"""Synthetic in-memory models: well-formed random blocks, full-size presets, states at a given context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dwarfstar.backends.triton import synthetic, weights
from dwarfstar.backends.triton.model import TritonModel
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.model.synthetic import Q2, TINY_K


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS])
def test_random_blocks_decode_to_sane_values(ggml_type, device):
    gen = torch.Generator(device=device).manual_seed(0)
    w = weights.random_qweight(ggml_type, (4, 64, 512), device, gen)
    assert (w.rows, w.cols, w.experts, w.expert_rows) == (256, 512, 4, 64)
    values = w.dequantize()
    assert torch.isfinite(values).all()
    std = values.std().item() * 512**0.5  # ~ N(0, 1/cols), like the float tensors
    assert 0.7 < std < 1.4


def test_presets_keep_the_real_shapes():
    args, recipe = synthetic.synthetic_args("flash-q2", layers=5)
    assert (args.n_layers, args.dim, args.n_routed_experts, args.compress_ratios[:5]) == (
        5,
        4096,
        256,
        (0, 0, 4, 128, 4),
    )
    assert recipe == Q2
    pro, _ = synthetic.synthetic_args("pro-q2")
    assert (pro.n_layers, pro.dim, pro.n_routed_experts, pro.index_topk) == (61, 7168, 384, 1024)
    with pytest.raises(ValueError, match="layers"):
        synthetic.synthetic_args("flash-q4", layers=44)


def test_tiny_synthetic_model_runs_from_a_long_context_state(device, monkeypatch):
    """The same construction on tiny-k shapes: a state at context 37 decodes to finite logits."""
    monkeypatch.setitem(synthetic.PRESETS, "tiny-k", (TINY_K, Q2))
    model = TritonModel(synthetic.synthetic_weights("tiny-k", device=device))
    state = synthetic.synthetic_state(model, ctx=37)
    ratio4 = state.host_parts(2)
    assert ratio4["attn_rows"].shape[0] == 9 and np.isfinite(ratio4["attn_rows"]).all()  # written, not left empty
    assert state.host_parts(3)["attn_rows"].shape[0] == 0
    assert np.isinf(ratio4["attn_gate"][5:]).all() and np.isfinite(ratio4["attn_gate"][:5]).all()  # 37 % 4 = 1 pending
    logits = model.forward([11], state)
    assert logits.shape == (1, TINY_K.vocab_size) and torch.isfinite(logits).all()
    assert state.pos == 38 and state.host_parts(2)["attn_rows"].shape[0] == 9
