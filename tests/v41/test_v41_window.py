"""V4.1's window rows against the note's §1 "Window" restated in numpy float64."""

from __future__ import annotations

import pytest
import torch
from v41_restate import fp8_pow2, report, rms_norm, rope

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.v41.window import window_index, window_keys, window_rows
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


@pytest.mark.parametrize(
    "splits", [[13], [1, 1, 5, 6], [7, 6], [9, 1, 1, 1]], ids=["whole", "decode-steps", "chunks", "full-window-decode"]
)
def test_window_keys_read_each_querys_window_however_the_index_is_built(splits):
    """`window_keys` against the window restated (rows p - 7 .. p of window 8, masked before position 0),
    call after call: built inside, and from `window_index` handed in (as the Triton backend's per-call
    tables), the same bits."""
    size, rows = 8, torch.randn(sum(splits), 16, generator=torch.Generator().manual_seed(3))
    kept, at = torch.zeros(0, 16), 0
    for n in splits:
        positions = torch.arange(at, at + n)
        (keys, mask), kept_after = window_keys(kept, rows[at : at + n], positions, size)
        first = at - kept.shape[0]
        given = window_keys(kept, rows[at : at + n], positions, size, window_index(positions, first, size))
        for j, p in enumerate(range(at, at + n)):
            want = [rows[max(q, 0)] for q in range(p - size + 1, p + 1)]
            assert torch.equal(keys[j], torch.stack(want))
            assert mask[j].tolist() == [q >= 0 for q in range(p - size + 1, p + 1)]
        assert torch.equal(given[0][0], keys) and torch.equal(given[0][1], mask) and torch.equal(given[1], kept_after)
        assert torch.equal(kept_after, rows[max(0, at + n - size + 1) : at + n])
        kept, at = kept_after, at + n
