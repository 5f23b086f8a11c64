"""V4.1's Engram output and gate (V4.1's reference `Engram.forward`).

Per token of an Engram layer (1 and 14 in Flash), with H [n, D] its n = hc_mult streams entering the
block, and its C = 24 table rows (3 n-gram sizes x 8 heads, column order (n-2)*8 + head) already
gathered and dequantized (`dwarfstar.engram.rows.dequantize`):

    E     = concat of the C rows, each value rounded to bf16       [C * d_e]     (REF: fp32 product, then bf16)
    kv    = W_kv . fp8(E)                                        [(n + 1) * D]  (fp8: W_kv is an FP8 linear)
    key   = kv[: n*D] as [n, D];  value = kv[n*D :]              (value shared by the n copies)
    w     = q_weight * k_weight                                  [n, D]
    dot_k = (sum_c H_k[c] w_k[c] key_k[c]) * rsqrt(mean(H_k^2) + eps) * rsqrt(mean(key_k^2) + eps) / sqrt(D)
    g_k   = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6))),  0 at image-span positions
    H_k  += g_k * value

Roundings: the rows to bf16 (the reference's "rounded to bf16"), then E's FP8 fake-quant (e4m3, a
power-of-two scale per 32 values, as REF's FP8 GEMM quantizes its input: `ops.fp8_round` with block 32);
everything after it is float32 (REF computes the gate in fp32 and casts the sum back to the stream
dtype, float32 here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.weights import FLOAT32
from dwarfstar.model.numerics import elementwise

GEMM_FP8_BLOCK = 32  # V4.1's FP8 linears quantize their input per 32 values (weight_block_size [32, 32])
GATE_FLOOR = 1e-6  # |dot| is floored before the square root


def engram(
    h: torch.Tensor,
    rows: torch.Tensor,
    w_kv: Any,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    image: torch.Tensor,
    eps: float,
    products: ops.Multiplies = FLOAT32,
) -> torch.Tensor:
    """The streams h [T, n, D] enriched by the Engram rows [T, C, d_e] (float32, dequantized), with
    w_kv [(n + 1) * D, C * d_e] as `products` hold it (float32 by default; the cpu backend's file
    blocks), q_weight and k_weight [n, D], image [T] bool (gate 0 where set) and
    the norms' eps (1e-20 in V4.1). Returns new streams [T, n, D]; nothing is written in place."""
    t, n, d = h.shape
    if rows.dim() != 3 or rows.shape[0] != t:
        raise ValueError(f"engram rows {tuple(rows.shape)} are not [{t}, columns, head_dim]")
    width = rows.shape[1] * rows.shape[2]
    if tuple(w_kv.shape) != ((n + 1) * d, width):
        raise ValueError(f"engram W_kv {tuple(w_kv.shape)} is not [{(n + 1) * d}, {width}]")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (n, d):
            raise ValueError(f"engram {name} {tuple(weight.shape)} is not [{n}, {d}]")
    if tuple(image.shape) != (t,) or image.dtype != torch.bool:
        raise ValueError(f"engram image mask {tuple(image.shape)} {image.dtype} is not [{t}] bool")
    e = ops.fp8_round(rows.to(torch.bfloat16).float().reshape(t, width), GEMM_FP8_BLOCK)
    kv = products.linear(e, w_kv)
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d :]
    r = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (q_weight * k_weight) * key).sum(-1) * r / math.sqrt(d)
    gate = elementwise(torch.sigmoid, dot.sign() * dot.abs().clamp_min(GATE_FLOOR).sqrt())
    gate = gate.masked_fill(image[:, None], 0.0)
    return h + gate[..., None] * value[:, None, :]
