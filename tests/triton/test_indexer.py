"""Indexer scores and selection against the reference indexer math, incl. fewer rows than top-k."""

from __future__ import annotations

import torch

from dwarfstar.backends.triton.kernels import indexer_scores as ix
from dwarfstar.backends.triton.kernels import topk
from dwarfstar.backends.triton.runtime import PagedRows


def test_scores_and_selection_across_a_chunk(device):
    gen = torch.Generator().manual_seed(0)
    t, heads, dim, capacity, p0 = 6, 16, 64, 48, 13  # queries at 13..18 see 3, 3, 4, 4, 4, 4 rows
    q = torch.randn(t, heads, dim, generator=gen).to(device)
    weights_wide = torch.randn(t, heads + 7, generator=gen).to(device)
    w = weights_wide[:, 3 : 3 + heads]  # a strided column slice, as the fused projection gives it
    rows = torch.randn(capacity, dim, generator=gen).to(device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    scores, valid = ix.indexer_scores(q, w, PagedRows.scattered(rows), capacity, pos, ratio=4)
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
    rows = PagedRows.scattered(torch.zeros(16, 64).to(device))
    scores, valid = ix.indexer_scores(q, torch.randn(2, 16).to(device), rows, 16, pos, 4)
    assert valid.tolist() == [0, 0]
    assert topk.topk_indices(scores, valid, 4).tolist() == [[-1] * 4] * 2


def test_a_batch_of_sequences_in_cache_slots_scores_each_alone(device):
    """One launch scores one decode query for each of three sequences, each at its own position in
    its own slot of a cache block, the row bound past every sequence's visible rows."""
    gen = torch.Generator().manual_seed(1)
    heads, dim, capacity, bound = 16, 64, 32, 16
    positions, slots = [2, 27, 40], [1, 3, 0]  # no row yet; 7 rows; 10 rows
    q = torch.randn(3, heads, dim, generator=gen)
    w = torch.randn(3, heads, generator=gen)
    block = torch.randn(4, capacity, dim, generator=gen)
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    paged = PagedRows.scattered(block.to(device))
    scores, valid = ix.indexer_scores_batch(q.to(device), w.to(device), paged, pos, slot, bound, ratio=4)
    assert scores.shape == (3, bound) and valid.tolist() == [0, 7, 10]
    for b, (p, s) in enumerate(zip(positions, slots, strict=True)):
        want = ix.reference(q[b : b + 1], w[b : b + 1], block[s, :bound], p, 4)
        visible = torch.isfinite(want)
        torch.testing.assert_close(scores[b : b + 1].cpu()[visible], want[visible], rtol=1e-5, atol=1e-5)


def test_rows_across_pages_in_any_order(device):
    """Queries at 700..702 see 175 rows spanning three pages of the pool, laid out in a shuffled
    order: each block of rows is read from the page its table names."""
    gen = torch.Generator().manual_seed(2)
    t, heads, dim, p0, bound = 3, 16, 64, 700, 256
    q = torch.randn(t, heads, dim, generator=gen).to(device)
    w = torch.randn(t, heads, generator=gen).to(device)
    rows = torch.randn(190, dim, generator=gen).to(device)
    paged = PagedRows.scattered(rows, seed=4)
    assert paged.table.tolist() != sorted(paged.table.tolist())
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    scores, valid = ix.indexer_scores(q, w, paged, bound, pos, ratio=4)
    assert valid.tolist() == [175, 175, 175]
    want = ix.reference(q, w, rows, p0, 4)
    visible = torch.isfinite(want)
    torch.testing.assert_close(scores[:, :190][visible], want[visible], rtol=1e-5, atol=1e-5)
