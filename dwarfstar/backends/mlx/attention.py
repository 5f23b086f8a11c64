"""Attention's MLX operations on one sequence's state: compressor pooling, the indexer's top-k, and
sink attention over the raw window and the chosen compressed rows.

These are the bodies of `MLXOps.compress`, `index_topk` and `sparse_attention` for one sequence;
the order they run in is `dwarfstar.model.forward.Transformer`'s. Attention is really sparse: a
query reads its raw window rows (a slice of the window buffer) and, in ratio-4 layers, the top-k
compressed rows the indexer chose, gathered by index, so a decode step's attention costs window +
top_k rows whatever the context; ratio-128 layers read all their visible rows (ctx / 128 of them).
Only the indexer scores every visible indexer row (a small head dim), as the model defines.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx import ops
from dwarfstar.model.state import CompressorSpec

# Prefill queries attend in blocks of this many: a block gathers [block, top_k, head_dim] rows
# (Flash: 128 x 512 x 512 floats, 128 MB), so a long chunk never holds them all at once, and its
# raw keys are the window + block - 1 rows the block can see (and an image span's reach), not the whole chunk.
QUERY_BLOCK = 128


@dataclass
class Selection:
    """The compressed rows each query of one sequence attends to (ratio-4 layers).

    `ids` [T, k] index the layer's compressed rows; `valid` [T, k] is False where a chosen row is
    not visible to the query yet (prefill queries that see fewer than k rows), None when all are.
    """

    ids: mx.array
    valid: mx.array | None


def pool(
    spec: CompressorSpec,
    front_kv: mx.array,
    front_gate: mx.array,
    kv: mx.array,
    gate: mx.array,
    ape: mx.array,
    start: int,
) -> tuple[mx.array | None, mx.array, mx.array]:
    """Advance a compressor over T tokens from position `start`: the finished windows' pooled rows
    (before their norm), or None when no window finished, and the new frontier (kv, gate).

    Same semantics as `dwarfstar.backends.reference.ops.compress`: a window of `ratio` tokens pools
    by a softmax gate over its slots, ratio 4 over 8 slots (the previous window's first half too).
    """
    r, off = spec.ratio, spec.current_offset
    n_pending = start % r  # tokens of the window in progress already in the frontier
    slots = mx.arange(start, start + kv.shape[0]) % r
    kv = mx.concatenate((front_kv[off : off + n_pending], kv))
    gate = mx.concatenate((front_gate[off : off + n_pending], gate + ape[slots]))
    n = kv.shape[0] // r
    kept_kv, kept_gate = front_kv[:off], front_gate[:off]  # ratio 4: the previous window
    pooled = None
    if n:
        win_kv, win_gate = kv[: n * r].reshape(n, r, -1), gate[: n * r].reshape(n, r, -1)
        if spec.overlap:
            # row w pools the first half of window w-1 and the second half of window w; before
            # window 0 the frontier holds gate -inf, which gives those slots weight 0
            d = spec.dim
            prev_kv = mx.concatenate((front_kv[None, :r], win_kv[:-1]))[..., :d]
            prev_gate = mx.concatenate((front_gate[None, :r], win_gate[:-1]))[..., :d]
            win_kv = mx.concatenate((prev_kv, win_kv[..., d:]), axis=1)
            win_gate = mx.concatenate((prev_gate, win_gate[..., d:]), axis=1)
            kept_kv, kept_gate = kv[(n - 1) * r : n * r], gate[(n - 1) * r : n * r]
        pooled = (win_kv * mx.softmax(win_gate, axis=1)).sum(1)
    rest = kv.shape[0] - n * r
    pad = front_kv.shape[0] - off - rest
    width = front_kv.shape[1]
    new_kv = mx.concatenate((kept_kv, kv[n * r :], mx.zeros((pad, width))))
    new_gate = mx.concatenate((kept_gate, gate[n * r :], mx.full((pad, width), -mx.inf)))
    return pooled, new_kv, new_gate


def visible_rows(positions: mx.array, ratio: int, n_rows: int) -> mx.array | None:
    """[T, n_rows]: row w is complete, hence visible, once token ratio * (w + 1) - 1 has been seen.

    None for a single query: after its own token every row in the buffer is complete.
    """
    if positions.shape[0] == 1:
        return None
    return mx.arange(n_rows)[None, :] < ((positions + 1) // ratio)[:, None]


def top_k(scores: mx.array, visible: mx.array | None, k: int) -> Selection:
    """The k best-scoring rows per query of scores [T, rows] (-inf where not visible), all when fewer."""
    T, n_rows = scores.shape
    if k >= n_rows:
        return Selection(mx.broadcast_to(mx.arange(n_rows)[None, :], (T, n_rows)), visible)
    ids = mx.argpartition(-scores, kth=k - 1, axis=1)[:, :k]
    return Selection(ids, None if visible is None else mx.take_along_axis(visible, ids, axis=1))


def index_scores(q: mx.array, weights: mx.array, index_rows: mx.array, visible: mx.array | None) -> mx.array:
    """sum_h w_h * relu(q_h . k) [T, rows], -inf where a row is not visible; q [T, heads, dim]."""
    scores = (mx.maximum(q @ index_rows.T, 0.0) * weights[..., None]).sum(1)
    return scores if visible is None else mx.where(visible, scores, -mx.inf)


def window_band(n_queries: int, first: int, lo: int, n_keys: int, window: int) -> mx.array | None:
    """[B, n_keys]: query i (raw index first + i) sees raw key j (raw index lo + j) within its window.

    None for a single query, whose keys are exactly the rows of its window.
    """
    if n_queries == 1:
        return None
    age = (first - lo + mx.arange(n_queries))[:, None] - mx.arange(n_keys)[None, :]
    return (age >= 0) & (age < window)


def _joined(a: mx.array | None, b: mx.array | None, shape_a: tuple[int, int], shape_b: tuple[int, int]) -> mx.array:
    """Two [B, *] visibility masks side by side, either of which may be None (all visible)."""
    a = mx.ones(shape_a, dtype=mx.bool_) if a is None else a
    b = mx.ones(shape_b, dtype=mx.bool_) if b is None else b
    return mx.concatenate((a, b), axis=1)


def sparse_attention(
    q: mx.array,
    raw: mx.array,
    n_new: int,
    window: int,
    sinks: mx.array,
    rows: mx.array | None,
    visible: mx.array | None,
    selection: Selection | None,
    band: dict[tuple[int, int, int], mx.array | None],
    reach: np.ndarray | None = None,
) -> mx.array:
    """Sink attention of one sequence's T queries [T, H, D] over their raw windows and compressed rows.

    raw [n_old + T, D] holds the window before this call and the T new rows; rows [n, D] are the
    layer's compressed rows (None in a layer without); with a `selection` each query reads only the
    rows it chose, gathered ([B, window + k, D] keys per query), else all of them under `visible`.
    `band` caches the window masks, which are the same in every layer of a call. `reach` [T, 2] (a
    chunk with a bidirectional image span, `image_spans.window_reach`): each query's first and last
    raw row, in place of its causal window (its masks are built per layer).
    """
    T, n_old = q.shape[0], raw.shape[0] - n_new
    out = []
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        first, n_q = n_old + t0, t1 - t0  # raw index of the block's first query
        if reach is None:
            lo = max(0, first - window + 1)
            keys = raw[lo : n_old + t1]
            key = (first, n_q, lo)
            if key not in band:
                band[key] = window_band(n_q, first, lo, keys.shape[0], window)
            mask = band[key]
        else:
            ends = reach[t0:t1]
            lo = int(ends[:, 0].min())
            keys = raw[lo : int(ends[:, 1].max()) + 1]
            at = mx.arange(lo, lo + keys.shape[0])[None, :]
            mask = (at >= mx.array(ends[:, :1])) & (at <= mx.array(ends[:, 1:]))
        if selection is not None:
            chosen = mx.take(rows, selection.ids[t0:t1], axis=0)  # [B, k, D]
            keys = mx.concatenate((mx.broadcast_to(keys[None], (n_q, *keys.shape)), chosen), axis=1)
            valid = None if selection.valid is None else selection.valid[t0:t1]
            if mask is not None or valid is not None:
                mask = _joined(mask, valid, (n_q, keys.shape[1] - chosen.shape[1]), (n_q, chosen.shape[1]))
        elif rows is not None and rows.shape[0]:
            seen = None if visible is None else visible[t0:t1]
            if mask is not None or seen is not None:
                mask = _joined(mask, seen, (n_q, keys.shape[0]), (n_q, rows.shape[0]))
            keys = mx.concatenate((keys, rows))
        out.append(ops.sink_attention(q[t0:t1], keys, mask, sinks))
    return out[0] if len(out) == 1 else mx.concatenate(out)
