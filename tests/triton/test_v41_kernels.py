"""The kernels of V4.1's own steps (lagged mHC mix and collapse, the Engram gate, row attention, the
V4.1 roundings of `rms_norm_rope`) against the torch reference's V4.1 numerics."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.v41 import engram, mhc
from dwarfstar.backends.triton.kernels import engram_gate, hc_collapse, hc_mix, hc_post, row_attention, topk
from dwarfstar.backends.triton.kernels import rms_norm_rope as nr
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.numerics import FP4_BLOCK, rope_angles
from dwarfstar.model.synthetic_v41 import V41_TINY

EPS = 1e-20  # V4.1's norm eps


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def inv_freq(il: int) -> torch.Tensor:
    return torch.tensor(yarn_inv_freq(V41_TINY, V41_TINY.layer(il)), dtype=torch.float64)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("qat", "want"),
    [
        (nr.QAT_FP8_ROW, lambda y: ops.fp8_round(y, 32)),
        (nr.QAT_FP4_ROW, lambda y: ops.fp4_round(y, FP4_BLOCK)),
        (nr.QAT_FP4_E4M3, lambda y: ops.fp4_round(y, 16, e4m3_scale=True)),
    ],
    ids=["fp8-row-32", "fp4-32", "fp4-16-e4m3"],
)
def test_v41_roundings_after_norm_and_rope(qat, want, device):
    """The rows come out bit for bit as the reference's norm, RoPE, then its V4.1 rounding (tiny values
    in some rows reach the scales' floors)."""
    x = rand(6, 128, seed=1, scale=3.0)
    x[2] *= 1e-6
    w = 1 + 0.1 * rand(128, seed=2)
    angles = rope_angles(torch.tensor([0, 3, 17, 64, 1000, 4097]), inv_freq(6))
    dev = [a.to(device) for a in angles]
    got = nr.rms_norm_rope(x.to(device), weight=w.to(device), eps=EPS, angles=tuple(dev), rope_dim=32, qat=qat)
    expected = want(ops.apply_rope(ops.rms_norm(x, w, EPS), *angles))
    assert torch.equal(got.cpu(), expected)


def f32_weight(rows: int, cols: int, device, seed: int) -> QWeight:
    values = rand(rows, cols, seed=seed, scale=cols**-0.5)
    return QWeight.from_bytes(torch.from_numpy(quantize(values, T.F32)), T.F32, (rows, cols), device)


def test_mix_and_collapse_match_the_lagged_reference(device):
    n, d, t = 4, 64, 5
    h = rand(t, n, d, seed=3, scale=2.0)
    fn = f32_weight((2 + n) * n, n * d, device, seed=4)
    scale, base = 0.2 + 0.3 * rand(3, seed=5).abs(), rand((2 + n) * n, seed=6, scale=0.5)
    config = mhc.HcConfig(20, 1e-6, EPS)
    want = mhc.mix(h, mhc.HcWeights(fn.dequantize().cpu(), scale, base), config)
    got = hc_mix.hc_mix(h.to(device), fn, scale.to(device), base.to(device), 20, 1e-6, EPS)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)
    norm = 1 + 0.1 * rand(d, seed=7)
    pre = want[0]
    x = hc_collapse.hc_collapse(h.to(device), pre.to(device), norm.to(device), EPS)
    torch.testing.assert_close(x.cpu(), ops.rms_norm(mhc.collapse(h, pre), norm, EPS), rtol=1e-5, atol=1e-6)


def test_collapse_refuses_pre_of_another_shape(device):
    with pytest.raises(ValueError, match="collapse"):
        hc_collapse.hc_collapse(torch.zeros(2, 4, 8, device=device), torch.zeros(2, 3, device=device),
                                torch.ones(8, device=device), EPS)  # fmt: skip


