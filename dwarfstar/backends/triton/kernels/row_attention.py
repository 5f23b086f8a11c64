"""Sink attention of query rows over keys of their own (V4.1's attention, `forward_v41.Ops41.attend`).

Each query row i has its own keys in up to two parts, keys [T, n, D] (K = V, one shared head) with a
mask [T, n]: V4.1's window rows (positions p - window + 1 .. p) and its selected compressed rows, as
the forward pass gathers them. The online softmax and the finish (the per-head sink in the
denominator, then the inverse RoPE of the output's tail dims at the query's position) are the V4
attention kernel's (`attention._block`, `attention._finish`); only the rows' addressing differs.
One program per (query, head group), its rows in blocks of BN.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.attention import NEG, _block, _finish, _tiles
from dwarfstar.backends.triton.kernels.rms_norm_rope import rope_cos_sin, rotate_pairs
from dwarfstar.backends.triton.runtime import EXACT, BenchCase, BenchShape, Precision, next_pow2
from dwarfstar.model.numerics import rope_angles


@triton.jit
def _part(q_lo, q_hi, keys_ptr, mask_ptr, i, n, D, sm_scale, m, l, acc_lo, acc_hi,
          BN: tl.constexpr, BD2: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """The online softmax over query i's n rows of one part (rows i * n .., mask [T, n] int8)."""
    r = tl.arange(0, BN)
    base = i.to(tl.int64) * n
    for b in range(0, tl.cdiv(n, BN)):
        c = b * BN + r
        ok = (c < n) & (tl.load(mask_ptr + base + c, mask=c < n, other=0) != 0)
        m, l, acc_lo, acc_hi = _block(q_lo, q_hi, keys_ptr, keys_ptr, base + c, ok, D, sm_scale, m, l, acc_lo, acc_hi,
                                      BD2, FAST, 0)  # fmt: skip
    return m, l, acc_lo, acc_hi


@triton.jit
def _row_attention_kernel(
    q_ptr, k1_ptr, m1_ptr, n1, k2_ptr, m2_ptr, n2, sinks_ptr, pos_ptr, inv_ptr, out_ptr, D, sm_scale,
    H: tl.constexpr, ROPE_DIM: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    FAST: tl.constexpr, ROTATE_Q: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    hg = tl.program_id(1)
    h = hg * BH + tl.arange(0, BH)
    heads_ok = h < H
    BD2: tl.constexpr = BD // 2
    d = tl.arange(0, BD2)
    q_row = q_ptr + (i.to(tl.int64) * H + h[:, None]) * D
    q_lo = tl.load(q_row + d[None, :], mask=heads_ok[:, None] & (d < D)[None, :], other=0.0)
    q_hi = tl.load(q_row + BD2 + d[None, :], mask=heads_ok[:, None] & (BD2 + d < D)[None, :], other=0.0)
    p = tl.load(pos_ptr + i)
    if ROTATE_Q:  # the query's RoPE at its position, the angles formed here (`rms_norm_rope.rope_cos_sin`),
        # each half on its own: the high half's pairs are those of rows of D - BD2 dims
        at = tl.zeros([1], tl.int32) + p
        cos, sin = rope_cos_sin(at, inv_ptr, D, ROPE_DIM, False, BD2)
        q_lo = rotate_pairs(q_lo, cos, sin, BH, BD2)
        cos, sin = rope_cos_sin(at, inv_ptr, D - BD2, ROPE_DIM, False, BD2)
        q_hi = rotate_pairs(q_hi, cos, sin, BH, BD2)
    m = tl.full((BH,), NEG, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc_lo = tl.zeros((BH, BD2), tl.float32)
    acc_hi = tl.zeros((BH, BD2), tl.float32)
    m, l, acc_lo, acc_hi = _part(q_lo, q_hi, k1_ptr, m1_ptr, i, n1, D, sm_scale, m, l, acc_lo, acc_hi, BN, BD2, FAST)
    m, l, acc_lo, acc_hi = _part(q_lo, q_hi, k2_ptr, m2_ptr, i, n2, D, sm_scale, m, l, acc_lo, acc_hi, BN, BD2, FAST)
    acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), [BH, BD])
    _finish(acc, m, l, sinks_ptr, inv_ptr, p, out_ptr, i, hg, heads_ok, D, H, ROPE_DIM, BH, BD)


