"""Numerical primitives of DeepSeek V4 in MLX built-in ops, float32.

Each function mirrors its torch counterpart in `dwarfstar.backends.reference.ops` (same semantics,
same order of roundings); tests/mlx/test_mlx_ops.py checks them against it. Only MLX's built-in ops
are used, so this runs wherever MLX does (Linux CPU included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.numerics import E2M1_GRID, E2M1_MIDPOINTS, FP4_BLOCK, FP4_MAX, FP8_BLOCK, FP8_MAX, hadamard_matrix


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[mx.array, mx.array]:
    """cos/sin of p * freq per interleaved pair, [T, rope_dim / 2].

    Angles are formed on the host in float64 (positions are host integers anyway): at
    million-token positions a float32 product loses whole radians.
    """
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, inverse: bool = False) -> mx.array:
    """Rotate interleaved pairs (2i, 2i+1) of the LAST rope dims of x [T, ..., D]; cos/sin are [T, R/2]."""
    half = cos.shape[-1]
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    pairs = rope.reshape(*rope.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack((a * cos - b * sin, a * sin + b * cos), axis=-1).reshape(rope.shape)
    return mx.concatenate((nope, rotated), axis=-1)


def _pow2_ceil(x: mx.array) -> mx.array:
    """Smallest power of two >= x, for positive normal float32 x (the UE8M0 scale), from the bits.

    Both callers floor x well above the smallest normal (1e-4 / 448 and 2^-126), so no subnormal
    ever reaches here.
    """
    bits = mx.view(x, mx.uint32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(mx.uint32)
    return mx.view(exponent << 23, mx.float32)


def _blocked(x: mx.array, block: int) -> tuple[mx.array, int]:
    """View the last dim as blocks, zero-padding a trailing partial block (exact: zeros change nothing)."""
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block), n


def fp8_round(x: mx.array, block: int = FP8_BLOCK) -> mx.array:
    """KV "FP8" QAT rounding: e4m3fn with a power-of-two scale per `block` values (V4: 64 nope dims;
    V4.1: 32, over the whole window row and FP8 GEMM inputs).

    `mx.to_fp8` rounds to nearest even with subnormals, exactly like torch's float8_e4m3fn cast.
    """
    blocks, n = _blocked(x, block)
    amax = mx.maximum(mx.abs(blocks).max(axis=-1, keepdims=True), 1e-4)
    scale = _pow2_ceil(amax * (1.0 / FP8_MAX))
    q = mx.from_fp8(mx.to_fp8(mx.clip(blocks / scale, -FP8_MAX, FP8_MAX)), mx.float32) * scale
    return q.reshape(*q.shape[:-2], -1)[..., :n]


def fp8_round_nope(x: mx.array, rope_dim: int) -> mx.array:
    """FP8-round the non-rope dims of KV rows; the trailing rope dims stay exact."""
    return mx.concatenate((fp8_round(x[..., :-rope_dim]), x[..., -rope_dim:]), axis=-1)


def fp4_round(x: mx.array, block: int = FP4_BLOCK, e4m3_scale: bool = False) -> mx.array:
    """Indexer "FP4" QAT rounding: e2m1 with a power-of-two scale per `block` values, ties to the even code.

    `e4m3_scale` (V4.1's compressed rows, blocks of 16): the scale is amax / 6 rounded to e4m3fn
    instead, amax floored at 6 * 2^-9 (e4m3's smallest subnormal scale); values the rounded-down
    scale pushes past 6 clamp to 6.
    """
    blocks, n = _blocked(x, block)
    if e4m3_scale:
        amax = mx.maximum(mx.abs(blocks).max(axis=-1, keepdims=True), FP4_MAX * 2.0**-9)
        scale = mx.from_fp8(mx.to_fp8(amax * (1.0 / FP4_MAX)), mx.float32)
    else:
        amax = mx.maximum(mx.abs(blocks).max(axis=-1, keepdims=True), FP4_MAX * 2.0**-126)
        scale = _pow2_ceil(amax * (1.0 / FP4_MAX))
    v = mx.clip(blocks / scale, -FP4_MAX, FP4_MAX)
    mag = mx.abs(v)
    mids = mx.array(E2M1_MIDPOINTS)
    code = (mag[..., None] > mids).astype(mx.int32).sum(-1)  # midpoints strictly below |v|
    tie = mag == mx.take(mids, mx.minimum(code, len(E2M1_MIDPOINTS) - 1))
    code = mx.where(tie & (code % 2 == 1), code + 1, code)
    q = mx.take(mx.array(E2M1_GRID), code) * mx.sign(v) * scale
    return q.reshape(*q.shape[:-2], -1)[..., :n]


@functools.cache
def _hadamard_matrix(n: int) -> mx.array:
    return mx.array(hadamard_matrix(n).numpy())


def hadamard(x: mx.array) -> mx.array:
    return x @ _hadamard_matrix(x.shape[-1])


def indexer_round(x: mx.array) -> mx.array:
    """Indexer QAT: Hadamard rotation, then FP4 rounding."""
    return fp4_round(hadamard(x))


def swiglu_clamped(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): the clamp comes before the activation."""
    gate = mx.minimum(gate, limit)
    return gate * mx.sigmoid(gate) * mx.clip(up, -limit, limit)


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """HC combination matrix [..., n, n]: row softmax, one column normalisation, then iters-1 (row, column) rounds."""
    comb = mx.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return comb


def _hc_mix(h: mx.array, fn: mx.array, norm_eps: float) -> mx.array:
    """fn @ RMS-normalised flattened streams (the norm factor is applied after the product)."""
    flat = h.reshape(h.shape[0], -1)
    return (flat @ fn.T) * mx.rsqrt(mx.square(flat).mean(-1, keepdims=True) + norm_eps)


def hc_mix(
    h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, hc_eps: float, norm_eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    """Hyper-connection mixes of the streams h [T, n, D]: (pre [T, n], post [T, n], comb [T, n, n]) (V4
    collapses with its own pre, `hc_pre`; V4.1 with the previous sublayer's)."""
    n = h.shape[1]
    mix = _hc_mix(h, fn, norm_eps)
    pre = mx.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * mx.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def collapse(h: mx.array, pre: mx.array) -> mx.array:
    """sum_k pre_k h_k: [T, D] of streams h [T, n, D] and weights pre [T, n]."""
    return (pre[..., None] * h).sum(1)


def hc_pre(
    h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, hc_eps: float, norm_eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    """Hyper-connection pre-mix. h is [T, n, D]; returns (sublayer input [T, D], post [T, n], comb [T, n, n])."""
    pre, post, comb = hc_mix(h, fn, scale, base, iters, hc_eps, norm_eps)
    return collapse(h, pre), post, comb


def hc_post(out: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """New streams: stream k = post_k * out + sum_j comb[j, k] * h_j (column k of comb, not row)."""
    return post[..., None] * out[:, None, :] + comb.transpose(0, 2, 1) @ h


def hc_head(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, hc_eps: float, norm_eps: float) -> mx.array:
    """Final collapse of the n streams with sigmoid weights (no Sinkhorn, no post)."""
    weights = mx.sigmoid(_hc_mix(h, fn, norm_eps) * scale + base) + hc_eps
    return (weights[..., None] * h).sum(1)


def sink_attention(q: mx.array, kv: mx.array, mask: mx.array | None, sinks: mx.array) -> mx.array:
    """Softmax attention with a per-head sink logit in the denominator; q [T, H, D] -> [T, H, D] (K = V).

    kv is [N, D], shared by every query, or [T, N, D], each query its own rows (the gathered sparse
    selection); mask [T, N] is True where a row is visible, None when all are. MLX's fused attention
    takes the sinks directly.
    """
    scale = q.shape[-1] ** -0.5
    if kv.ndim == 2:
        k = kv[None, None]
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None], k, k, scale=scale, mask=mask, sinks=sinks
        )
        return out[0].transpose(1, 0, 2)
    # one query per batch entry: [T, H, 1, D] against its own [T, 1, N, D]
    k = kv[:, None]
    mask = None if mask is None else mask[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(q[:, :, None, :], k, k, scale=scale, mask=mask, sinks=sinks)
    return out[:, :, 0, :]


def route(
    logits: mx.array,
    k: int,
    route_scale: float,
    bias: mx.array | None,
    fixed: mx.array | None,
    image: mx.array | None = None,
    image_bias: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Pick experts and their weights: (ids [T, k], weights [T, k]).

    Scores are sqrt(softplus(logit)). The bias only steers selection; hash layers take the ids from
    the token table instead. Rows where `image` [T] (bool) is set (image positions) select by score
    + `image_bias` in either kind of layer. Weights are the un-biased scores of the chosen experts,
    renormalised and multiplied by the routed scale.
    """
    scores = mx.sqrt(mx.logaddexp(logits, 0.0))
    ids = fixed if fixed is not None else mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[:, :k]
    if image is not None:
        picked = mx.argpartition(-(scores + image_bias), kth=k - 1, axis=-1)[:, :k]
        ids = mx.where(image[:, None], picked.astype(ids.dtype), ids)
    weights = mx.take_along_axis(scores, ids, axis=1)
    return ids, weights / weights.sum(-1, keepdims=True) * route_scale


class Fused:
    """The op-heavy primitives with the model's constants bound, compiled by `mx.compile` when `enabled`.

    On Metal every op is a kernel launch, and HC-pre alone (20 Sinkhorn rounds) is about 85 of them
    per use, twice per layer: fused, a decode step stops being bound by launches. On a CPU, MLX
    compiles a fused graph with the system C++ compiler, seconds per graph the first time on each
    machine, so there they stay eager by default (tests/mlx checks both agree).
    """

    def __init__(self, args: ModelArgs | ModelArgs41, enabled: bool) -> None:
        wrap: Callable[[Callable], Callable] = mx.compile if enabled else (lambda fn: fn)
        eps = {"hc_eps": args.hc_eps, "norm_eps": args.norm_eps}
        self.hc_pre = wrap(functools.partial(hc_pre, iters=args.hc_sinkhorn_iters, **eps))
        self.hc_mix = wrap(functools.partial(hc_mix, iters=args.hc_sinkhorn_iters, **eps))
        self.hc_post = wrap(hc_post)
        self.hc_head = wrap(functools.partial(hc_head, **eps))
        self.rope = wrap(apply_rope)
        self.unrope = wrap(functools.partial(apply_rope, inverse=True))
        self.fp8_round_nope = wrap(functools.partial(fp8_round_nope, rope_dim=args.rope_dim))
        self.indexer_round = wrap(indexer_round)
        self.swiglu = wrap(functools.partial(swiglu_clamped, limit=args.swiglu_limit))
