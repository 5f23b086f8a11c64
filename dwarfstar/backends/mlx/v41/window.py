"""V4.1's window rows and each query's window in MLX (`backends/reference/v41/window.py`'s numerics):
RMSNorm, RoPE at the token's position, then FP8 e4m3 over the whole row per 32 values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.reference.v41.window import WINDOW_FP8_BLOCK


def window_rows(kv: mx.array, norm: mx.array, cos: mx.array, sin: mx.array, eps: float) -> mx.array:
    """Window rows [T, D] of the tokens' projections kv [T, D]; cos/sin [T, rope / 2] at their positions."""
    return ops.fp8_round(ops.apply_rope(ops.rms_norm(kv, norm, eps), cos, sin), WINDOW_FP8_BLOCK)


def window_keys(
    kept: mx.array, new: mx.array, positions: np.ndarray, window: int
) -> tuple[tuple[mx.array, mx.array], mx.array]:
    """Each query's window keys [T, window, D] (positions p - window + 1 .. p, oldest first) and their
    mask [T, window] (positions before the sequence's start masked), from the rows `kept` of the
    positions before the call and its rows `new` [T, D] at host positions [T]; and the last window - 1
    rows, to keep. The indices are the host's, so the graph has no data-dependent shape."""
    rows = mx.concatenate((kept, new))
    first = int(positions[0]) - kept.shape[0]  # the position of rows[0]
    at = positions[:, None] - window + 1 + np.arange(window)[None, :]
    keep = rows[rows.shape[0] - min(rows.shape[0], window - 1) :]
    index = mx.array(np.maximum(at - first, 0).astype(np.int32))
    return (mx.take(rows, index, axis=0), mx.array(at >= 0)), keep
