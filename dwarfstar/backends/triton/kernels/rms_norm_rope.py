"""RMSNorm, then RoPE on the tail dims, then the QAT rounding, fused over rows of heads.

One kernel covers every per-row epilogue of the attention path (spec §2.1, §9):
* qr = RMSNorm(q_a; q_norm)                               norm only
* q heads: unweighted RMSNorm, RoPE                       (YaRN lives in the cos/sin tables)
* raw KV row: RMSNorm(kv_norm), RoPE, FP8 on the nope dims
* compressed KV row: RMSNorm(compressor norm), RoPE at the window's first position, FP8
* indexer row / indexer query: [RMSNorm], RoPE, Hadamard, FP4
* V4.1 (`QAT_V41`): window rows e4m3 over the whole row per 32 (`QAT_FP8_ROW`), index queries and keys
  e2m1 per 32 without the Hadamard (`QAT_FP4_ROW`), compressed rows e2m1 per 16 with an e4m3 scale
  (`QAT_FP4_E4M3`): `ops.fp8_round` / `ops.fp4_round` with the V4.1 blocks

RoPE rotates interleaved pairs of the last `rope_dim` dims; the pairs are split out of the register
tile with reshape + split, and pairs before the rope dims get cos 1 / sin 0. Angles are formed in
float64 (a float32 product of position and frequency loses whole radians at million-token
positions): a chunk brings cos/sin tables [tokens, rope_dim / 2] built by `model.numerics.rope_angles`
on the device; a decode step's kernels form them from the device positions and the layer's inverse
frequencies (`rope_cos_sin`: the float64 product, a Cody-Waite reduction by pi/2 and Taylor
polynomials to float64 accuracy, then float32), which agrees with the tables to the float32 rounding.
`query_rows` finishes a decode step's query heads (norm + RoPE) and, in ratio-4 layers, the indexer
query heads (RoPE + Hadamard + FP4) in one launch.

The QAT roundings are exact: a power-of-two block scale (UE8M0) and round-to-nearest-even on the
e4m3 / e2m1 grid done in integer and float arithmetic that the interpreter and every GPU agree on
(no fp8 conversion instruction, which ROCm and older GPUs lack).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    dependent_launch,
    interpreting,
    next_pow2,
    rsqrt_rn,
    wait_for_inputs,
)
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.numerics import hadamard_matrix, rope_angles

NORM_NONE, NORM_PLAIN, NORM_WEIGHTED = 0, 1, 2
QAT_NONE, QAT_FP8, QAT_FP4 = 0, 1, 2
QAT_FP8_ROW, QAT_FP4_ROW, QAT_FP4_E4M3 = 3, 4, 5  # V4.1's roundings (the module's list)
V41_BLOCKS = {QAT_FP8_ROW: 32, QAT_FP4_ROW: 32, QAT_FP4_E4M3: 16}  # values per scale


@triton.jit
def round_to_grid(v, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round to nearest even on a float grid with MANT mantissa bits and smallest normal 2^MIN_EXP.

    The grid spacing at |v| is 2^(max(exponent, MIN_EXP) - MANT); v / spacing is exact and below
    2^(MANT + 1), and adding then subtracting 1.5 * 2^23 rounds it to an integer, ties to even.
    """
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP) - MANT
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.div_rn(v, spacing)
    return ((y + 12582912.0) - 12582912.0) * spacing


