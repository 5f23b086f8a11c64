"""V4.1's Engram gate in MLX (`backends/reference/v41/engram.py`'s numerics, text positions only):

E = fp8(bf16(rows));  kv = W_kv E;  key = kv[: n*D] as [n, D], value = kv[n*D :]
dot_k = (sum_c H_k w_k key_k) * rsqrt(mean(H_k^2) + eps) * rsqrt(mean(key_k^2) + eps) / sqrt(D)
H_k += sigmoid(sign(dot_k) sqrt(max(|dot_k|, 1e-6))) * value
"""

from __future__ import annotations

import math

import mlx.core as mx

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.mlx.weights import Matrix
from dwarfstar.backends.reference.v41.engram import GATE_FLOOR, GEMM_FP8_BLOCK


def engram(h: mx.array, rows: mx.array, w_kv: Matrix, q_weight: mx.array, k_weight: mx.array, eps: float) -> mx.array:
    """The streams h [T, n, D] enriched by the Engram rows [T, C, d_e] (float32, dequantized) through
    W_kv [(n + 1) * D, C * d_e]; q_weight and k_weight [n, D]."""
    t, n, d = h.shape
    e = ops.fp8_round(rows.astype(mx.bfloat16).astype(mx.float32).reshape(t, -1), GEMM_FP8_BLOCK)
    kv = w_kv.matmul(e)
    key, value = kv[:, : n * d].reshape(t, n, d), kv[:, n * d :]
    r = mx.rsqrt(mx.square(h).mean(-1) + eps) * mx.rsqrt(mx.square(key).mean(-1) + eps)
    dot = (h * (q_weight * k_weight) * key).sum(-1) * r / math.sqrt(d)
    gate = mx.sigmoid(mx.sign(dot) * mx.sqrt(mx.maximum(mx.abs(dot), GATE_FLOOR)))
    return h + gate[..., None] * value[:, None, :]
