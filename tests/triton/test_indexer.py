"""Indexer scores and selection against the reference indexer math, incl. fewer rows than top-k."""

from __future__ import annotations

import torch

from dwarfstar.backends.triton.kernels import indexer_scores as ix
from dwarfstar.backends.triton.kernels import topk


def test_scores_and_selection_across_a_chunk(device):
    gen = torch.Generator().manual_seed(0)
    t, heads, dim, capacity, p0 = 6, 16, 64, 48, 13  # queries at 13..18 see 3, 3, 4, 4, 4, 4 rows
    q = torch.randn(t, heads, dim, generator=gen).to(device)
    weights_wide = torch.randn(t, heads + 7, generator=gen).to(device)
    w = weights_wide[:, 3 : 3 + heads]  # a strided column slice, as the fused projection gives it
    rows = torch.randn(capacity, dim, generator=gen).to(device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    scores, valid = ix.indexer_scores(q, w, rows, pos, ratio=4)
    want = ix.reference(q, w, rows, p0, 4)
    assert valid.tolist() == [3, 3, 4, 4, 4, 4]
    visible = torch.isfinite(want)
    torch.testing.assert_close(scores[visible], want[visible], rtol=1e-5, atol=1e-5)
    chosen = topk.topk_indices(scores, valid, 3)
    for row, n, ref_row in zip(chosen.tolist(), valid.tolist(), want, strict=True):
        expect = set(range(n)) if n <= 3 else set(ref_row.topk(3).indices.tolist())
        assert set(row) == expect  # 3 rows -> all of them; 4 rows -> the 3 best


def test_no_visible_rows_yet(device):
    q = torch.randn(2, 16, 64).to(device)
    pos = torch.tensor([0], dtype=torch.int32, device=device)
    scores, valid = ix.indexer_scores(q, torch.randn(2, 16).to(device), torch.zeros(16, 64).to(device), pos, 4)
    assert valid.tolist() == [0, 0]
    assert topk.topk_indices(scores, valid, 4).tolist() == [[-1] * 4] * 2
