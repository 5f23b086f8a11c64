"""V4.1's new steps in MLX (`backends/mlx/v41`) against the torch reference's numerics modules
(`backends/reference/v41`) on the same random inputs: the window rows and each query's window, the
CSA2 compressor (ratio 1 and 2, split into calls), the indexer scores, the candidate blocks and the
top-k (with ties), the Engram gate and the lagged mHC's mix and collapse.

The roundings (FP8 window rows, FP4 rows and keys) see the same float32 inputs in both, so on this
CPU they agree bit for bit (measured: 0 differing elements); `assert_rounded` still lets a value
within float32 noise of a rounding midpoint round the other way, as another summation order (Metal's
reductions) may make it, but never more than 1 element in 200."""

from __future__ import annotations

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")

from dwarfstar.backends.mlx import ops as mlx_ops  # noqa: E402
from dwarfstar.backends.mlx.v41 import csa2, engram, select, window  # noqa: E402
from dwarfstar.backends.mlx.weights import DenseMatrix  # noqa: E402
from dwarfstar.backends.reference.v41 import csa2 as ref_csa2  # noqa: E402
from dwarfstar.backends.reference.v41 import engram as ref_engram  # noqa: E402
from dwarfstar.backends.reference.v41 import mhc as ref_mhc  # noqa: E402
from dwarfstar.backends.reference.v41 import select as ref_select  # noqa: E402
from dwarfstar.backends.reference.v41 import window as ref_window  # noqa: E402

D, INDEX_D, EPS = 128, 64, 1e-20
INV_FREQ = 1.0 / 160000 ** (np.arange(16) / 16)  # 32 rope dims


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def arr(t: torch.Tensor) -> mx.array:
    return mx.array(t.numpy())


def host(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def assert_rounded(got: mx.array, want: torch.Tensor, close_arrays) -> None:
    """Equal up to float32 noise, but for at most 1 element in 200 rounded to a neighbouring grid value."""
    got_t = host(got)
    assert got_t.shape == want.shape
    off = (got_t - want).abs() > 1e-6 * want.abs().max()
    assert int(off.sum()) <= want.numel() // 200, f"{int(off.sum())} of {want.numel()} differ"
    assert close_arrays(got_t, want, 0.25)  # a flipped rounding moves a value by a grid step at most


def test_window_rows_match_the_reference(close_arrays):
    positions = torch.arange(37, 37 + 23)
    kv, norm = randn(23, D, seed=1), randn(D, seed=2)
    want = ref_window.window_rows(kv, norm, positions, torch.tensor(INV_FREQ), EPS)
    cos, sin = mlx_ops.rope_tables(positions.numpy(), INV_FREQ)
    assert_rounded(window.window_rows(arr(kv), arr(norm), cos, sin, EPS), want, close_arrays)


@pytest.mark.parametrize("splits", [[13], [1, 1, 5, 6], [7, 6]], ids=["whole", "decode-steps", "chunks"])
def test_window_keys_match_the_reference_across_calls(splits):
    """Each query's window and what is kept, call after call (window 8: the first queries reach before
    position 0, later ones only into the kept rows)."""
    rows = randn(sum(splits), 16, seed=3)
    kept, ref_kept, at = mx.zeros((0, 16)), torch.zeros(0, 16), 0
    for size in splits:
        positions = torch.arange(at, at + size)
        (keys, mask), kept = window.window_keys(kept, arr(rows[at : at + size]), positions.numpy(), 8)
        (want_keys, want_mask), ref_kept = ref_window.window_keys(ref_kept, rows[at : at + size], positions, 8)
        assert torch.equal(host(keys), want_keys) and torch.equal(host(mask), want_mask)
        assert torch.equal(host(kept), ref_kept)
        at += size


@pytest.mark.parametrize("ratio", [1, 2])
def test_csa2_compressor_matches_the_reference_however_the_tokens_are_split(ratio, close_arrays):
    """The reference over all 21 tokens at once against MLX over calls of 4, 1, 1 and 15 tokens (the
    ratio-2 frontier carried between them; an odd count leaves a group open)."""
    t = 21
    kv, score = randn(t, D, seed=4), randn(t, D, seed=5) if ratio == 2 else None
    norm, w_k, k_norm = randn(D, seed=6), randn(INDEX_D, D, seed=7) * 0.1, randn(INDEX_D, seed=8)
    inv_freq = torch.tensor(INV_FREQ)
    want = ref_csa2.compress(
        kv, score, ref_csa2.new_frontier(D) if score is not None else None, norm, w_k, k_norm, inv_freq, 0, EPS
    )
    frontier = csa2.new_frontier(D) if score is not None else None
    rows, keys, at = [], [], 0
    for size in (4, 1, 1, 15):
        part = None if score is None else arr(score[at : at + size])
        r, k, frontier = csa2.compress(
            arr(kv[at : at + size]), part, frontier, arr(norm), DenseMatrix(arr(w_k)), arr(k_norm), INDEX_D,
            INV_FREQ, at, EPS,
        )  # fmt: skip
        rows.append(r)
        keys.append(k)
        at += size
    assert_rounded(mx.concatenate(rows), want.rows, close_arrays)
    assert_rounded(mx.concatenate(keys), want.index_keys, close_arrays)
    if ratio == 2:
        assert close_arrays(host(frontier[0]), want.frontier.kv) and close_arrays(
            host(frontier[1]), want.frontier.score
        )
    else:
        assert frontier is None and want.frontier is None


def test_index_scores_match_the_reference(close_arrays):
    positions = torch.arange(3, 3 + 17)  # sees 2 .. 10 of the 12 ratio-2 rows
    q, weights, keys = randn(17, 4, INDEX_D, seed=9), randn(17, 4, seed=10), randn(12, INDEX_D, seed=11)
    want = ref_select.index_scores(q, weights, keys, positions, 2)
    got = select.index_scores(arr(q), arr(weights), arr(keys), positions.numpy(), 2)
    assert want.isinf().any() and close_arrays(host(got), want, 1e-5)


def tied_scores() -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of 9 queries over 14 rows with many exact ties (zeros, as the indexer's relu makes, and
    repeated values), -inf past what each query sees, and the queries' positions (ratio 1)."""
    positions = torch.arange(5, 14)
    scores = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.0, 2.0, 1.0, 0.0, 0.5, 3.0, 0.0, 1.0, 0.0, 0.25])
    scores = scores[None, :].repeat(9, 1) * torch.arange(1, 10)[:, None].remainder(3).float()
    unseen = torch.arange(14)[None, :] >= ref_select.visible_rows(positions, 1)[:, None]
    return scores.masked_fill(unseen, float("-inf")), positions


