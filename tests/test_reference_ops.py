"""Reference primitives against independent formulations: brute-force rounding grids, explicit matrices."""

from __future__ import annotations

import math

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.model.numerics import rope_angles

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = torch.unique(E4M3_VALUES[torch.isfinite(E4M3_VALUES)])


def nearest_even_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Brute force: the nearest finite e4m3fn value; on a tie, the one with an even mantissa code."""
    dist = (x[:, None] - E4M3_GRID[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    candidates = dist == best
    codes = torch.tensor([int(v.to(torch.float8_e4m3fn).view(torch.uint8)) for v in E4M3_GRID])
    even = (codes % 2 == 0)[None, :]
    pick = torch.where(candidates.sum(1, keepdim=True) > 1, candidates & even, candidates)
    return E4M3_GRID[pick.float().argmax(1)]


def test_fp8_round_matches_brute_force_e4m3():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-6, 3, 8)[:, None]
    got = ops.fp8_round(x)
    for row, out in zip(x, got, strict=True):
        amax = max(row.abs().max().item(), 1e-4)
        scale = 2.0 ** math.ceil(math.log2(amax / 448))
        expect = nearest_even_e4m3((row / scale).clamp(-448, 448)) * scale
        assert torch.equal(out, expect)


def test_fp8_scale_is_a_power_of_two_even_at_exact_powers():
    x = torch.zeros(64)
    x[0] = 448.0 * 4  # amax / 448 is exactly 4: the scale must stay 4, not 8
    x[1] = 3.0
    assert ops.fp8_round(x)[0] == 1792.0
    assert ops.fp8_round(x)[1] == 3.0  # 3 / 4 = 0.75 is exact in e4m3


def test_fp8_round_nope_leaves_rope_dims_and_handles_partial_blocks():
    torch.manual_seed(1)
    x = torch.randn(3, 96 + 32)  # tiny model: 96 nope dims = one full block of 64 and a partial one of 32
    y = ops.fp8_round_nope(x, rope_dim=32)
    assert torch.equal(y[:, 96:], x[:, 96:])
    assert torch.equal(y[:, 64:96], ops.fp8_round(x[:, 64:96]))  # the partial block is scaled on its own
    assert torch.equal(y[:, :64], ops.fp8_round(x[:, :64]))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (0.3, 0.5), (5.1, 6.0)],
)
def test_fp4_ties_go_to_the_even_code(value, expected):
    x = torch.zeros(32)
    x[0], x[1], x[2] = 6.0, value, -value  # amax 6 makes the scale exactly 1
    y = ops.fp4_round(x)
    assert y[1] == expected and y[2] == -expected


def test_fp4_scale_is_per_block_of_32():
    x = torch.cat((torch.full((32,), 0.1), torch.full((32,), 100.0)))
    y = ops.fp4_round(x)
    assert torch.allclose(y[:32], torch.full((32,), 0.1), rtol=0.25)  # small block keeps its own scale
    assert torch.all(y[32:] == 96.0)  # 100 / 16 = 6.25 clamps to 6, times scale 16


def test_hadamard_is_orthonormal_sylvester():
    x = torch.eye(4)
    h = ops.hadamard(x)
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2.0
    assert torch.equal(h, expected)
    v = torch.randn(5, 128)
    assert torch.allclose(ops.hadamard(ops.hadamard(v)), v, atol=1e-5)


def test_rope_matches_complex_rotation_and_inverts():
    torch.manual_seed(2)
    x = torch.randn(6, 3, 40)  # [T, heads, dim]: 24 nope + 16 rope dims
    pos = torch.arange(100, 106)
    inv_freq = torch.tensor([10000 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)
    cos, sin = rope_angles(pos, inv_freq)
    y = ops.apply_rope(x, cos, sin)
    pairs = torch.view_as_complex(x[..., 24:].reshape(6, 3, 8, 2).contiguous())
    rot = torch.polar(torch.ones(6, 8, dtype=torch.float64), pos[:, None].double() * inv_freq).to(torch.complex64)
    expected = torch.view_as_real(pairs * rot[:, None, :]).flatten(-2)
    assert torch.equal(y[..., :24], x[..., :24])
    assert torch.allclose(y[..., 24:], expected, atol=1e-5)
    assert torch.allclose(ops.apply_rope(y, cos, sin, inverse=True), x, atol=1e-5)


def test_sinkhorn_is_nearly_doubly_stochastic():
    torch.manual_seed(3)
    comb = ops.sinkhorn(torch.randn(10, 4, 4), iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(10, 4), atol=1e-5)  # the last step normalises columns
    assert torch.allclose(comb.sum(-1), torch.ones(10, 4), atol=2e-2)
    assert torch.all(comb > 0)


def test_hc_post_takes_columns_of_the_combination():
    h = torch.tensor([[[1.0], [10.0]]])  # one token, two streams of dim 1
    comb = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])  # comb[j=0, k=1] = 1: stream 1 receives stream 0
    out = ops.hc_post(torch.zeros(1, 1), h, torch.zeros(1, 2), comb)
    assert out.flatten().tolist() == [0.0, 1.0]


def test_sink_only_enlarges_the_denominator():
    q = torch.zeros(1, 2, 4)  # zero query: uniform scores over the rows
    kv = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    sinks = torch.tensor([-1e9, 0.0])  # head 0: no sink; head 1: a sink worth one row
    out = ops.sink_attention(q, kv, mask, sinks)
    assert torch.allclose(out[0, 0], torch.tensor([0.5, 0.5, 0, 0]))
    assert torch.allclose(out[0, 1], torch.tensor([1 / 3, 1 / 3, 0, 0]))


def test_swiglu_clamps_gate_above_only_and_up_both_ways():
    gate = torch.tensor([-20.0, 20.0])
    up = torch.tensor([-20.0, 20.0])
    out = ops.swiglu_clamped(gate, up, 10.0)
    assert torch.allclose(out, torch.nn.functional.silu(torch.tensor([-20.0, 10.0])) * torch.tensor([-10.0, 10.0]))
