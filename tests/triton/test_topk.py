"""Device top-k selection against torch.topk, with per-row valid lengths and several merge rounds."""

from __future__ import annotations

import torch

from dwarfstar.backends.triton.kernels import topk


def chosen_sets(out: torch.Tensor) -> list[set[int]]:
    return [set(i for i in row.tolist() if i >= 0) for row in out]


def test_fewer_valid_rows_than_k_selects_them_all(device):
    """The indexer with fewer visible compressed rows than top-k: all of them, padded with -1."""
    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).to(device)
    valid = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    out = topk.topk_indices(scores, valid, 8)
    assert out.tolist()[0] == [-1] * 8
    assert out.tolist()[1] == [0, 1, 2, 3, 4, -1, -1, -1]
    assert chosen_sets(out) == topk.reference(scores.cpu(), valid.cpu(), 8)


def test_single_block_top_k(device):
    scores = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(device)
    valid = torch.tensor([300, 299, 9, 150], dtype=torch.int32, device=device)
    out = topk.topk_indices(scores, valid, 8)
    assert chosen_sets(out) == topk.reference(scores.cpu(), valid.cpu(), 8)
    assert out[0].tolist() == sorted(scores[0].topk(8).indices.tolist())  # ascending index order


def test_merge_rounds_and_ties_prefer_lower_index(device):
    """n spans several blocks: each block's survivors are merged in further rounds."""
    k = 16
    n = 3 * topk.block_size(k) + 77
    scores = torch.randn(2, n, generator=torch.Generator().manual_seed(2))
    high = torch.randperm(n, generator=torch.Generator().manual_seed(3))[:10]
    scores[1] = 0.0  # massive ties at the boundary
    scores[1, high] = 2.0
    scores = torch.cat((scores, scores[:1]))  # a third row with fewer valid entries than k
    valid = torch.tensor([n, n - 5, 5], dtype=torch.int32)
    out = topk.topk_indices(scores.to(device), valid.to(device), k).cpu()
    assert chosen_sets(out)[0] == topk.reference(scores, valid, k)[0]
    zeros = [i for i in range(n) if i not in set(high.tolist())][:6]  # tied entries: lowest indices win
    assert out[1].tolist() == sorted(high.tolist() + zeros)
    assert out[2].tolist() == [0, 1, 2, 3, 4] + [-1] * (k - 5)  # done by the first of several rounds
