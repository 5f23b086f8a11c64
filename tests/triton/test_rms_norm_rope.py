"""RMSNorm + RoPE + QAT rounding rows against the reference ops."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import rms_norm_rope as nr
from dwarfstar.model.config import ModelArgs, yarn_inv_freq


def angles(positions, rope_dim, device, yarn=True):
    args = ModelArgs.flash().with_(rope_dim=rope_dim)
    inv = torch.tensor(yarn_inv_freq(args, args.layer(2 if yarn else 0)), dtype=torch.float64)
    return tuple(a.to(device) for a in ops.rope_angles(torch.tensor(positions), inv))


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_plain_rms_norm_of_wide_rows(device):
    x, w = rand(3, 1024, seed=1).to(device), (1 + 0.1 * rand(1024, seed=2)).to(device)
    got = nr.rms_norm_rope(x, weight=w)
    torch.testing.assert_close(got, nr.reference(x, weight=w), rtol=1e-6, atol=1e-6)


def test_head_norm_and_rope_at_large_positions(device):
    """Unweighted per-head norm + YaRN rope; positions near 1M need the float64 angles."""
    x = rand(3, 4, 128, seed=3).to(device)
    cs = angles([0, 77, 1_000_003], 32, device)
    got = nr.rms_norm_rope(x, norm=nr.NORM_PLAIN, angles=cs, rope_dim=32)
    want = nr.reference(x, norm=nr.NORM_PLAIN, angles=cs, rope_dim=32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_inverse_rope_undoes_rope_on_strided_heads(device):
    wide = rand(2, 3 * 128 + 40, seed=4).to(device)
    x = wide[:, : 3 * 128].view(2, 3, 128)  # row stride 424, not 384
    cs = angles([5, 9000], 32, device)
    rotated = nr.rms_norm_rope(x, norm=nr.NORM_NONE, angles=cs, rope_dim=32)
    back = nr.rms_norm_rope(rotated, norm=nr.NORM_NONE, angles=cs, inverse=True, rope_dim=32)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated, nr.reference(x, norm=nr.NORM_NONE, angles=cs, rope_dim=32))


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (128, 32)])
def test_kv_row_fp8_rounding_bit_exact(head_dim, rope_dim, device):
    """Flash rows (7 full FP8 blocks) and tiny rows (nope 96: a partial block of 32)."""
    x = rand(6, head_dim, seed=5, scale=3.0)
    x[0, :64] *= 1e-6  # a block that underflows into e4m3 subnormals
    x[1, 10] = 0.0
    x = x.to(device)
    w = (1 + 0.1 * rand(head_dim, seed=6)).to(device)
    cs = angles(list(range(6)), rope_dim, device, yarn=False)
    kw = dict(weight=w, angles=cs, qat=nr.QAT_FP8, rope_dim=rope_dim)
    got, want = nr.rms_norm_rope(x, **kw), nr.reference(x, **kw)
    nope = head_dim - rope_dim
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    # the nope dims land on the e4m3 grid: identical except where fp32 noise straddles a rounding boundary
    assert (got[:, :nope] != want[:, :nope]).float().mean() < 0.01


def test_e4m3_grid_exact_at_every_tie():
    """Values at and around every e4m3 tie, subnormals included: bit-exact against torch's conversion."""
    v = torch.linspace(-448, 448, 63 * 320)
    v[:6] = torch.tensor([0.0, 2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-7, 464.0 - 1e-3])
    x = torch.cat((v.view(-1, 63), torch.full((320, 1), 448.0)), dim=1)  # amax 448 in every block
    got = nr.rms_norm_rope(x, norm=nr.NORM_NONE, qat=nr.QAT_FP8, rope_dim=0)
    assert torch.equal(got, ops.fp8_round(x))
    assert len(got[:, :63].unique()) > 150  # many grid points and ties were really exercised


def test_indexer_hadamard_fp4(device):
    x = rand(5, 16, 64, seed=7).to(device)
    cs = angles(list(range(100, 105)), 32, device)
    kw = dict(norm=nr.NORM_NONE, angles=cs, qat=nr.QAT_FP4, rope_dim=32)
    got, want = nr.rms_norm_rope(x, **kw), nr.reference(x, **kw)
    # values sit on the e2m1 grid times a power of two; a rare fp32 tie flip moves one grid step
    assert (got != want).float().mean() < 0.005
    w = (1 + 0.1 * rand(64, seed=8)).to(device)
    kw = dict(weight=w, angles=cs, qat=nr.QAT_FP4, rope_dim=32)
    assert (nr.rms_norm_rope(x, **kw) != nr.reference(x, **kw)).float().mean() < 0.005
