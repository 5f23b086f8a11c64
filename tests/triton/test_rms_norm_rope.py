"""RMSNorm + RoPE + QAT rounding rows against the reference ops."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import rms_norm_rope as nr
from dwarfstar.model.config import ModelArgs, yarn_inv_freq
from dwarfstar.model.numerics import rope_angles


def angles(positions, rope_dim, device, yarn=True):
    args = ModelArgs.flash().with_(rope_dim=rope_dim)
    inv = torch.tensor(yarn_inv_freq(args, args.layer(2 if yarn else 0)), dtype=torch.float64)
    return tuple(a.to(device) for a in rope_angles(torch.tensor(positions), inv))


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


@triton.jit
def _angles_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, D: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr):
    i = tl.arange(0, BN)
    cos, sin = nr.rope_cos_sin(tl.load(pos_ptr + i), inv_ptr, D, ROPE, False, D)
    at = i[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    tl.store(cos_ptr + at, cos)
    tl.store(sin_ptr + at, sin)


@pytest.mark.parametrize("yarn", [False, True])
def test_angles_from_positions_agree_with_the_float64_tables(yarn, device):
    """The kernels' own angles (float64 product, reduction by pi / 2, float64 series) against
    `rope_angles`: to the float32 rounding, at small positions and near a million."""
    args = ModelArgs.flash()
    inv = torch.tensor(yarn_inv_freq(args, args.layer(2 if yarn else 0)), dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    pos = torch.cat((torch.arange(40), torch.randint(0, 1 << 20, (80,), generator=gen), (1 << 20) - torch.arange(8)))
    d = 128  # 32 pairs before the rope dims: cos 1, sin 0
    cos, sin = (torch.empty(pos.numel(), d // 2, device=device) for _ in range(2))
    _angles_kernel[(1,)](pos.to(torch.int32).to(device), inv.to(device), cos, sin, D=d, ROPE=args.rope_dim, BN=128)
    want_cos, want_sin = rope_angles(pos, inv)
    got_cos, got_sin = cos.cpu(), sin.cpu()
    half = args.rope_dim // 2
    assert bool((got_cos[:, :-half] == 1).all()) and bool((got_sin[:, :-half] == 0).all())
    torch.testing.assert_close(got_cos[:, -half:], want_cos, rtol=0, atol=2**-24)
    torch.testing.assert_close(got_sin[:, -half:], want_sin, rtol=0, atol=2**-24)


@pytest.mark.parametrize("indexer,qat", [(True, True), (True, False), (False, True)])
def test_query_rows_of_a_decode_step(indexer, qat, device):
    """One launch: each sequence's query heads (plain norm, RoPE at its own position) and indexer query
    heads (RoPE, Hadamard, FP4), from strided projections, against the reference ops."""
    gen = torch.Generator().manual_seed(10)
    positions = [3, 1_000_003, 77]
    heads, index_heads = (4, 128), (16, 64)
    q = torch.randn(3, 4 * 128 + 8, generator=gen)[:, :512]
    index_q = torch.randn(3, 16 * 64 + 3, generator=gen)[:, 3:] if indexer else None
    args = ModelArgs.flash().with_(rope_dim=32)
    inv = torch.tensor(yarn_inv_freq(args, args.layer(2)), dtype=torch.float64)
    pos = torch.tensor(positions, dtype=torch.int32)
    common = (heads, index_heads, 32, 1e-6, qat)
    got = nr.query_rows(q.to(device), None if index_q is None else index_q.to(device), pos.to(device),
                        inv.to(device), *common)  # fmt: skip
    want = nr.reference_query_rows(q, index_q, pos, inv, *common)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-5)
    if not indexer:
        assert got[1] is None
    elif qat:  # on the e2m1 grid: a rare fp32 tie may flip one step
        assert (got[1].cpu() != want[1]).float().mean() < 0.005
    else:
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)