def test_candidate_blocks_match_the_reference():
    scores, positions = tied_scores()
    for block, keep in ((2, 3), (3, 2), (4, 9)):
        want = ref_select.candidate_mask(scores, positions, 1, block, keep)
        got = select.candidate_mask(arr(scores), positions.numpy(), 1, block, keep)
        assert torch.equal(host(got), want), (block, keep)
        assert (~want).any()  # the blocks do cut something


@pytest.mark.parametrize("with_candidates", [False, True], ids=["free", "in-candidates"])
def test_top_k_matches_the_reference_ties_included(with_candidates):
    scores, positions = tied_scores()
    candidates = ref_select.candidate_mask(scores, positions, 1, 2, 3) if with_candidates else None
    for topk in (3, 6, 40):  # fewer than the visible rows (ties decide), and more
        want = ref_select.top_k(scores, positions, 1, 14, topk, candidates)
        got = select.top_k(arr(scores), positions.numpy(), 1, 14, topk, None if candidates is None else arr(candidates))
        assert torch.equal(host(got).long(), want), topk


def test_engram_matches_the_reference(close_arrays):
    t, n, d, columns, head_dim = 7, 4, 64, 24, 256
    h, rows = randn(t, n, d, seed=12), randn(t, columns, head_dim, seed=13)
    w_kv, q_weight, k_weight = (
        randn((n + 1) * d, columns * head_dim, seed=14) * 0.02,
        randn(n, d, seed=15),
        randn(n, d, seed=16),
    )
    want = ref_engram.engram(h, rows, w_kv, q_weight, k_weight, torch.zeros(t, dtype=torch.bool), EPS)
    got = engram.engram(arr(h), arr(rows), DenseMatrix(arr(w_kv)), arr(q_weight), arr(k_weight), EPS)
    assert not torch.allclose(want, h) and close_arrays(host(got), want, 1e-5)


def test_lagged_mhc_mix_and_collapse_match_the_reference(close_arrays):
    t, n, d = 6, 4, 64
    h = randn(t, n, d, seed=17)
    fn, scale, base = randn((2 + n) * n, n * d, seed=18) * 0.05, randn(3, seed=19), randn((2 + n) * n, seed=20)
    want = ref_mhc.mix(h, ref_mhc.HcWeights(fn, scale, base), ref_mhc.HcConfig(20, 1e-6, EPS))
    got = mlx_ops.hc_mix(arr(h), arr(fn), arr(scale), arr(base), 20, 1e-6, EPS)
    for g, w in zip(got, want, strict=True):
        assert close_arrays(host(g), w, 1e-5)
    assert close_arrays(host(mlx_ops.collapse(arr(h), got[0])), ref_mhc.collapse(h, want[0]), 1e-5)
