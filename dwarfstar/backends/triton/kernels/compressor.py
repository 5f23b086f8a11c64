"""KV compressor: softmax-gated pooling of windows into rows, and the frontier update in place.

Spec §2.3.1 and the state layout of `dwarfstar.model.state`. A chunk of T tokens at positions
p0..p0+T-1 brings projected values u and gate logits g [T, c*d] (c = 2 for the overlapping ratio-4
compressor, 1 for ratio 128). Seen as one sequence, the frontier rows and the chunk rows are
consecutive tokens: frontier row v holds token p0 - F + v (F = pending tokens, plus the previous
window for ratio 4), chunk row i holds token p0 + i. Every kernel below addresses tokens that way.

* `_pool_kernel`, one program per (completed window, column block): ratio 128 pools the window's 128
  tokens; ratio 4 pools 8 slots per column, the first half of the previous window's 4 tokens (their
  columns [0, d)) and the second half of the window's own 4 (columns [d, 2d)). Gates of chunk tokens
  get the position bias ape[p mod ratio] added here; frontier gates already hold it. Before window 0
  the frontier gates are -inf, which gives those slots weight 0.
* `_frontier_kernel`: rewrites the frontier for the new position (previous window, then the window
  in progress; slots not yet reached get kv 0 and gate -inf). Each program reads its whole column
  block before writing, and runs after the pool launch, so updating in place is safe.

The pooled rows then go through RMSNorm, RoPE at the window's first position and the FP8 / FP4
rounding (`rms_norm_rope`), written straight into the row buffer. The position comes from a device
scalar. A batch-native decode step advances its compressors in `decode_rows`' launch instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference.ops import compress as reference_compress
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2
from dwarfstar.model.state import CompressorSpec


@triton.jit
def _token_rows(kv_ptr, gate_ptr, u_ptr, g_ptr, ape_ptr, tok, col, p0, T, F, stride_chunk, width,
                RATIO: tl.constexpr):  # fmt: skip
    """kv and gate (with position bias) of tokens `tok` [NS, 1] < p0 + T at columns `col` [NS, BC]."""
    v = tok - p0 + F  # index in the virtual sequence frontier ++ chunk
    in_chunk = tok >= p0
    ok = (col < width) & (tok < p0 + T)
    row = tl.where(in_chunk, tok - p0, 0).to(tl.int64)
    frow = tl.where(in_chunk, 0, v).to(tl.int64)
    kv = tl.where(in_chunk, tl.load(u_ptr + row * stride_chunk + col, mask=in_chunk & ok, other=0.0),
                  tl.load(kv_ptr + frow * width + col, mask=(~in_chunk) & ok, other=0.0))  # fmt: skip
    gate = tl.load(g_ptr + row * stride_chunk + col, mask=in_chunk & ok, other=0.0)
    gate += tl.load(ape_ptr + (tok % RATIO) * width + col, mask=in_chunk & ok, other=0.0)
    gate = tl.where(in_chunk, gate, tl.load(gate_ptr + frow * width + col, mask=(~in_chunk) & ok, other=0.0))
    return kv, gate


@triton.jit
def _pool_kernel(
    kv_ptr, gate_ptr, u_ptr, g_ptr, ape_ptr, pos_ptr, out_ptr, T, stride_chunk, D,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    p0 = tl.load(pos_ptr)
    w = p0 // RATIO + tl.program_id(0)  # window completed by this chunk
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    width = 2 * D if OVERLAP else D
    F = p0 % RATIO + (RATIO if OVERLAP else 0)
    if OVERLAP:  # 8 slots: previous window's first half, this window's second half
        i = tl.arange(0, 2 * RATIO)
        tok = RATIO * (w - 1) + i
        col = c[None, :] + tl.where(i < RATIO, 0, D)[:, None]
    else:
        i = tl.arange(0, RATIO)
        tok = RATIO * w + i
        col = c[None, :] + 0 * i[:, None]
    kv, gate = _token_rows(kv_ptr, gate_ptr, u_ptr, g_ptr, ape_ptr, tok[:, None], col, p0, T, F, stride_chunk,
                           width, RATIO)  # fmt: skip
    gate = tl.where((c < D)[None, :], gate, 0.0)
    weight = tl.exp(gate - tl.max(gate, axis=0)[None, :])
    weight = tl.div_rn(weight, tl.sum(weight, axis=0)[None, :])
    tl.store(out_ptr + tl.program_id(0) * D + c, tl.sum(kv * weight, axis=0), mask=c < D)


@triton.jit
def _frontier_kernel(
    kv_ptr, gate_ptr, u_ptr, g_ptr, ape_ptr, pos_ptr, T, stride_chunk, width,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, NROWS: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    p0 = tl.load(pos_ptr)
    p1 = p0 + T
    F = p0 % RATIO + (RATIO if OVERLAP else 0)
    r = tl.arange(0, NROWS)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    first = RATIO * (p1 // RATIO - (1 if OVERLAP else 0))  # token held by the new frontier's row 0
    tok = (first + r)[:, None]
    col = c[None, :] + 0 * r[:, None]
    kv, gate = _token_rows(kv_ptr, gate_ptr, u_ptr, g_ptr, ape_ptr, tok, col, p0, T, F, stride_chunk, width, RATIO)
    seen = tok < p1
    ok = col < width
    tl.store(kv_ptr + r[:, None] * width + col, tl.where(seen, kv, 0.0), mask=ok)
    tl.store(gate_ptr + r[:, None] * width + col, tl.where(seen, gate, float("-inf")), mask=ok)


def compress_chunk(
    u: torch.Tensor,
    g: torch.Tensor,
    ape: torch.Tensor,
    frontier_kv: torch.Tensor,
    frontier_gate: torch.Tensor,
    pos: torch.Tensor,
    n_emit: int,
    ratio: int,
) -> torch.Tensor:
    """Pool the `n_emit` windows this chunk completes and advance the frontier in place.

    u, g [T, c*d] (row stride free), ape [ratio, c*d], frontier [c*ratio, c*d], pos int32 [1] = p0 on
    the device. Returns the pooled rows [n_emit, d] before their norm / RoPE / rounding.
    """
    t, width = u.shape
    overlap = ratio == 4
    d = width // 2 if overlap else width
    if u.stride(1) != 1 or g.stride(1) != 1 or u.stride(0) != g.stride(0):
        raise ValueError("u and g must be column slices of one buffer")
    pooled = torch.empty(n_emit, d, device=u.device, dtype=torch.float32)
    common = dict(RATIO=ratio, OVERLAP=overlap, num_warps=4)
    bc = next_pow2(d) if interpreting() else max(16, min(128, 4096 // (2 * ratio if overlap else ratio)))
    if n_emit:
        _pool_kernel[(n_emit, triton.cdiv(d, bc))](
            frontier_kv, frontier_gate, u, g, ape, pos, pooled, t, u.stride(0), d, BC=bc, **common
        )
    rows = frontier_kv.shape[0]
    bc = next_pow2(width) if interpreting() else max(16, min(256, 4096 // rows))
    _frontier_kernel[(triton.cdiv(width, bc),)](
        frontier_kv, frontier_gate, u, g, ape, pos, t, u.stride(0), width, NROWS=rows, BC=bc, **common
    )
    return pooled


def emitted(p0: int, t: int, ratio: int) -> int:
    """How many windows the chunk [p0, p0 + t) completes."""
    return (p0 + t) // ratio - p0 // ratio


def reference(
    u: torch.Tensor,
    g: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    spec: CompressorSpec,
    front: tuple[torch.Tensor, torch.Tensor],
    p0: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference compressor on the same projections: the new rows after RMSNorm, and the new
    frontier (kv, gate)."""
    return reference_compress(spec, *front, u, g, ape, norm, p0, eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """A decode step that completes a window, for each ratio (pooling 2, 8 or 128 slots, then the frontier)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    cases = []
    for ratio in (2, 4, 128):  # 2: V4.1's pooling (no overlap)
        shape = CompressorSpec("attn", ratio, a.head_dim).frontier_shape
        width = shape[1]
        front_kv = torch.randn(shape, device=dev, generator=gen)
        front_gate = torch.randn(shape, device=dev, generator=gen)
        ug = torch.randn(1, 2 * width, device=dev, generator=gen)
        ape = torch.randn(ratio, width, device=dev, generator=gen)
        pos = torch.tensor([ratio * 10 - 1], dtype=torch.int32, device=dev)  # completes window 9
        run = functools.partial(compress_chunk, ug[:, :width], ug[:, width:], ape, front_kv, front_gate, pos, 1, ratio)
        moved = 4 * (3 * front_kv.numel() + 2 * width + a.head_dim)
        cases.append(BenchCase("compressor", f"decode step emitting a ratio-{ratio} row", run, moved))
    return cases