def test_engram_gate_matches_the_reference_engram(device):
    """The gate over the product of the reference's rounded rows equals the reference's whole Engram
    step (gates of both signs; one stream's dot is zero)."""
    t, n, d, c, de = 3, 4, 64, 6, 32
    h = rand(t, n, d, seed=8)
    rows = rand(t, c, de, seed=9)
    w_kv = rand((n + 1) * d, c * de, seed=10, scale=(c * de) ** -0.5)
    qn, kn = 1 + 0.2 * rand(n, d, seed=11), 1 + 0.2 * rand(n, d, seed=12)
    h[1, 2] = 0.0
    want = engram.engram(h, rows, w_kv, qn, kn, torch.zeros(t, dtype=torch.bool), EPS)
    kv = ops.linear(ops.fp8_round(rows.to(torch.bfloat16).float().reshape(t, -1), 32), w_kv)
    got = engram_gate.engram_gate(h.to(device), kv.to(device), (qn * kn).to(device), EPS)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("two_parts", "rotate_q", "d"), [(False, False, 128), (True, False, 128), (True, True, 128), (True, True, 48)]
)
def test_row_attention_matches_attention_rows(two_parts, rotate_q, d, device):
    """`rotate_q`: the kernel rotates the query itself (angles formed in the kernel), against the
    reference over the query rotated by `rope_angles`' tables; at d 48 the rope dims straddle the
    kernel's two halves of the row."""
    t, heads = 3, 4
    q = rand(t, heads, d, seed=13)
    window = rand(t, 8, d, seed=14)
    window_mask = torch.ones(t, 8, dtype=torch.bool)
    window_mask[0, :5] = False  # the sequence's first positions: nothing before them
    window[0, :5] = float("nan")  # masked keys are never read
    parts = [(window, window_mask)]
    if two_parts:
        picks = torch.tensor([[0, 2, -1, -1], [1, 2, 3, -1], [0, 1, 2, 3]])
        rows = rand(4, d, seed=15)
        parts.append((rows[picks.clamp(min=0)], picks >= 0))
    sinks, positions = rand(heads, seed=16), torch.tensor([5, 6, 7])
    inv = inv_freq(6)
    rotated = ops.apply_rope(q, *rope_angles(positions, inv)) if rotate_q else q
    want = row_attention.reference(rotated, [(k.nan_to_num(0.0), m) for k, m in parts], sinks, inv, positions)
    got = row_attention.row_attention(q.to(device), [(k.to(device), m.to(device)) for k, m in parts],
                                      sinks.to(device), inv.to(device), 32, positions.to(device),
                                      rotate_q=rotate_q)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_selection_on_the_top_k_kernel_is_the_references(device):
    """V4.1's candidate blocks and top-k with the k-best step on the radix kernel (`best_rows`) pick
    what the reference's stable sort picks: ties (scores drawn from 6 values), -inf rows a query
    cannot see, a candidate mask that leaves a reindex query fewer than K rows, and forced blocks."""
    from dwarfstar.backends.reference.v41 import select
    from dwarfstar.backends.triton.v41.ops import best_rows

    gen = torch.Generator().manual_seed(3)
    t, n, ratio = 5, 300, 2
    positions = torch.tensor([20, 150, 333, 598, 599])
    scores = torch.randint(0, 6, (t, n), generator=gen).float()
    scores = scores.masked_fill(
        torch.arange(n)[None, :] >= select.visible_rows(positions, ratio)[:, None], select.NEG_INF
    )
    on = scores.to(device)
    want = select.candidate_mask(scores, positions, ratio, block=8, n_keep=5)
    got = select.candidate_mask(on, positions.to(device), ratio, 8, 5, best_rows)
    assert torch.equal(got.cpu(), want) and want.any(1).all() and not want.all()
    for candidates in (None, want):
        expect = select.top_k(scores, positions, ratio, end=600, topk=64, candidates=candidates)
        chosen = None if candidates is None else got
        picked = select.top_k(on, positions.to(device), ratio, 600, 64, chosen, best_rows)
        assert torch.equal(picked.cpu(), expect)
        # the kept picks ordered by the kernel, as the Triton backend runs it
        picked = select.top_k(on, positions.to(device), ratio, 600, 64, chosen, best_rows, topk.valid_first)
        assert torch.equal(picked.cpu(), expect) and picked.dtype == expect.dtype
        assert (expect == -1).any()  # the first query sees 10 rows, fewer than K = 64


