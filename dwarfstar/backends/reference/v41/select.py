"""V4.1's compressed-row selection (V4.1's reference `Indexer.forward`, `select_candidate_blocks`).

- `index_scores`: score(p, j) = sum_h w_h * relu(iq_h . k_j) with the weights scaled by
  index_head_dim^-0.5 * index_n_heads^-0.5 (128^-0.5 * 32^-0.5 in Flash); row j is visible to the
  query at position p iff j < floor((p + 1) / r), -inf otherwise.
- `top_k`: K = min(topk, floor(end / r)) (end: the call's last position + 1); the K best rows of each
  query, indices ascending; a pick the query cannot see becomes -1 (after the valid ones). A reindex
  layer (24, 28, 32, 36) first sets every row outside its query's candidates to -inf.
- `candidate_mask` (the builder, layer 20): the score row cut into blocks of `block` rows (8), a block
  scored by its max (-inf pads the last block); the block holding the query's newest visible row,
  floor((visible - 1) / block), forced to +inf; the min(n_keep, n_blocks) best blocks (n_keep 2048)
  kept unless their score is -inf; the result a per-query mask over rows. The builder's own top-k is
  over all rows.

Ties (which REF's `torch.topk` leaves unspecified) go to the lower index, so a row's choice does not
depend on how many rows follow it. Both selections take the k-best step as `best` (default `_best`, a
stable sort): a backend passes its own (Triton: the radix top-k kernel), any order out, same ties. One
reading beyond the reference's text: a pick whose score is -inf becomes -1 even when the query could see
the row (it can only be a row outside a reindex query's candidates, picked because fewer than K rows
remain); with Flash's sizes a query always has K candidates it can see or fewer visible rows than K, so
the reference's rule and this one agree there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dwarfstar.backends.reference import ops

NEG_INF = float("-inf")
Best = Callable[[torch.Tensor, int], torch.Tensor]  # (scores [R, n], k <= n) -> [R, k] columns, ties low
# (scores [T, n], best's picks [T, K], positions [T], ratio) -> the picks [T, K] a query keeps (`valid_first`)
Finish = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed rows each query position [T] sees: floor((p + 1) / ratio)."""
    return (positions + 1) // ratio


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Scores [T, n] of queries q [T, H, D] (weights [T, H], unscaled) over index keys [n, D], -inf on
    the rows a query at positions [T] cannot see yet."""
    t, heads, dim = q.shape
    if tuple(weights.shape) != (t, heads) or keys.dim() != 2 or keys.shape[1] != dim or positions.shape != (t,):
        raise ValueError(
            f"index scores: q {tuple(q.shape)}, weights {tuple(weights.shape)}, keys {tuple(keys.shape)}, "
            f"positions {tuple(positions.shape)} do not fit"
        )
    scaled = weights * (dim**-0.5 * heads**-0.5)
    scores = ops.index_scores(q, scaled, keys.expand(t, -1, -1))
    unseen = torch.arange(keys.shape[0])[None, :] >= visible_rows(positions, ratio)[:, None]
    return scores.masked_fill(unseen, NEG_INF)


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best columns, best first, ties to the lower column."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def valid_first(scores: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Each query's picks [T, K] (`top_k`'s best, any order) that it can see and that score above -inf,
    ascending, then -1 for the others (scores [T, n] as `top_k` picked from them)."""
    picks = picks.long()
    invalid = (picks >= visible_rows(positions, ratio)[:, None]) | (scores.gather(1, picks) == NEG_INF)
    ordered = picks.masked_fill(invalid, scores.shape[1]).sort(-1).values  # invalid ones last
    return ordered.masked_fill(ordered == scores.shape[1], -1)


def top_k(
    scores: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    end: int,
    topk: int,
    candidates: torch.Tensor | None = None,
    best: Best = _best,
    finish: Finish = valid_first,
) -> torch.Tensor:
    """Indices [T, K] of each query's best rows (see the module), K = min(topk, end // ratio), scores
    [T, n] with n >= K; `candidates` [T, n] bool (a reindex layer's, from `candidate_mask`). A backend
    passes its own `best` and `finish` (`valid_first`'s rule)."""
    k = min(topk, end // ratio)
    if scores.dim() != 2 or scores.shape[1] < k or positions.shape != scores.shape[:1]:
        raise ValueError(f"top-{k}: scores {tuple(scores.shape)} / positions {tuple(positions.shape)} do not fit")
    if candidates is not None:
        if candidates.shape != scores.shape or candidates.dtype != torch.bool:
            raise ValueError(f"candidate mask {tuple(candidates.shape)} {candidates.dtype} is not like the scores")
        scores = scores.masked_fill(~candidates, NEG_INF)
    return finish(scores, best(scores, k), positions, ratio)


def candidate_mask(
    scores: torch.Tensor, positions: torch.Tensor, ratio: int, block: int, n_keep: int, best: Best = _best
) -> torch.Tensor:
    """The builder's candidates [T, n] bool from its scores [T, n] (-inf where unseen): the rows of the
    kept blocks (see the module)."""
    t, n = scores.shape
    if positions.shape != (t,) or block < 1 or n_keep < 1:
        raise ValueError(f"candidates: scores {tuple(scores.shape)}, positions {tuple(positions.shape)}, block {block}")
    n_blocks = -(-n // block)
    if not n_blocks:  # no row complete yet
        return scores.new_zeros(t, n, dtype=torch.bool)
    block_scores = F.pad(scores, (0, n_blocks * block - n), value=NEG_INF).view(t, n_blocks, block).amax(-1)
    seen = visible_rows(positions, ratio)
    newest = ((seen - 1) // block).clamp(min=0)
    forced = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, newest[:, None], (seen > 0)[:, None])
    block_scores = block_scores.masked_fill(forced, float("inf"))
    keep = torch.zeros_like(forced).scatter_(1, best(block_scores, min(n_keep, n_blocks)).long(), True)
    keep &= block_scores != NEG_INF
    return keep.repeat_interleave(block, 1)[:, :n]
