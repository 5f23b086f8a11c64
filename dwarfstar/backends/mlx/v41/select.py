"""V4.1's compressed-row selection in MLX (`backends/reference/v41/select.py`'s numerics): the indexer's
scores, the top-k (ties to the lower row: MLX's sorts are stable) and the candidate source's blocks.
Row visibility comes from the queries' host positions: row j is visible at p iff j < floor((p + 1) / r).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx import attention


def visible_rows(positions: np.ndarray, ratio: int) -> np.ndarray:
    """How many compressed rows each query position [T] sees."""
    return (positions + 1) // ratio


def index_scores(q: mx.array, weights: mx.array, keys: mx.array, positions: np.ndarray, ratio: int) -> mx.array:
    """Scores [T, n] of queries q [T, H, D] (weights [T, H], unscaled) over index keys [n, D], -inf on
    the rows a query cannot see yet."""
    heads, dim = q.shape[1:]
    seen = np.arange(keys.shape[0])[None, :] < visible_rows(positions, ratio)[:, None]
    return attention.index_scores(q, weights * (dim**-0.5 * heads**-0.5), keys, mx.array(seen))


def _best(scores: mx.array) -> mx.array:
    """Each row's columns best first, ties to the lower column (int32)."""
    return mx.argsort(-scores, axis=-1).astype(mx.int32)


def top_k(
    scores: mx.array, positions: np.ndarray, ratio: int, end: int, topk: int, candidates: mx.array | None
) -> mx.array:
    """Indices [T, K] of each query's best rows, K = min(topk, end // ratio), ascending; -1 (after the
    valid ones) where a pick is not visible or scores -inf. `candidates` [T, n] bool: a reindex layer's."""
    n = scores.shape[1]
    k = min(topk, end // ratio)
    if candidates is not None:
        scores = mx.where(candidates, scores, -mx.inf)
    picks = _best(scores)[:, :k]
    seen = mx.array(visible_rows(positions, ratio)[:, None])
    invalid = (picks >= seen) | (mx.take_along_axis(scores, picks, axis=1) == -mx.inf)
    ordered = mx.sort(mx.where(invalid, n, picks), axis=-1)
    return mx.where(ordered == n, -1, ordered)


def candidate_mask(scores: mx.array, positions: np.ndarray, ratio: int, block: int, n_keep: int) -> mx.array:
    """The candidate source's per-query candidate rows [T, n] bool: the rows of the min(n_keep, blocks)
    best blocks of `block` rows (a block scored by its max, the block of the query's newest visible row
    forced first), those scoring -inf dropped."""
    t, n = scores.shape
    n_blocks = -(-n // block)
    if not n_blocks:
        return mx.zeros((t, n), dtype=mx.bool_)
    padded = mx.pad(scores, [(0, 0), (0, n_blocks * block - n)], constant_values=-mx.inf)
    block_scores = padded.reshape(t, n_blocks, block).max(-1)
    seen = visible_rows(positions, ratio)
    newest = np.maximum((seen - 1) // block, 0)
    forced = (np.arange(n_blocks)[None, :] == newest[:, None]) & (seen > 0)[:, None]
    block_scores = mx.where(mx.array(forced), mx.inf, block_scores)
    rank = mx.argsort(_best(block_scores), axis=-1)  # each block's place in the order
    keep = (rank < min(n_keep, n_blocks)) & (block_scores != -mx.inf)
    return mx.repeat(keep, block, axis=1)[:, :n]