@pytest.mark.parametrize("k", [1, 37, 64])
def test_valid_first_kernel_is_the_references(k, device):
    """`topk.valid_first` against `select.valid_first`: picks in any order (as a k-best step may give
    them), some past what their query sees, some scoring -inf, a K that is no power of two."""
    from dwarfstar.backends.reference.v41 import select

    gen = torch.Generator().manual_seed(k)
    t, n, ratio = 4, 150, 2
    positions = torch.tensor([3, 60, 200, 299])  # sees 2, 30, 100 and 150 rows
    scores = torch.randn(t, n, generator=gen).masked_fill(torch.rand(t, n, generator=gen) < 0.2, select.NEG_INF)
    picks = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    want = select.valid_first(scores, picks, positions, ratio)
    got = topk.valid_first(scores.to(device), picks.to(device), positions.to(device), ratio)
    assert torch.equal(got.cpu(), want) and (want == -1).any()


@pytest.mark.parametrize(("tokens", "post"), [(1, True), (1, False), (3, True), (3, False)])
@pytest.mark.parametrize("dims", [None, 16])
def test_post_mix_in_one_launch_matches_its_steps(tokens, post, dims, device):
    """`hc_post_mix` (the one launch of a decode step) against the post, the mix and the collapse as the
    reference runs them: the streams updated in place, the mixes and the normed input within the
    kernels' bounds; with several programs per token (dims 16) and with several tokens (one per
    sequence of a batch), with and without the post (an MoE's [T, P, D] parts for it)."""
    n, d = 4, 64
    h = rand(tokens, n, d, seed=20, scale=2.0)
    fn = f32_weight((2 + n) * n, n * d, device, seed=21)
    scale, base = 0.2 + 0.3 * rand(3, seed=22).abs(), rand((2 + n) * n, seed=23, scale=0.5)
    pre = torch.softmax(rand(tokens, n, seed=24), dim=-1)
    norm = 1 + 0.1 * rand(d, seed=25)
    after = None
    if post:
        comb = torch.softmax(rand(tokens, n, n, seed=26), dim=-1)
        after = (rand(tokens, 3, d, seed=27), 2 * torch.sigmoid(rand(tokens, n, seed=28)), comb)
    const = (scale, base, pre, norm, 20, 1e-6, EPS)
    want_h, want_mixes, want_x = hc_mix.reference_post_mix(h, after, fn, *const)
    on = tuple(t.to(device) for t in const[:4])
    got_h = h.to(device, copy=True)  # updated in place
    moved = None if after is None else tuple(t.to(device) for t in after)
    mixes, x = hc_mix.hc_post_mix(got_h, moved, fn, *on, 20, 1e-6, EPS, dims=dims)
    torch.testing.assert_close(got_h.cpu(), want_h, rtol=1e-6, atol=1e-6)
    for g, w in zip(mixes, want_mixes, strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.cpu(), want_x, rtol=1e-5, atol=1e-6)
    # and as today's Triton steps (`hc_post`, `hc_mix`, `hc_collapse`) compute them
    steps_h = h.to(device, copy=True)
    if moved is not None:
        hc_post.hc_post(steps_h, *moved)
    steps = hc_mix.hc_mix(steps_h, fn, *on[:2], 20, 1e-6, EPS)
    torch.testing.assert_close(got_h, steps_h, rtol=0, atol=0)
    for g, w in zip(mixes, steps, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, hc_collapse.hc_collapse(steps_h, on[2], on[3], EPS), rtol=1e-5, atol=1e-6)


def test_post_mix_refuses_pre_of_another_shape(device):
    fn = f32_weight(24, 4 * 8, device, seed=29)
    with pytest.raises(ValueError, match="collapse"):
        hc_mix.hc_post_mix(torch.zeros(2, 4, 8, device=device), None, fn, torch.ones(3, device=device),
                           torch.zeros(24, device=device), torch.zeros(2, 3, device=device),
                           torch.ones(8, device=device), 20, 1e-6, EPS)  # fmt: skip
