"""mHC pre (with Sinkhorn and the sublayer norm), post, head and their one-launch fused forms
against the reference ops."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import hc_head, hc_post, hc_pre
from dwarfstar.backends.triton.runtime import ticket_counters
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize

ITERS, EPS = 20, 1e-6


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def f16_weight(rows, cols, device, seed) -> QWeight:
    values = rand(rows, cols, seed=seed, scale=cols**-0.5)
    return QWeight.from_bytes(torch.from_numpy(quantize(values, T.F16)), T.F16, (rows, cols), device)


def pre_mix(dim, device):
    """A sublayer's (fn, scale, base, norm, iters, hc_eps, norm_eps)."""
    fn = f16_weight(24, 4 * dim, device, seed=2)
    scale, base = (0.2 + 0.3 * rand(3, seed=3).abs()).to(device), rand(24, seed=4, scale=0.5).to(device)
    norm = (1 + 0.1 * rand(dim, seed=5)).to(device)
    return fn, scale, base, norm, ITERS, EPS, EPS


def head_mix(dim, device):
    fn = f16_weight(4, 4 * dim, device, seed=11)
    scale, base = torch.tensor([0.4]).to(device), rand(4, seed=12, scale=0.5).to(device)
    return fn, scale, base, (1 + 0.1 * rand(dim, seed=13)).to(device), EPS, EPS


def finished_sublayer(tokens, dim, parts, device):
    """Streams, a sublayer output ([T, D], or [T, P, D] parts) and the post and comb of its pre-mix."""
    h = rand(tokens, 4, dim, seed=1, scale=3.0).to(device)
    out = rand(tokens, *((parts,) if parts else ()), dim, seed=7).to(device)
    post = rand(tokens, 4, seed=8).sigmoid().to(device) * 2
    comb = rand(tokens, 4, 4, seed=9).softmax(-1).to(device)
    return h, out, post, comb


def assert_counters_clear(device):
    assert not ticket_counters(device, "hc", 1).any()


# one launch (decode: the programs' partial mixes added by the last) and the prefill form (GEMV + one kernel)
@pytest.mark.parametrize("tokens,dim,fused", [(1, 4096, True), (19, 64, True), (1, 4096, False), (19, 64, False)])
def test_hc_pre_matches_reference(tokens, dim, fused, device):
    h = rand(tokens, 4, dim, seed=1, scale=3.0).to(device)
    args = (h, *pre_mix(dim, device))
    for got, want in zip(hc_pre.hc_pre(*args, fused=fused), hc_pre.reference(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("parts", [1, 3])
def test_hc_post_sums_parts_and_mixes_columns(parts, device):
    h = rand(5, 4, 96, seed=6).to(device)
    out = rand(5, parts, 96, seed=7).to(device)
    post = rand(5, 4, seed=8).sigmoid().to(device) * 2
    comb = rand(5, 4, 4, seed=9).softmax(-1).to(device)
    want = hc_post.reference(h.clone(), out, post, comb)
    got = hc_post.hc_post(h, out, post, comb)
    assert got.data_ptr() == h.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# (tokens, dims per program, tokens per program, output parts; 0: a [T, D] output): 96 dims give
# 1 to 6 programs per token, the last of them partial
@pytest.mark.parametrize(
    "tokens,dims,block,parts", [(1, 16, 1, 0), (2, 32, 1, 3), (3, 64, 2, 1), (4, None, None, 2), (4, 32, 4, 0)]
)
def test_post_fused_with_the_next_pre(tokens, dims, block, parts, device):
    h, out, post, comb = finished_sublayer(tokens, 96, parts, device)
    mix = pre_mix(96, device)
    want_h, *want = hc_pre.reference_post_pre(h.clone(), out, post, comb, *mix)
    runs = []
    for _ in range(2):  # the counters are back at 0 after a launch: a second one gives the same bits
        streams = h.clone()
        got = hc_pre.hc_post_pre(streams, out, post, comb, *mix, dims=dims, tokens=block)
        assert_counters_clear(device)
        runs.append((streams, *got))
    torch.testing.assert_close(runs[0][0], want_h, rtol=1e-6, atol=1e-6)  # in place
    for got, expected in zip(runs[0][1:], want, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_hc_pre_in_one_launch_over_several_programs(device):
    h = rand(3, 4, 80, seed=1, scale=3.0).to(device)
    args = (h, *pre_mix(80, device))
    for got, want in zip(hc_pre.hc_pre(*args, fused=True, dims=16, tokens=2), hc_pre.reference(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert torch.equal(h, rand(3, 4, 80, seed=1, scale=3.0).to(device))  # the streams stay as they were
    assert_counters_clear(device)


@pytest.mark.parametrize("fused,dims,block", [(True, 64, 2), (True, None, None), (False, None, None)])
def test_hc_head_matches_reference(fused, dims, block, device):
    h = rand(3, 4, 256, seed=10, scale=2.0).to(device)
    args = (h, *head_mix(256, device))
    got = hc_head.hc_head(*args, fused=fused, dims=dims, tokens=block)
    torch.testing.assert_close(got, hc_head.reference(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tokens,dims,block,parts", [(1, 32, 1, 3), (3, 64, 2, 0)])
def test_post_fused_with_the_head(tokens, dims, block, parts, device):
    h, out, post, comb = finished_sublayer(tokens, 96, parts, device)
    mix = head_mix(96, device)
    want_h = hc_post.reference(h.clone(), out, post, comb)
    got = hc_head.hc_post_head(h, out, post, comb, *mix, dims=dims, tokens=block)
    torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, hc_head.reference(want_h, *mix), rtol=2e-5, atol=2e-6)
    assert_counters_clear(device)


def test_collapse_in_blocks_shorter_than_the_row(monkeypatch, device):
    """Rows longer than the collapse's block (PRO's 7168 at 4096): the sum goes out block by block and
    is scaled in a second pass; the same values as the whole row kept in registers (Flash's 4096)."""
    h, out, post, comb = finished_sublayer(2, 96, 0, device)
    pre, head = pre_mix(96, device), head_mix(96, device)
    whole = hc_pre.hc_post_pre(h.clone(), out, post, comb, *pre, dims=32, tokens=1)
    whole_head = hc_head.hc_post_head(h.clone(), out, post, comb, *head, dims=32, tokens=1)
    monkeypatch.setattr(hc_pre, "collapse_block", lambda d: 32)  # 3 blocks of the 96 dims
    blocks = hc_pre.hc_post_pre(h.clone(), out, post, comb, *pre, dims=32, tokens=1)
    blocks_head = hc_head.hc_post_head(h.clone(), out, post, comb, *head, dims=32, tokens=1)
    want_h, *want = hc_pre.reference_post_pre(h.clone(), out, post, comb, *pre)
    for got, expected, other in zip(blocks, want, whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(got, other, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(blocks_head, hc_head.reference(want_h, *head), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(blocks_head, whole_head, rtol=1e-6, atol=1e-7)
    assert_counters_clear(device)


def test_fused_mix_must_be_a_float_matrix(device):
    h = rand(1, 4, 64, seed=1).to(device)
    fn, *rest = pre_mix(64, device)
    q8 = QWeight.from_bytes(torch.from_numpy(quantize(fn.dequantize().cpu(), T.Q8_0)), T.Q8_0, (24, 256), device)
    with pytest.raises(ValueError, match="F32, F16 or BF16"):
        hc_pre.hc_pre(h, q8, *rest, fused=True)