def row_attention(
    q: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    positions: torch.Tensor,
    precision: Precision = EXACT,
    rotate_q: bool = False,
) -> torch.Tensor:
    """Output [T, H, D] with the RoPE undone: q [T, H, D] over one or two parts (keys [T, n, D], mask
    [T, n] bool), sinks [H], inv_freq float64 [rope_dim / 2], positions [T] (the queries').
    `rotate_q`: q comes unrotated and the kernel applies its RoPE (the angles formed in the kernel from
    the position, as `_finish` undoes it; a launch fewer than `rms_norm_rope` with `rope_angles`' tables)."""
    t, heads, d = q.shape
    if not 1 <= len(parts) <= 2 or any(k.shape[0] != t or k.shape[2] != d or m.shape != k.shape[:2] for k, m in parts):
        shapes = [(tuple(k.shape), tuple(m.shape)) for k, m in parts]
        raise ValueError(f"attention of queries {tuple(q.shape)} over one or two parts, got {shapes}")
    (k1, m1), (k2, m2) = parts[0], parts[1] if len(parts) == 2 else (q.new_zeros(t, 0, d), parts[0][1][:, :0])
    bh, bn = _tiles(heads, d, max(k1.shape[1], k2.shape[1], 1))
    out = torch.empty(t, heads, d, device=q.device, dtype=torch.float32)
    bd = next_pow2(d)
    _row_attention_kernel[(t, triton.cdiv(heads, bh))](
        q.contiguous(), k1.contiguous(), _bytes(m1), k1.shape[1], k2.contiguous(), _bytes(m2), k2.shape[1],
        sinks, positions.contiguous(), inv_freq, out, d, 1.0 / math.sqrt(d),
        H=heads, ROPE_DIM=rope_dim, BH=bh, BN=bn, BD=bd, FAST=precision.fast, ROTATE_Q=rotate_q,
        num_warps=8 if bd >= 512 else 4, num_stages=1,
    )  # fmt: skip
    return out


def _bytes(mask: torch.Tensor) -> torch.Tensor:
    """A mask as the kernel reads it, int8 (a bool mask's bytes as they are: no conversion launched)."""
    return mask.contiguous().view(torch.int8) if mask.dtype == torch.bool else mask.to(torch.int8)


def reference(q, parts, sinks, inv_freq, positions) -> torch.Tensor:
    out, _ = ops.attention_rows(q, parts, sinks)
    return ops.apply_rope(out, *rope_angles(positions, inv_freq), inverse=True)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """A decode query and a prefill chunk over a window's rows and the top-k's selected rows, the query
    rotated in the kernel (as the V4.1 backend runs it)."""
    from dwarfstar.model.config import yarn_inv_freq

    a, dev, gen = shape.args, shape.device, shape.generator()  # V4's fields of the same meaning
    inv = torch.tensor(yarn_inv_freq(a, a.layer(a.n_layers - 1)), dtype=torch.float64, device=dev)  # type: ignore[arg-type]
    sinks = torch.randn(a.n_heads, device=dev, generator=gen)
    cases = []
    for what, t in (("decode", 1), ("prefill", min(shape.prefill, 64))):
        q = torch.randn(t, a.n_heads, a.head_dim, device=dev, generator=gen)
        parts = [
            (torch.randn(t, n, a.head_dim, device=dev, generator=gen), torch.ones(t, n, dtype=torch.bool, device=dev))
            for n in (a.window, a.index_topk)
        ]
        positions = torch.arange(shape.ctx, shape.ctx + t, device=dev)
        run = functools.partial(row_attention, q, parts, sinks, inv, a.rope_dim, positions, rotate_q=True)
        moved = 4 * (2 * q.numel() + sum(k.numel() for k, _ in parts))
        cases.append(BenchCase("row_attention", f"V4.1 {what} {t} queries", run, moved))
    return cases
