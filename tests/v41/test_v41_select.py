"""V4.1's index scores, top-k and layer 20's two-level candidates against the note's §1 restated per
query in numpy, their invariance to how a prompt is split into calls, and the candidates' edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from v41_restate import report

from dwarfstar.backends.reference.v41.select import candidate_mask, index_scores, top_k

HEADS, DIM = 4, 64  # v41-tiny's indexer: 4 heads x 64
TOPK, BLOCK, N_KEEP = 4, 2, 3  # v41-tiny: top-4, candidates 3 blocks of 2 (a 6-row pool)
INF = float("inf")


def inputs(seed: int, t: int, ratio: int):
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(t, HEADS, DIM, generator=g), torch.randn(t, HEADS, generator=g)
    keys = torch.randn(t // ratio, DIM, generator=g)
    return q, w, keys


def numpy_scores(q, w, keys, positions, ratio):
    out = np.full((len(positions), len(keys)), -np.inf)
    for i, p in enumerate(positions):
        for j in range(len(keys)):
            if j < (p + 1) // ratio:
                dots = np.asarray(q[i], np.float64) @ np.asarray(keys[j], np.float64)
                out[i, j] = np.sum(np.asarray(w[i], np.float64) * DIM**-0.5 * HEADS**-0.5 * np.maximum(dots, 0))
    return out


def numpy_top_k(scores, positions, ratio, end, topk, candidates=None):
    """Per query: the K best (ties to the lower index), sorted; unseen or -inf picks -> -1 at the end."""
    k = min(topk, end // ratio)
    out = []
    for i, p in enumerate(positions):
        row = np.where(candidates[i], scores[i], -np.inf) if candidates is not None else scores[i]
        best = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        valid = sorted(j for j in best if j < (p + 1) // ratio and row[j] != -np.inf)
        out.append(valid + [-1] * (k - len(valid)))
    return np.array(out, dtype=np.int64).reshape(len(positions), k)


def numpy_candidates(scores, positions, ratio, block, n_keep):
    """The note's steps 1-3, one query at a time."""
    t, n = scores.shape
    n_blocks = -(-n // block)
    out = np.zeros((t, n), bool)
    for i, p in enumerate(positions):
        block_scores = [max(scores[i, b * block : (b + 1) * block]) for b in range(n_blocks)]
        seen = (p + 1) // ratio
        if seen > 0:
            block_scores[(seen - 1) // block] = np.inf
        best = sorted(range(n_blocks), key=lambda b: (-block_scores[b], b))[: min(n_keep, n_blocks)]
        for b in best:
            if block_scores[b] != -np.inf:
                out[i, b * block : (b + 1) * block] = True
    return out


@pytest.mark.parametrize("ratio", [1, 2])
def test_scores_and_top_k_match_the_note(ratio):
    t = 13
    q, w, keys = inputs(ratio, t, ratio)
    positions = torch.arange(t)
    scores = index_scores(q, w, keys, positions, ratio)
    want = numpy_scores(q.numpy(), w.numpy(), keys.numpy(), range(t), ratio)
    assert np.array_equal(np.isinf(scores.numpy()), np.isinf(want))
    finite = np.isfinite(want)
    assert report(f"index scores ratio {ratio}", scores.numpy()[finite], want[finite]) < 1e-5
    picks = top_k(scores, positions, ratio, t, TOPK)
    assert np.array_equal(picks.numpy(), numpy_top_k(want, range(t), ratio, t, TOPK))
    assert picks.shape == (t, min(TOPK, t // ratio))
    assert (picks[0] == -1).all() if ratio == 2 else picks[0].tolist() == [0, -1, -1, -1]


def test_two_levels_on_the_tiny_config():
    """Builder (ratio 1) scores -> candidates; a reindex layer's own scores, masked, -> its top-k."""
    t = 16
    positions = torch.arange(t)
    q, w, keys = inputs(5, t, 1)
    built = index_scores(q, w, keys, positions, 1)
    mask = candidate_mask(built, positions, 1, BLOCK, N_KEEP)
    want_mask = numpy_candidates(built.numpy().astype(np.float64), range(t), 1, BLOCK, N_KEEP)
    assert np.array_equal(mask.numpy(), want_mask)
    assert mask.sum(1).max() <= BLOCK * N_KEEP and mask[t - 1].sum() == BLOCK * N_KEEP  # the pool bites
    q2, w2, _ = inputs(6, t, 1)
    own = index_scores(q2, w2, keys, positions, 1)
    picks = top_k(own, positions, 1, t, TOPK, candidates=mask)
    assert np.array_equal(picks.numpy(), numpy_top_k(own.numpy(), range(t), 1, t, TOPK, want_mask))
    inside = picks >= 0
    assert mask.gather(1, picks.clamp(min=0))[inside].all()
    assert not torch.equal(picks, top_k(own, positions, 1, t, TOPK))  # the restriction changed a choice


def test_fewer_blocks_than_the_cap_keeps_every_seen_block():
    scores = torch.tensor([[1.0, 5.0, 2.0, -INF, -INF]])  # position 2: 3 rows seen, blocks [1,5] [2,-inf] [-inf]
    mask = candidate_mask(scores, torch.tensor([2]), 1, 2, n_keep=2048)
    assert mask.tolist() == [[True, True, True, True, False]]  # the unseen block (score -inf) is dropped


def test_newest_block_is_kept_even_with_the_lowest_score():
    """Note §1 step 2: the block of the newest visible row, floor((len - 1) / 8), is forced to +inf."""
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 0.0, -INF]])  # 5 rows seen; newest row 4 is in block 2
    mask = candidate_mask(scores, torch.tensor([4]), 1, 2, n_keep=2)
    assert mask.tolist() == [[True, True, False, False, True, True]]


def test_an_all_minus_inf_row_keeps_only_its_newest_block():
    """Forcing to +inf comes before step 3 drops the -inf blocks, so the newest block survives."""
    scores = torch.full((1, 6), -INF)
    mask = candidate_mask(scores, torch.tensor([3]), 1, 2, n_keep=3)
    assert mask.tolist() == [[False, False, True, True, False, False]]
    picks = top_k(scores, torch.tensor([3]), 1, 6, TOPK, candidates=mask)
    assert picks.tolist() == [[-1, -1, -1, -1]]  # nothing scored: no pick is attended


def test_a_query_that_sees_nothing_has_no_candidates():
    scores = torch.full((1, 2), -INF)  # ratio 2, position 0: no row complete yet
    assert not candidate_mask(scores, torch.tensor([0]), 2, 2, 3).any()


def splits(t: int):
    return [[t], [1] * t, [3, 5, t - 8], [7, 1, t - 8], [2, t - 2]]


@pytest.mark.parametrize("ratio", [1, 2])
def test_any_split_gives_the_same_selection(ratio):
    """A query's valid picks and candidates do not depend on the call's end (only K's -1 padding does)."""
    t = 17
    q, w, keys = inputs(7 + ratio, t, ratio)
    q2, w2, _ = inputs(9 + ratio, t, ratio)
    results = []
    for split in splits(t):
        picks, masks, start = {}, {}, 0
        for length in split:
            end = start + length
            positions, rows = torch.arange(start, end), slice(start, end)
            seen = keys[: end // ratio]  # the rows the cache holds at the call's end
            built = index_scores(q[rows], w[rows], seen, positions, ratio)
            mask = candidate_mask(built, positions, ratio, BLOCK, N_KEEP)
            own = top_k(index_scores(q2[rows], w2[rows], seen, positions, ratio), positions, ratio, end, TOPK, mask)
            for i, p in enumerate(positions.tolist()):
                picks[p] = [j for j in own[i].tolist() if j >= 0]
                masks[p] = mask[i, : (p + 1) // ratio].tolist()
            start = end
        results.append((picks, masks))
    assert all(r == results[0] for r in results[1:])


def test_shapes_are_checked():
    q, w, keys = inputs(0, 4, 1)
    with pytest.raises(ValueError, match="index scores"):
        index_scores(q, w[:, :-1], keys, torch.arange(4), 1)
    with pytest.raises(ValueError, match="top-4"):
        top_k(torch.zeros(4, 3), torch.arange(4), 1, 8, TOPK)
    with pytest.raises(ValueError, match="candidate mask"):
        top_k(torch.zeros(4, 4), torch.arange(4), 1, 4, TOPK, torch.ones(4, 3, dtype=torch.bool))
