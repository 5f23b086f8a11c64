"""V4.1's window rows against the note's §1 "Window" restated in numpy float64."""

from __future__ import annotations

import pytest
import torch
from v41_restate import fp8_pow2, report, rms_norm, rope

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.v41.window import window_rows
from dwarfstar.model.config import ModelArgs, yarn_inv_freq
from dwarfstar.model.numerics import rope_angles

T, D, ROPE = 9, 128, 32
ARGS = ModelArgs().with_(rope_dim=ROPE)


@pytest.mark.parametrize("layer", [0, 2])  # ratio 0 (rope_theta, no YaRN) and a compressed layer
def test_window_rows_match_the_note(layer):
    inv = torch.tensor(yarn_inv_freq(ARGS, ARGS.layer(layer)), dtype=torch.float64)
    g = torch.Generator().manual_seed(layer)
    kv, norm = torch.randn(T, D, generator=g) * 3, torch.rand(D, generator=g) + 0.5
    positions = torch.arange(100, 100 + T)
    got = window_rows(kv, norm, positions, inv, 1e-20)
    want = fp8_pow2(
        rope(rms_norm(kv.numpy().astype("float64"), norm.numpy(), 1e-20), positions.numpy(), inv.numpy()), 32
    )
    assert report(f"window rows (layer {layer})", got.numpy(), want) < 1e-5
    # the RoPE tail is rounded too (V4 leaves it exact), and row by row gives the same bits
    exact = ops.apply_rope(ops.rms_norm(kv, norm, 1e-20), *rope_angles(positions, inv))
    assert not torch.equal(got[:, -ROPE:], exact[:, -ROPE:])
    for t in range(T):
        assert torch.equal(window_rows(kv[t : t + 1], norm, positions[t : t + 1], inv, 1e-20), got[t : t + 1])


def test_shapes_are_checked():
    inv = torch.ones(ROPE // 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="window rows"):
        window_rows(torch.zeros(2, D), torch.ones(D - 1), torch.arange(2), inv, 1e-20)
    with pytest.raises(ValueError, match="RoPE"):
        window_rows(torch.zeros(2, 16), torch.ones(16), torch.arange(2), inv, 1e-20)
