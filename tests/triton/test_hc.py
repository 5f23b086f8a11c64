"""mHC pre (with Sinkhorn and the sublayer norm), post and head against the reference ops."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import hc_head, hc_post, hc_pre
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def f16_weight(rows, cols, device, seed) -> QWeight:
    values = rand(rows, cols, seed=seed, scale=cols**-0.5)
    return QWeight.from_bytes(torch.from_numpy(quantize(values, T.F16)), T.F16, (rows, cols), device)


@pytest.mark.parametrize("tokens,dim", [(1, 4096), (19, 64)])
def test_hc_pre_matches_reference(tokens, dim, device):
    h = rand(tokens, 4, dim, seed=1, scale=3.0).to(device)
    fn = f16_weight(24, 4 * dim, device, seed=2)
    scale, base = (0.2 + 0.3 * rand(3, seed=3).abs()).to(device), rand(24, seed=4, scale=0.5).to(device)
    norm = (1 + 0.1 * rand(dim, seed=5)).to(device)
    args = (h, fn, scale, base, norm, 20, 1e-6, 1e-6)
    for got, want in zip(hc_pre.hc_pre(*args), hc_pre.reference(*args), strict=True):
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


def test_hc_head_matches_reference(device):
    h = rand(3, 4, 256, seed=10, scale=2.0).to(device)
    fn = f16_weight(4, 4 * 256, device, seed=11)
    scale, base = torch.tensor([0.4]).to(device), rand(4, seed=12, scale=0.5).to(device)
    norm = (1 + 0.1 * rand(256, seed=13)).to(device)
    args = (h, fn, scale, base, norm, 1e-6, 1e-6)
    torch.testing.assert_close(hc_head.hc_head(*args), hc_head.reference(*args), rtol=2e-5, atol=2e-6)
