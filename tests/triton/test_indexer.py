"""Indexer scores and selection against the reference indexer math, incl. fewer rows than top-k."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize(
    "k,capacity,bound,positions",
    [
        (3, 32, 16, [2, 27, 40]),  # no row yet; 7 rows; 10 rows: one top-k block, its round final
        (4, 640, 512, [2050, 30, 1500]),  # 512, 7 and 375 rows in two blocks: both rounds in the launch
        (64, 2048, 2048, [8190, 100, 4000]),  # eight blocks of 64 candidates: a further round launched
    ],
)
def test_a_batch_of_sequences_in_cache_slots_selects_each_alone(k, capacity, bound, positions, device):
    """One launch scores one decode query for each of three sequences, each at its own position in
    its own slot of a cache block (pages shuffled), and selects each one's top-k rows: the last
    scoring programs to finish run the selection. Twice, as a replayed graph would: the ticket
    counters are reset by the launch itself."""
    gen = torch.Generator().manual_seed(k)
    heads, dim, slots = 16, 64, [1, 3, 0]
    q = torch.randn(3, heads, dim, generator=gen)
    w = torch.randn(3, heads + 2, generator=gen)[:, 1:-1]  # a strided column slice
    block = torch.randn(4, capacity, dim, generator=gen)
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    paged = PagedRows.scattered(block.to(device), seed=k)
    args = (q.to(device), w.to(device), paged, pos, slot, bound, 4, k)
    chosen = ix.indexer_topk_batch(*args)
    assert torch.equal(ix.indexer_topk_batch(*args), chosen)
    assert not ix.ticket_counters(chosen.device, "indexer", 1).any()
    for b, (p, s) in enumerate(zip(positions, slots, strict=True)):
        want = ix.reference(q[b : b + 1], w[b : b + 1], block[s, :bound], p, 4)
        n = int(torch.isfinite(want).sum())
        row = chosen[b].tolist()
        assert row == sorted(row[: min(n, k)]) + [-1] * (k - min(n, k))  # ascending, then -1
        assert set(row[: min(n, k)]) == topk.reference(want, torch.tensor([n]), k)[0]


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