@triton.jit
def pow2_ceil(x):
    """Smallest power of two >= x for positive finite x (UE8M0 scales)."""
    bits = x.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _block_round(x, keep, BR: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, FMT_MAX: tl.constexpr,
                 FLOOR: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):  # fmt: skip
    # per block of BLOCK columns: scale = pow2ceil(max(amax, FLOOR) / FMT_MAX), round x / scale on the grid
    mag = tl.where(keep, tl.abs(x), 0.0)
    amax = tl.max(tl.reshape(mag, [BR, BD // BLOCK, BLOCK]), axis=2)
    scale = pow2_ceil(tl.maximum(amax, FLOOR) * (1.0 / FMT_MAX))
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BR, BD // BLOCK, BLOCK]), [BR, BD])
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FMT_MAX), FMT_MAX)
    return tl.where(keep, round_to_grid(v, MANT, MIN_EXP) * scale, x)


@triton.jit
def _block_round_e4m3(x, keep, BR: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
    # e2m1 per block of BLOCK columns with the scale e4m3(max(amax, 6 * 2^-9) / 6) (V4.1's compressed rows)
    mag = tl.where(keep, tl.abs(x), 0.0)
    amax = tl.maximum(tl.max(tl.reshape(mag, [BR, BD // BLOCK, BLOCK]), axis=2), 6.0 * 2.0**-9)
    scale = round_to_grid(amax * (1.0 / 6.0), 3, -6)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BR, BD // BLOCK, BLOCK]), [BR, BD])
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -6.0), 6.0)
    return tl.where(keep, round_to_grid(v, 1, 0) * scale, x)


@triton.jit
def _hadamard(x, half_ptr, BR: tl.constexpr, BD: tl.constexpr):
    """x @ H_BD / sqrt(BD) for the Sylvester H: with x = [a, b], it is [(a + b) M, (a - b) M] where
    M = H_{BD/2} / sqrt(BD), so the tensor cores stage a matrix a quarter the size of H_BD."""
    H2: tl.constexpr = BD // 2
    a, b = tl.split(tl.permute(tl.reshape(x, [BR, 2, H2]), (0, 2, 1)))
    k = tl.arange(0, H2)
    half = tl.load(half_ptr + k[:, None] * H2 + k[None, :])
    ya = tl.dot(a + b, half, input_precision="ieee")
    yb = tl.dot(a - b, half, input_precision="ieee")
    return tl.reshape(tl.permute(tl.join(ya, yb), (0, 2, 1)), [BR, BD])


@triton.jit
def rotate_pairs(x, cos, sin, BR: tl.constexpr, BD: tl.constexpr):
    """Rotate pairs (2i, 2i+1) of a [BR, BD] tile by [BR, BD / 2] angles (cos 1, sin 0 leaves a pair)."""
    a, b = tl.split(tl.reshape(x, [BR, BD // 2, 2]))
    return tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [BR, BD])


@triton.jit
def load_angles(cos_ptr, sin_ptr, tok, rows_ok, D, ROPE_DIM: tl.constexpr, INVERSE: tl.constexpr,
                BR: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """cos/sin [BR, BD / 2] for the pairs of D-wide rows of tokens `tok`; non-rope pairs get (1, 0)."""
    pair = tl.arange(0, BD // 2)
    first = (D - ROPE_DIM) // 2
    is_rope = (pair >= first) & (pair < D // 2)
    at = tok.to(tl.int64)[:, None] * (ROPE_DIM // 2) + (pair - first)[None, :]
    m = rows_ok[:, None] & is_rope[None, :]
    cos = tl.load(cos_ptr + at, mask=m, other=1.0)
    sin = tl.load(sin_ptr + at, mask=m, other=0.0)
    return cos, (-sin if INVERSE else sin)


@triton.jit
def finish_rows(x, m, w_ptr, cos, sin, had_ptr, D, eps, NORM: tl.constexpr, ROPE: tl.constexpr, QAT: tl.constexpr,
                ROPE_DIM: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """The epilogue of rows x [BR, BD] (m: the valid entries): RMSNorm (NORM 1 plain, 2 weighted),
    RoPE by cos/sin [BR or 1, BD / 2], then the QAT rounding."""
    cols = tl.arange(0, BD)
    if NORM != 0:
        x = x * rsqrt_rn(tl.div_rn(tl.sum(x * x, axis=1), D * 1.0) + eps)[:, None]
        if NORM == 2:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0)[None, :]
    if ROPE:
        x = rotate_pairs(x, cos, sin, BR, BD)
    if QAT == 1:  # KV: e4m3 on the nope dims, one scale per 64
        x = _block_round(x, m & (cols < D - ROPE_DIM)[None, :], BR, BD, 64, 448.0, 1e-4, 3, -6)
    elif QAT == 2:  # indexer: orthonormal Hadamard over the row, then e2m1, one scale per 32
        x = _block_round(_hadamard(x, had_ptr, BR, BD), m, BR, BD, 32, 6.0, 6.0 * 2.0**-126, 1, 0)
    elif QAT == 3:  # V4.1 window rows: e4m3 over the whole row, one scale per 32
        x = _block_round(x, m, BR, BD, 32, 448.0, 1e-4, 3, -6)
    elif QAT == 4:  # V4.1 index queries and keys: e2m1 per 32, no Hadamard
        x = _block_round(x, m, BR, BD, 32, 6.0, 6.0 * 2.0**-126, 1, 0)
    elif QAT == 5:  # V4.1 compressed rows: e2m1 per 16 with an e4m3 scale
        x = _block_round_e4m3(x, m, BR, BD, 16)
    return x


# pi / 2 in three parts (the first two of 33 significant bits: k * part is exact for the k < 2^20
# quarter turns of any angle below 1.6e6 radians, positions to a million at frequency 1)
PIO2_1 = tl.constexpr(float.fromhex("0x1.921fb544p+0"))
PIO2_2 = tl.constexpr(float.fromhex("0x1.0b4611a6p-34"))
PIO2_3 = tl.constexpr(float.fromhex("0x1.3198a2e037073p-69"))
TWO_OVER_PI = tl.constexpr(2 / math.pi)


@triton.jit
def _f64(value: tl.constexpr):
    """A float64 constant (a bare Python float meets a float64 tensor as float32 in Triton 3.6)."""
    return tl.full([], value, tl.float64)


@triton.jit
def _sin_cos(a):
    """sin and cos in float32 of float64 angles a >= 0, computed to float64 accuracy first."""
    k = tl.floor(a * _f64(TWO_OVER_PI) + 0.5)  # the nearest quarter turn: |r| <= pi / 4
    r = a - k * _f64(PIO2_1) - k * _f64(PIO2_2) - k * _f64(PIO2_3)
    r2 = r * r
    # Taylor series: the first omitted terms, r^19 / 19! and r^18 / 18!, are below 1e-17 at pi / 4
    s = _f64(1 / 355687428096000) - r2 * _f64(1 / 121645100408832000)
    s = _f64(1 / 6227020800) - r2 * (_f64(1 / 1307674368000) - r2 * s)
    s = _f64(1 / 120) - r2 * (_f64(1 / 5040) - r2 * (_f64(1 / 362880) - r2 * (_f64(1 / 39916800) - r2 * s)))
    s = r - r * r2 * (_f64(1 / 6) - r2 * s)
    c = _f64(1 / 87178291200) - r2 * _f64(1 / 20922789888000)
    c = _f64(1 / 40320) - r2 * (_f64(1 / 3628800) - r2 * (_f64(1 / 479001600) - r2 * c))
    c = 1.0 - r2 * (_f64(0.5) - r2 * (_f64(1 / 24) - r2 * (_f64(1 / 720) - r2 * c)))
    q = k.to(tl.int32) & 3  # sin(q pi / 2 + r), cos(q pi / 2 + r)
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin.to(tl.float32), cos.to(tl.float32)


@triton.jit
def rope_cos_sin(pos, inv_ptr, D, ROPE_DIM: tl.constexpr, INVERSE: tl.constexpr, BD: tl.constexpr):
    """cos/sin [R, BD / 2] at the positions `pos` [R] for the pairs of D-wide rows, from the layer's
    float64 inverse frequencies [ROPE_DIM / 2]; pairs before the rope dims get (1, 0)."""
    pair = tl.arange(0, BD // 2)
    first = (D - ROPE_DIM) // 2
    is_rope = (pair >= first) & (pair < D // 2)
    inv = tl.load(inv_ptr + pair - first, mask=is_rope, other=0.0)
    sin, cos = _sin_cos(pos.to(tl.float64)[:, None] * inv[None, :])
    return cos, (-sin if INVERSE else sin)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, had_ptr, out_ptr,
    n_rows, H, D, stride_xt, stride_xh, stride_ot, stride_oh, eps,
    NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, QAT: tl.constexpr,
    ROPE_DIM: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    # rows r = t * H + h of an x [T, H, D] view; one program handles BR rows of BD >= D columns.
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    tok, head = r // H, r % H
    cols = tl.arange(0, BD)
    rows_ok = r < n_rows
    m = rows_ok[:, None] & (cols < D)[None, :]
    x_off = tok.to(tl.int64)[:, None] * stride_xt + head[:, None] * stride_xh + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=m, other=0.0)
    cos, sin = x, x  # unused without RoPE
    if ROPE:
        cos, sin = load_angles(cos_ptr, sin_ptr, tok, rows_ok, D, ROPE_DIM, INVERSE, BR, BD)
    x = finish_rows(x, m, w_ptr, cos, sin, had_ptr, D, eps, NORM, ROPE, QAT, ROPE_DIM, BR, BD)
    o_off = tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
    tl.store(out_ptr + o_off, x, mask=m)


@functools.cache
def half_hadamard(n: int, device: torch.device) -> torch.Tensor:
    """H_{n/2} / sqrt(n): the block `_hadamard` multiplies by (cached: no host copy inside a CUDA graph)."""
    return (hadamard_matrix(n // 2) / 2**0.5).to(device)


def rms_norm_rope(
    x: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm: int = NORM_WEIGHTED,
    weight: torch.Tensor | None = None,
    angles: tuple[torch.Tensor, torch.Tensor] | None = None,
    inverse: bool = False,
    qat: int = QAT_NONE,
    rope_dim: int = 0,
) -> torch.Tensor:
    """x [T, H, D] or [T, D] (unit column stride) -> float32 of the same shape.

    `angles` = (cos, sin) [T, rope_dim / 2] turns RoPE on (`inverse` undoes it); `qat` picks the
    rounding.
    """
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, d = x3.shape
    out = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    o3 = out if out.dim() == 3 else out.unsqueeze(1)
    if x3.stride(2) != 1:
        raise ValueError("rows must have unit column stride")
    if norm == NORM_WEIGHTED and weight is None:
        raise ValueError("a weighted RMSNorm needs its weight")
    if qat == QAT_FP4 and d & (d - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two row, got {d}")
    bd = next_pow2(max(d, 64))
    n_rows = t * h
    if interpreting():
        br = min(next_pow2(n_rows), max(16, 16384 // bd))
    else:
        br = 16 if qat == QAT_FP4 else max(1, min(16, 4096 // bd))
    cos, sin = angles if angles is not None else (x, x)  # unused placeholders when RoPE is off
    had = half_hadamard(bd, x.device) if qat == QAT_FP4 else x
    _rms_norm_rope_kernel[(triton.cdiv(n_rows, br),)](
        x3, weight if weight is not None else x, cos, sin, had, o3,
        n_rows, h, d, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1), eps,
        NORM=norm, ROPE=angles is not None, INVERSE=inverse, QAT=qat, ROPE_DIM=rope_dim,
        BR=br, BD=bd,
        num_warps=4 if bd <= 1024 else 8, num_stages=1,
    )  # fmt: skip
    return out


@triton.jit
def _head_rows(x_ptr, out_ptr, p, blk, inv_ptr, had_ptr, eps, H, D, NORM: tl.constexpr, QAT: tl.constexpr,
               ROPE_DIM: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Heads blk * BR .. of one token's row x_ptr [H * D] at position p, finished into out_ptr [H, D]."""
    h = blk * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (h < H)[:, None] & (cols < D)[None, :]
    at = h[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0)
    cos, sin = rope_cos_sin(tl.zeros([1], tl.int32) + p, inv_ptr, D, ROPE_DIM, False, BD)
    x = finish_rows(x, m, x_ptr, cos, sin, had_ptr, D, eps, NORM, True, QAT, ROPE_DIM, BR, BD)
    tl.store(out_ptr + at, x, mask=m)


@triton.jit
def _query_rows_kernel(
    q_ptr, iq_ptr, pos_ptr, inv_ptr, had_ptr, q_out, iq_out, stride_q, stride_iq, eps,
    H, D, HI, DI, QAT_INDEX: tl.constexpr, ROPE_DIM: tl.constexpr,
    BR: tl.constexpr, BD: tl.constexpr, BRI: tl.constexpr, BDI: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # program (b, j): sequence b's query heads j * BR .. (the first cdiv(H, BR) programs), then its
    # indexer query heads
    b = tl.program_id(0)
    blk = tl.program_id(1)
    p = tl.load(pos_ptr + b)
    n_q = tl.cdiv(H, BR)
    if blk < n_q:
        _head_rows(
            q_ptr + b * stride_q, q_out + b * H * D, p, blk, inv_ptr, had_ptr, eps, H, D, 1, 0, ROPE_DIM, BR, BD
        )  # fmt: skip  (NORM_PLAIN, QAT_NONE)
    else:
        _head_rows(
            iq_ptr + b * stride_iq,
            iq_out + b * HI * DI,
            p,
            blk - n_q,
            inv_ptr,
            had_ptr,
            eps,
            HI,
            DI,
            0,
            QAT_INDEX,
            ROPE_DIM,
            BRI,
            BDI,
        )  # fmt: skip  (NORM_NONE)


def query_rows(
    q: torch.Tensor,
    index_q: torch.Tensor | None,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: tuple[int, int],
    index_heads: tuple[int, int],
    rope_dim: int,
    eps: float,
    qat: bool,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode step's query rows in one launch: q [B, H * D] (row stride free) -> its heads [B, H, D]
    RMS-normed (no weight) and rotated (into `out` when given); index_q [B, HI * DI] (ratio-4 layers,
    else None) -> [B, HI, DI] rotated, then Hadamard + FP4 with `qat`. pos int32 [B], inv_freq float64
    [rope_dim / 2]; `heads` = (H, D), `index_heads` = (HI, DI)."""
    (h, d), (hi, di) = heads, index_heads
    b = q.shape[0]
    q_out = torch.empty(b, h, d, device=q.device, dtype=torch.float32) if out is None else out
    iq_out = None if index_q is None else torch.empty(b, hi, di, device=q.device, dtype=torch.float32)
    if q.stride(1) != 1 or (index_q is not None and index_q.stride(1) != 1):
        raise ValueError("query rows must have unit column stride")
    if index_q is not None and qat and di & (di - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two row, got {di}")
    bd, bdi = next_pow2(max(d, 64)), next_pow2(max(di, 64))
    br, bri = (next_pow2(h), max(16, next_pow2(hi))) if interpreting() else (max(1, min(16, 4096 // bd)), 16)
    programs = triton.cdiv(h, br) + (0 if index_q is None else triton.cdiv(hi, bri))
    _query_rows_kernel[(b, programs)](
        q, index_q if index_q is not None else q, pos, inv_freq, half_hadamard(bdi, q.device), q_out,
        iq_out if iq_out is not None else q_out, q.stride(0), index_q.stride(0) if index_q is not None else 0, eps,
        h, d, hi, di, QAT_INDEX=QAT_FP4 if qat else QAT_NONE, ROPE_DIM=rope_dim, BR=br, BD=bd, BRI=bri, BDI=bdi,
        num_warps=4, num_stages=1, **dependent_launch(),
    )  # fmt: skip
    return q_out, iq_out


def reference_query_rows(q, index_q, pos, inv_freq, heads, index_heads, rope_dim, eps, qat):
    """`query_rows` by the reference ops, with the angles from `model.numerics.rope_angles`."""
    angles = rope_angles(pos.long(), inv_freq)
    q_out = reference(q.unflatten(1, heads), norm=NORM_PLAIN, eps=eps, angles=angles, rope_dim=rope_dim)
    if index_q is None:
        return q_out, None
    qat_index = QAT_FP4 if qat else QAT_NONE
    return q_out, reference(index_q.unflatten(1, index_heads), norm=NORM_NONE, angles=angles, rope_dim=rope_dim,
                            qat=qat_index)  # fmt: skip


def reference(
    x: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm: int = NORM_WEIGHTED,
    weight: torch.Tensor | None = None,
    angles: tuple[torch.Tensor, torch.Tensor] | None = None,
    inverse: bool = False,
    qat: int = QAT_NONE,
    rope_dim: int = 0,
) -> torch.Tensor:
    """The reference backend's ops in the same order."""
    y = x.float()
    if norm != NORM_NONE:
        y = ops.rms_norm(y, weight if norm == NORM_WEIGHTED else None, eps)
    if angles is not None:
        y = ops.apply_rope(y, *angles, inverse)
    if qat == QAT_FP8:
        y = ops.fp8_round_nope(y, rope_dim)
    elif qat == QAT_FP4:
        y = ops.indexer_round(y)
    elif qat == QAT_FP8_ROW:
        y = ops.fp8_round(y, V41_BLOCKS[qat])
    elif qat in V41_BLOCKS:
        y = ops.fp4_round(y, V41_BLOCKS[qat], e4m3_scale=qat == QAT_FP4_E4M3)
    return y


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Decode: the query heads (norm + RoPE) and the indexer query (RoPE + Hadamard + FP4); prefill:
    the chunk's raw KV rows (norm + RoPE + FP8); V4.1's roundings of its window, index and compressed rows."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    inv = torch.tensor(yarn_inv_freq(a, a.layer(a.n_layers - 1)), dtype=torch.float64, device=dev)
    cases = []
    for what, t, heads, d, kw in (
        ("decode query heads", 1, a.n_heads, a.head_dim, dict(norm=NORM_PLAIN)),
        ("decode indexer query", 1, a.index_n_heads, a.index_head_dim, dict(norm=NORM_NONE, qat=QAT_FP4)),
        ("prefill KV rows", shape.prefill, 1, a.head_dim, dict(weight=torch.ones(a.head_dim, device=dev), qat=QAT_FP8)),
        ("V4.1 prefill window rows", shape.prefill, 1, a.head_dim,
         dict(weight=torch.ones(a.head_dim, device=dev), qat=QAT_FP8_ROW)),
        ("V4.1 decode index query", 1, a.index_n_heads, a.index_head_dim, dict(norm=NORM_NONE, qat=QAT_FP4_ROW)),
        ("V4.1 compressed rows", shape.prefill // 2, 1, a.head_dim, dict(norm=NORM_NONE, qat=QAT_FP4_E4M3)),
    ):  # fmt: skip
        x = torch.randn(t, heads, d, device=dev, generator=gen)
        angles = rope_angles(torch.arange(t, device=dev) + shape.ctx, inv)
        run = functools.partial(rms_norm_rope, x, angles=angles, rope_dim=a.rope_dim, **kw)
        cases.append(BenchCase("rms_norm_rope", f"{what} {t}x{heads}x{d}", run, 8 * x.numel()))
    engram = torch.randn(shape.prefill, 24 * 256, device=dev, generator=gen)  # V4.1's Engram rows, 24 of 256
    run = functools.partial(rms_norm_rope, engram, norm=NORM_NONE, qat=QAT_FP8_ROW)
    cases.append(BenchCase("rms_norm_rope", f"V4.1 prefill Engram rows {tuple(engram.shape)}", run, 8 * engram.numel()))
    b = 8
    q = torch.randn(b, a.n_heads * a.head_dim, device=dev, generator=gen)
    index_q = torch.randn(b, a.index_n_heads * a.index_head_dim, device=dev, generator=gen)
    pos = torch.arange(shape.ctx, shape.ctx + b, dtype=torch.int32, device=dev)
    heads, index_heads = (a.n_heads, a.head_dim), (a.index_n_heads, a.index_head_dim)
    run = functools.partial(query_rows, q, index_q, pos, inv, heads, index_heads, a.rope_dim, a.norm_eps, True)
    cases.append(BenchCase("rms_norm_rope", f"decode batch of {b}: query and indexer query rows", run,
                           8 * (q.numel() + index_q.numel())))  # fmt: skip
    return cases
