"""Compressor pooling and frontier updates, chunk after chunk, against the reference compressor."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import compressor as comp
from dwarfstar.model.state import CompressorSpec


@pytest.mark.parametrize(
    "ratio,dim,chunks",
    [
        (4, 64, [3, 1, 6, 1, 1, 9, 4, 1]),  # windows completed mid-chunk, by single tokens, and exactly
        (128, 32, [100, 27, 1, 130, 1, 3]),  # the 128th token alone, then a chunk crossing the next boundary
    ],
)
def test_chunks_match_reference(ratio, dim, chunks, device):
    width = dim * (2 if ratio == 4 else 1)
    gen = torch.Generator().manual_seed(ratio)
    total = sum(chunks)
    u = torch.randn(total, width, generator=gen).to(device)
    g = (2 * torch.randn(total, width, generator=gen)).to(device)
    ape = (0.5 * torch.randn(ratio, width, generator=gen)).to(device)
    norm = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device)
    spec = CompressorSpec("attn", ratio, dim)
    mine = (
        torch.zeros(spec.frontier_shape, device=device),
        torch.full(spec.frontier_shape, float("-inf"), device=device),
    )
    ref = tuple(t.clone() for t in mine)
    p0 = 0
    emitted_total = 0
    for t in chunks:
        # u and g as column slices of one wider buffer, as the fused projection delivers them
        both = torch.cat((u[p0 : p0 + t], g[p0 : p0 + t]), dim=1)
        n = comp.emitted(p0, t, ratio)
        pos = torch.tensor([p0], dtype=torch.int32, device=device)
        pooled = comp.compress_chunk(
            both[:, :width], both[:, width:], ape, *mine, pos, n, ratio
        )  # the kernel updates the frontier in place
        want, *ref = comp.reference(u[p0 : p0 + t], g[p0 : p0 + t], ape, norm, spec, ref, p0, 1e-6)
        assert want.shape[0] == n
        torch.testing.assert_close(ops.rms_norm(pooled, norm, 1e-6), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine[0], ref[0], rtol=0, atol=0)
        torch.testing.assert_close(mine[1], ref[1], rtol=0, atol=0)
        p0 += t
        emitted_total += n
    assert emitted_total == total // ratio >= 2
