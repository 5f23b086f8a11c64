"""RMSNorm, then RoPE on the tail dims, then the QAT rounding, fused over rows of heads.

One kernel covers every per-row epilogue of the attention path (spec §2.1, §9):
* qr = RMSNorm(q_a; q_norm)                               norm only
* q heads: unweighted RMSNorm, RoPE                       (YaRN lives in the cos/sin tables)
* raw KV row: RMSNorm(kv_norm), RoPE, FP8 on the nope dims
* compressed KV row: RMSNorm(compressor norm), RoPE at the window's first position, FP8
* indexer row / indexer query: [RMSNorm], RoPE, Hadamard, FP4

RoPE rotates interleaved pairs of the last `rope_dim` dims; the pairs are split out of the register
tile with reshape + split, and pairs before the rope dims get cos 1 / sin 0. Angles come in as
cos/sin tables [tokens, rope_dim / 2], built in float64 by `reference.ops.rope_angles` on the device
(a float32 product of position and frequency loses whole radians at million-token positions).

The QAT roundings are exact: a power-of-two block scale (UE8M0) and round-to-nearest-even on the
e4m3 / e2m1 grid done in integer and float arithmetic that the interpreter and every GPU agree on
(no fp8 conversion instruction, which ROCm and older GPUs lack).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2
from dwarfstar.model.config import yarn_inv_freq

NORM_NONE, NORM_PLAIN, NORM_WEIGHTED = 0, 1, 2
QAT_NONE, QAT_FP8, QAT_FP4 = 0, 1, 2


@triton.jit
def round_to_grid(v, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round to nearest even on a float grid with MANT mantissa bits and smallest normal 2^MIN_EXP.

    The grid spacing at |v| is 2^(max(exponent, MIN_EXP) - MANT); v / spacing is exact and below
    2^(MANT + 1), and adding then subtracting 1.5 * 2^23 rounds it to an integer, ties to even.
    """
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP) - MANT
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    y = v / spacing
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
    v = tl.minimum(tl.maximum(x / scale, -FMT_MAX), FMT_MAX)
    return tl.where(keep, round_to_grid(v, MANT, MIN_EXP) * scale, x)


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
    if NORM != 0:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        if NORM == 2:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0)[None, :]
    if ROPE:
        cos, sin = load_angles(cos_ptr, sin_ptr, tok, rows_ok, D, ROPE_DIM, INVERSE, BR, BD)
        x = rotate_pairs(x, cos, sin, BR, BD)
    if QAT == 1:  # KV: e4m3 on the nope dims, one scale per 64
        x = _block_round(x, m & (cols < D - ROPE_DIM)[None, :], BR, BD, 64, 448.0, 1e-4, 3, -6)
    elif QAT == 2:  # indexer: orthonormal Hadamard over the row, then e2m1, one scale per 32
        x = _block_round(_hadamard(x, had_ptr, BR, BD), m, BR, BD, 32, 6.0, 6.0 * 2.0**-126, 1, 0)
    o_off = tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
    tl.store(out_ptr + o_off, x, mask=m)


@functools.cache
def half_hadamard(n: int, device: torch.device) -> torch.Tensor:
    """H_{n/2} / sqrt(n): the block `_hadamard` multiplies by (cached: no host copy inside a CUDA graph)."""
    return (ops._hadamard_matrix(n // 2) / 2**0.5).to(device)


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
    return y


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Decode: the query heads (norm + RoPE) and the indexer query (RoPE + Hadamard + FP4); prefill:
    the chunk's raw KV rows (norm + RoPE + FP8)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    inv = torch.tensor(yarn_inv_freq(a, a.layer(a.n_layers - 1)), dtype=torch.float64, device=dev)
    cases = []
    for what, t, heads, d, kw in (
        ("decode query heads", 1, a.n_heads, a.head_dim, dict(norm=NORM_PLAIN)),
        ("decode indexer query", 1, a.index_n_heads, a.index_head_dim, dict(norm=NORM_NONE, qat=QAT_FP4)),
        ("prefill KV rows", shape.prefill, 1, a.head_dim, dict(weight=torch.ones(a.head_dim, device=dev), qat=QAT_FP8)),
    ):
        x = torch.randn(t, heads, d, device=dev, generator=gen)
        angles = ops.rope_angles(torch.arange(t, device=dev) + shape.ctx, inv)
        run = functools.partial(rms_norm_rope, x, angles=angles, rope_dim=a.rope_dim, **kw)
        cases.append(BenchCase("rms_norm_rope", f"{what} {t}x{heads}x{d}", run, 8 * x.numel()))
    return cases
