"""V4.1's CSA2 compressor in MLX (`backends/reference/v41/csa2.py`'s numerics).

Ratio 1: one latent RMSNorm(kv_t) per token. Ratio 2: the tokens {2g, 2g + 1} pooled by a softmax per
channel over their gate scores (V4's pooling, `attention.pool`, with no position bias and no overlap),
then RMSNorm; an unfinished group waits in the frontier (2 slots of kv and score, -inf where empty).
Each latent rotated at its group's first position g * r gives its main row (FP4 e2m1 per 16 with an
e4m3 scale) and, through W_k and its norm, its index key (FP4 per 32, power-of-two scale).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx import attention, ops
from dwarfstar.backends.mlx.weights import Matrix
from dwarfstar.backends.reference.v41.csa2 import POOLED_RATIO, ROW_FP4_BLOCK
from dwarfstar.model.numerics import FP4_BLOCK
from dwarfstar.model.state import CompressorSpec


def new_frontier(width: int) -> tuple[mx.array, mx.array]:
    """An empty ratio-2 frontier: kv zeros, score -inf, [2, width] each."""
    return mx.zeros((POOLED_RATIO, width)), mx.full((POOLED_RATIO, width), -mx.inf)


def latents(
    kv: mx.array,
    score: mx.array | None,
    frontier: tuple[mx.array, mx.array] | None,
    norm: mx.array,
    start: int,
    eps: float,
) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
    """The normed latents [G, width] of the groups tokens start .. start + T - 1 finish and the frontier
    after them (ratio 2: `score` and `frontier` given; ratio 1: both None)."""
    if score is None or frontier is None:
        return ops.rms_norm(kv, norm, eps), None
    width = kv.shape[1]
    spec = CompressorSpec("attn", POOLED_RATIO, width)
    pooled, front_kv, front_score = attention.pool(spec, *frontier, kv, score, mx.zeros((POOLED_RATIO, width)), start)
    latent = mx.zeros((0, width)) if pooled is None else ops.rms_norm(pooled, norm, eps)
    return latent, (front_kv, front_score)


def compress(
    kv: mx.array,
    score: mx.array | None,
    frontier: tuple[mx.array, mx.array] | None,
    norm: mx.array,
    w_k: Matrix,
    k_norm: mx.array,
    index_dim: int,
    inv_freq: np.ndarray,
    start: int,
    eps: float,
) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None]:
    """A kv source's compressor over tokens start .. start + T - 1 (ratio 2 with `score`, else 1): the
    main rows [G, width] and index keys [G, index_dim] of the groups they finish, and the frontier."""
    ratio = 1 if score is None else POOLED_RATIO
    latent, frontier = latents(kv, score, frontier, norm, start, eps)
    if not latent.shape[0]:  # a call inside one group
        return latent, mx.zeros((0, index_dim)), frontier
    first = start // ratio
    cos, sin = ops.rope_tables((first + np.arange(latent.shape[0])) * ratio, inv_freq)
    rows = ops.fp4_round(ops.apply_rope(latent, cos, sin), ROW_FP4_BLOCK, e4m3_scale=True)
    keys = ops.fp4_round(ops.apply_rope(ops.rms_norm(w_k.matmul(latent), k_norm, eps), cos, sin), FP4_BLOCK)
    return rows, keys, frontier
