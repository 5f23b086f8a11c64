"""MLX primitives against the torch reference ops: the roundings bit for bit, the rest to fp32 noise."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.reference import ops as ref
from dwarfstar.model.numerics import rope_angles


def to_mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.numpy())


def to_torch(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def values(n: int, seed: int) -> torch.Tensor:
    """Random values over many binades, plus the exact ties and tiny values the roundings must handle."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 10, (n,), generator=gen).float())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.0, -0.0, 1e-30, 2.0**-9 * 1.5])
    return torch.cat((ties, x))


@pytest.mark.parametrize("width", [64, 448, 100])  # 100: a trailing partial block (tiny models have them)
def test_fp8_round_is_bit_exact(width):
    x = values(width * 300 - 13, seed=width).view(-1)[: width * 300 - 13]
    x = torch.nn.functional.pad(x, (0, 13)).view(300, width)
    assert torch.equal(to_torch(ops.fp8_round(to_mx(x))), ref.fp8_round(x))


@pytest.mark.parametrize("width", [128, 32, 48])
def test_fp4_and_indexer_round_are_bit_exact(width):
    x = values(width * 200, seed=width)[: width * 200].view(200, width)
    assert torch.equal(to_torch(ops.fp4_round(to_mx(x))), ref.fp4_round(x))
    if width & (width - 1) == 0:
        # the Hadamard product sums in another order than torch; compare the rounding given the same input
        h = ref.hadamard(x)
        assert torch.allclose(to_torch(ops.hadamard(to_mx(x))), h, rtol=1e-5, atol=1e-5 * h.abs().max().item())
        assert torch.equal(to_torch(ops.fp4_round(to_mx(h))), ref.fp4_round(h))


def test_rope_matches_reference_and_inverts():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 128, generator=gen)
    positions = torch.tensor([0, 1, 70_000, 500_000, 1_048_575])
    inv_freq = torch.tensor([10000.0 ** (-2 * i / 32) for i in range(16)], dtype=torch.float64)
    cos, sin = rope_angles(positions, inv_freq)
    mcos, msin = ops.rope_tables(positions.numpy(), inv_freq.numpy())
    assert torch.equal(to_torch(mcos), cos) and torch.equal(to_torch(msin), sin)
    rotated = ops.apply_rope(to_mx(x), mcos, msin)
    assert torch.allclose(to_torch(rotated), ref.apply_rope(x, cos, sin), atol=1e-6)
    assert torch.allclose(to_torch(ops.apply_rope(rotated, mcos, msin, inverse=True)), x, atol=1e-5)


def test_hyper_connections_match_reference():
    gen = torch.Generator().manual_seed(2)
    T, n, D = 6, 4, 32
    h = torch.randn(T, n, D, generator=gen)
    fn, scale, base = (
        torch.randn(24, n * D, generator=gen) / 8,
        torch.rand(3, generator=gen),
        torch.randn(24, generator=gen),
    )
    want = ref.hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6)
    got = ops.hc_pre(to_mx(h), to_mx(fn), to_mx(scale), to_mx(base), 20, 1e-6, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(to_torch(g), w, rtol=1e-5, atol=1e-6)
    out = torch.randn(T, D, generator=gen)
    post, comb = want[1], want[2]
    assert torch.allclose(
        to_torch(ops.hc_post(to_mx(out), to_mx(h), to_mx(post), to_mx(comb))),
        ref.hc_post(out, h, post, comb),
        atol=1e-5,
    )
    fh, sh, bh = torch.randn(n, n * D, generator=gen) / 8, torch.rand(1, generator=gen), torch.randn(n, generator=gen)
    want_head = ref.hc_head(h, fh, sh, bh, 1e-6, 1e-6)
    assert torch.allclose(
        to_torch(ops.hc_head(to_mx(h), to_mx(fh), to_mx(sh), to_mx(bh), 1e-6, 1e-6)), want_head, atol=1e-5
    )


def test_sink_attention_and_swiglu_match_reference():
    gen = torch.Generator().manual_seed(3)
    q, kv = torch.randn(5, 4, 128, generator=gen), torch.randn(12, 128, generator=gen)
    mask = torch.rand(5, 12, generator=gen) > 0.4
    mask[:, 0] = True
    sinks = torch.randn(4, generator=gen)
    want = ref.sink_attention(q, kv, mask, sinks)
    got = to_torch(ops.sink_attention(to_mx(q), to_mx(kv), to_mx(mask), to_mx(sinks)))
    assert torch.allclose(got, want, atol=2e-6)
    g, u = torch.randn(50, generator=gen) * 8, torch.randn(50, generator=gen) * 8
    assert torch.allclose(
        to_torch(ops.swiglu_clamped(to_mx(g), to_mx(u), 10.0)), ref.swiglu_clamped(g, u, 10.0), atol=1e-5
    )


def test_sink_attention_over_per_query_keys_matches_reference():
    """The sparse path: each query its own gathered rows [T, N, D], against the reference row by row."""
    gen = torch.Generator().manual_seed(4)
    q, kv = torch.randn(5, 4, 128, generator=gen), torch.randn(5, 12, 128, generator=gen)
    mask = torch.rand(5, 12, generator=gen) > 0.4
    mask[:, 0] = True
    sinks = torch.randn(4, generator=gen)
    want = torch.cat([ref.sink_attention(q[t : t + 1], kv[t], mask[t : t + 1], sinks) for t in range(5)])
    got = to_torch(ops.sink_attention(to_mx(q), to_mx(kv), to_mx(mask), to_mx(sinks)))
    assert torch.allclose(got, want, atol=2e-6)
    unmasked = torch.cat(
        [ref.sink_attention(q[t : t + 1], kv[t], torch.ones(1, 12, dtype=torch.bool), sinks) for t in range(5)]
    )
    assert torch.allclose(to_torch(ops.sink_attention(to_mx(q), to_mx(kv), None, to_mx(sinks))), unmasked, atol=2e-6)
