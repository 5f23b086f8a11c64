"""Fused dequantize + matrix product over GGUF blocks: GEMV for decode, GEMM for prefill.

y[m, n] = sum_k x[m, k] * W[n, k], W read as GGUF blocks (F32/F16/BF16/Q8_0/Q2_K/Q4_K/IQ2_XXS) in
the aligned layout of `weights.repack` and decoded in registers.

Decode GEMV (`gemv`, up to GEMV_MAX_ROWS rows of x): bound by memory, each weight byte read once per
step, so the kernel is built to keep the bytes coming with as few instructions as possible.
* The vector formats (F32/F16/BF16/Q8_0) go through `load_vector_tile`: a program owns R weight rows
  and walks K in passes of BK = warp size x VE columns (one warp); each thread loads, per row, one 128-bit
  vector of VE consecutive columns (a Q8_0 half-block is 16 quants) and the activations of those
  columns (x stays fp32: the products are exact fp32 products, as the reference's). The rows are a
  static loop, so a thread loads each activation vector once for its R rows and has R x 16 bytes of
  weights in flight per pass. A vector's VE products are chained as fused multiply-adds inside the
  thread (`_chain`) into one partial sum per (row, activation row) and vector position: the
  accumulators [NV, R * BM] keep the layout of the loads, so nothing crosses threads in the K loop,
  and the warp reduces across its lanes once, after it. Q8_0's quants widen to float32 by a
  byte permute and an add (`int8_to_float`: Hopper's conversion unit would bound the stream), its
  fp16 scale multiplies each vector's sum, once per 16 products. The main loop runs whole passes
  without masks; a ragged K end is one masked pass after it.
* The super-block formats (Q2_K/Q4_K/IQ2_XXS, whose decoders are shared with the expert kernels) and
  Triton's interpreter (large programs: numpy runs them whole) take the block path: `load_weight_tile`
  decodes [R, BK] and the product reduces per pass.
* Split-K: where the rows are too few to keep the chip's bytes in flight (IN_FLIGHT saturates an
  H200's HBM), S programs share a row block, each over about K/S columns. They finish in the same
  launch: each writes its partial sums, then takes a ticket (an atomic counter per row block, acq_rel
  at GPU scope); the program that draws the last ticket adds the S partials in split order
  (deterministic), writes y and puts the counter back to zero for the next launch or graph replay.
* The rows, warps and split come from `gemv_plan` (M, N, K, block type, multiprocessors), chosen
  ahead of time: nothing is autotuned, a cold start compiles one variant per shape.
* One launch serves two weights of different block types that read the same x (`project`, for a
  `FusedLinear`: the attention's Q8_0 q_a+kv with its F16 compressor and indexer projections, Q8_0
  q_b with the F16 indexer q_b): programs [0, P0) run the first weight, the rest the second, each
  with its own constexpr block type and plan, writing its columns of one output.

Prefill GEMM (9..16 rows): BM x BN output tiles through `tl.dot`, IEEE fp32 operands for exact
results or bf16 operands (fp32 accumulation) with `Precision.fast`. Longer chunks decode the weight
once into a float32 (exact) or bf16 (fast) scratch with the block decoder and hand it to the vendor
GEMM (`torch.bmm`: cuBLAS, hipBLASLt), whose tiling beats decoding the weight again in every tile.

Groups: the grouped low-rank attention output (wo_a) is G independent products, group g taking
columns [g*K, (g+1)*K) of each x row and weight rows [g*N, (g+1)*N). `qmatmul(split_k=S)` returns
the S partial sums [S, M, N] unfinished, for callers that add them in their own kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.quant_blocks import (
    VECTOR_ELEMENTS,
    compiles_ptx,
    dequantize_rows,
    gemv_tile,
    grid_table,
    load_columns,
    load_vector_tile,
    load_weight_tile,
    tile_k,
    warp_size,
)
from dwarfstar.backends.triton.runtime import (
    EXACT,
    FAST,
    BenchCase,
    BenchShape,
    KernelWork,
    Precision,
    dependent_launch,
    interpreting,
    last_program,
    multiprocessors,
    next_pow2,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.backends.triton.weights import QWeight, aligned_row_bytes, random_qweight
from dwarfstar.gguf.constants import QK_K, GGMLType

GEMV_MAX_ROWS = 8  # above this many activation rows the tensor-core GEMM wins
# from this many rows on (prefill chunks) decoding the weight once into a scratch and calling the
# vendor GEMM (cuBLAS, hipBLASLt) beats decoding it in every output tile, as llama.cpp finds above 16
VENDOR_GEMM_MIN_ROWS = 17
IN_FLIGHT = 3_400_000  # bytes of weights in flight over the chip that saturate an H200's HBM
MAX_SPLIT = 64

_scratch: dict[tuple, torch.Tensor] = {}


# -- decode GEMV -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemvPlan:
    """How one weight is walked: `rows` per program, `block_k` columns per pass, `split` programs per
    row block along K, `vector` the 16-byte-vector path (else the block decoders), `warps`."""

    rows: int
    block_k: int
    split: int
    vector: bool
    warps: int


def _resident(plan: GemvPlan, bm: int, ve: int) -> int:
    """Programs one SM keeps resident: 32, 2048 threads, 64K registers (a vector-path thread holds
    about 32 + R * BM * VE / 2 of them: its weights and activations in flight; measured on sm_90)."""
    registers = 32 + plan.rows * bm * ve // 2 if plan.vector else 64
    return max(1, min(32, 64 // plan.warps, 65536 // (registers * 32 * plan.warps)))


def gemv_plan(m: int, n: int, k: int, ggml_type: GGMLType, groups: int = 1, sms: int = 132, warps: int = 0) -> GemvPlan:
    """The GEMV tile for x [m, k] times a [groups * n, k] weight, chosen ahead of time.

    Vector formats: 4 rows a program (2 from 3 activation rows on, for registers: at 4 activation rows
    4 weight rows held 168 registers, 19% occupancy on the H200, 35 us a launch against 14 for one
    activation row; 2 hold 128), each thread 16 bytes per row and pass, one warp: BK = 32 x VE columns a
    pass, so a row's K takes many passes for the one reduction across the warp's lanes at the end
    (about 200 to 400 instructions; with more warps a program's rows take fewer passes and that
    reduction weighs more), and no shared memory.
    The super-block formats take the block decoders' tile (`gemv_tile`). Then K is split in powers of
    two, while every split keeps two whole passes or more (a split's reduction and ticket cost about
    what a pass does), until the programs resident on `sms` multiprocessors have IN_FLIGHT bytes of
    weights in flight, or the whole weight. `warps` forces the warp count (a two-segment launch has one).

    Batch invariance (issue 37): everything that orders a product's K reduction (the pass width, the
    split, the warps, the path; for the super-block formats also the rows, whose [rows, BK] tile the
    reduction's layout follows) is the one-row plan's, whatever m: a row's output has the same bits
    decoded alone as beside other rows. Only the vector path's rows per program follow m.
    """
    bm = min(GEMV_MAX_ROWS, next_pow2(m))
    if interpreting():  # few, large programs: numpy runs the whole block at once (at most 2^20 elements)
        bk = tile_k(ggml_type, k)
        return GemvPlan(min(next_pow2(n), 1024, (1 << 20) // (bm * bk)), bk, 1, False, 1)
    plan = _one_row_plan(n, k, ggml_type, groups, sms, warps)
    return replace(plan, rows=min(4 if bm <= 2 else 2, next_pow2(n))) if plan.vector else plan


def _one_row_plan(n: int, k: int, ggml_type: GGMLType, groups: int, sms: int, warps: int) -> GemvPlan:
    """`gemv_plan` for one activation row on a GPU."""
    warp, ve = warp_size(), VECTOR_ELEMENTS.get(ggml_type)
    if ve is None:
        rows, w = gemv_tile(1, n, ggml_type, QK_K)
        plan = GemvPlan(rows, QK_K, 1, False, warps or w)
    else:
        w = warps or 1
        plan = GemvPlan(min(4, next_pow2(n)), warp * w * ve, 1, True, w)
    row_bytes = aligned_row_bytes(ggml_type, k)
    pass_bytes = plan.rows * plan.block_k * row_bytes // k
    tiles = groups * triton.cdiv(n, plan.rows)
    target = min(IN_FLIGHT, groups * n * row_bytes)
    resident = sms * _resident(plan, 1, ve or 1)  # more programs than this wait for a free SM
    split = 1
    while split < MAX_SPLIT and k >= 4 * split * plan.block_k and tiles * split < resident:
        if tiles * split * pass_bytes >= target:
            break
        split *= 2
    return replace(plan, split=split)


@triton.jit
def _chain(x, w, acc, L: tl.constexpr):
    """acc [N, 1] + the dot products of x and w [N, 1, L] along L (in-thread), one fused multiply-add
    after the other (a reduction tree would cost a multiply and an add per product)."""
    if L == 1:
        out = tl.fma(tl.reshape(x, acc.shape), tl.reshape(w, acc.shape), acc)
    else:
        x0, x1 = tl.split(tl.reshape(x, [x.shape[0], 1, L // 2, 2]))
        w0, w1 = tl.split(tl.reshape(w, [w.shape[0], 1, L // 2, 2]))
        out = _chain(x1, w1, _chain(x0, w0, acc, L // 2), L // 2)
    return out


@triton.jit
def _vector_pass(acc, x_ptr, x_row0, stride_xm, M, w_ptr, w_row0, row_end, row_bytes, k0, k_end, K,
                 WTYPE: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, NV: tl.constexpr, VE: tl.constexpr,
                 MASKED: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    # acc [NV, R * BM]: column r * BM + m holds weight row r times activation row m, per vector
    # position. Rows past row_end re-read the last one, rows of x past M row M - 1 (never stored).
    kv = k0 + tl.arange(0, NV) * VE
    col = kv[:, None] + tl.arange(0, VE)[None, :]
    which = tl.arange(0, R * BM)[None, :]
    for r in tl.static_range(R):
        row_off = tl.minimum(w_row0 + r, row_end - 1).to(tl.int64) * row_bytes
        w, scale = load_vector_tile(w_ptr, row_off, kv, K, k_end, WTYPE, VE, MASKED, PTX)
        for m in tl.static_range(BM):
            x = load_columns(x_ptr + tl.minimum(x_row0 + m, M - 1).to(tl.int64) * stride_xm, col, k_end, MASKED)
            dot = _chain(tl.reshape(x, [NV, 1, VE]), tl.reshape(w, [NV, 1, VE]), tl.zeros([NV, 1], tl.float32), VE)
            acc += tl.where(which == r * BM + m, dot * scale, -0.0)
    return acc


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, R: tl.constexpr, S: tl.constexpr):
    """(split, group, first weight row, first activation row) of program `pid` of a segment: the split
    varies fastest, then the row block, the m-tile, the group."""
    tile = pid // S
    blocks = tl.cdiv(N, R)
    mt = (tile // blocks) % tl.cdiv(M, BM)
    return pid % S, tile // (blocks * tl.cdiv(M, BM)), tile % blocks * R, mt * BM


@triton.jit
def _prefetch(pid, M, w_ptr, N, row_bytes, BM: tl.constexpr, R: tl.constexpr, S: tl.constexpr):
    """Ask L2 for program `pid`'s share of its weight rows: a bulk prefetch (sm_90's TMA) of each row's
    share, its operands the same in every lane (one instruction a warp). Issued ahead of
    `wait_for_inputs`: the weights depend on no kernel, so with a dependent launch they move from HBM
    to L2 while the kernel before finishes, and the GEMV's loads find them there."""
    for r in tl.static_range(R):
        start, size = prefetch_range(pid, r, M, N, row_bytes, BM, R, S)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } // dummy $0",
            "=r,l,r", [w_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def prefetch_range(pid, r, M, N, row_bytes, BM: tl.constexpr, R: tl.constexpr, S: tl.constexpr):
    """(start, size) in bytes of what `_prefetch` asks for row r of program `pid`: split s of S takes the
    s-th share, in 16-byte multiples, of the row (so a row block's splits cover it); size 0 past the
    weight's last row. Rows are 16-byte multiples long."""
    s, g, row0, _ = _tile(pid, M, N, BM, R, S)
    share = tl.cdiv(tl.cdiv(row_bytes, S), 16) * 16
    size = tl.minimum(tl.maximum(row_bytes - s * share, 0), share)
    row = (g * N + tl.minimum(row0 + r, N - 1)).to(tl.int64)
    return row * row_bytes + s * share, tl.where(row0 + r < N, size, 0)


@triton.jit
def _segment(
    pid, first_pid, x_ptr, stride_xm, M, K, y_ptr, stride_ym, y_col, part_ptr, count_ptr, grid_ptr,
    w_ptr, N, row_bytes,
    WTYPE: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
    S: tl.constexpr, VECTOR: tl.constexpr, VE: tl.constexpr, TAIL: tl.constexpr, PARTIALS: tl.constexpr,
    RBMAX: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    s, g, row0, m0 = _tile(pid, M, N, BM, R, S)
    x_base = x_ptr + g * K  # group g reads columns [g * K, (g + 1) * K) of x and weight rows g * N + n
    k_per_split = tl.cdiv(tl.cdiv(K, S), BK) * BK
    k_lo = s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if VECTOR:
        NV: tl.constexpr = BK // VE
        acc = tl.zeros([NV, R * BM], dtype=tl.float32)
        w_row0 = g * N + row0
        k_full = k_lo + tl.maximum(k_hi - k_lo, 0) // BK * BK
        for k0 in range(k_lo, k_full, BK):
            acc = _vector_pass(acc, x_base, m0, stride_xm, M, w_ptr, w_row0, g * N + N, row_bytes, k0, k_hi, K,
                               WTYPE, R, BM, NV, VE, False, PTX)  # fmt: skip
        if TAIL and k_full < k_hi:  # K ends inside a pass (compiled only then)
            acc = _vector_pass(acc, x_base, m0, stride_xm, M, w_ptr, w_row0, g * N + N, row_bytes, k_full, k_hi, K,
                               WTYPE, R, BM, NV, VE, True, PTX)  # fmt: skip
        out = tl.sum(acc, axis=0)
    else:
        rr = tl.arange(0, R)
        offs = (g * N + tl.minimum(row0 + rr, N - 1)).to(tl.int64) * row_bytes
        acc = tl.zeros([R, BM], dtype=tl.float32)
        which = tl.arange(0, BM)[None, :]
        for k0 in range(k_lo, k_hi, BK):
            ks = k0 + tl.arange(0, BK)
            w = load_weight_tile(w_ptr, grid_ptr, offs, k0, K, WTYPE, R, BK)
            # each activation row reduces its own [R, BK] product (the same tile whatever BM), so its
            # sums do not depend on the rows beside it; adding -0.0 leaves the other columns' bits
            for m in tl.static_range(BM):
                x = tl.load(x_base + tl.minimum(m0 + m, M - 1).to(tl.int64) * stride_xm + ks, mask=ks < k_hi, other=0.0)
                acc += tl.where(which == m, tl.sum(w * x[None, :], axis=1)[:, None], -0.0)
        out = tl.reshape(acc, [R * BM])
    c = tl.arange(0, R * BM)
    rows = row0 + c // BM
    ms = m0 + c % BM
    y = y_ptr + ms * stride_ym + y_col + g * N + rows
    ok = (rows < N) & (ms < M)
    if S == 1:
        tl.store(y, out, mask=ok)
    elif PARTIALS:  # y is [S, M, stride_ym]: the caller adds the splits
        tl.store(y + s * M * stride_ym, out, mask=ok)
    else:
        me = first_pid + pid
        tl.store(part_ptr + me * RBMAX + c, out)
        head = me - s
        if last_program(count_ptr + head, S):  # the last split of the row block adds all of them, in split order
            total = tl.load(part_ptr + head * RBMAX + c, cache_modifier=".cg")
            for i in tl.static_range(1, S):
                total += tl.load(part_ptr + (head + i) * RBMAX + c, cache_modifier=".cg")
            tl.store(y, total, mask=ok)


@triton.jit
def _qmatmul_kernel(
    x_ptr, stride_xm, M, K, y_ptr, stride_ym, part_ptr, count_ptr, grid_ptr,
    w0_ptr, N0, row_bytes0, w1_ptr, N1, row_bytes1,
    GROUPS: tl.constexpr, BM: tl.constexpr, PARTIALS: tl.constexpr, RBMAX: tl.constexpr, PTX: tl.constexpr,
    WTYPE0: tl.constexpr, R0: tl.constexpr, BK0: tl.constexpr, S0: tl.constexpr, VECTOR0: tl.constexpr,
    VE0: tl.constexpr, TAIL0: tl.constexpr,
    TWO: tl.constexpr, WTYPE1: tl.constexpr, R1: tl.constexpr, BK1: tl.constexpr, S1: tl.constexpr,
    VECTOR1: tl.constexpr, VE1: tl.constexpr, TAIL1: tl.constexpr, PF0: tl.constexpr, PF1: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # the decode GEMV: programs [0, P0) the first weight, the rest the second (TWO), which writes
    # output columns N0.. of the same y
    pid = tl.program_id(0)
    p0 = GROUPS * tl.cdiv(N0, R0) * tl.cdiv(M, BM) * S0
    if PDL:  # the weights first (`_prefetch`), then what the kernels before wrote
        if pid < p0:
            if PF0:
                _prefetch(pid, M, w0_ptr, N0, row_bytes0, BM, R0, S0)
        elif TWO:
            if PF1:
                _prefetch(pid - p0, M, w1_ptr, N1, row_bytes1, BM, R1, S1)
    wait_for_inputs(PDL)
    if pid < p0:
        _segment(pid, 0, x_ptr, stride_xm, M, K, y_ptr, stride_ym, 0, part_ptr, count_ptr, grid_ptr,
                 w0_ptr, N0, row_bytes0,
                 WTYPE0, GROUPS, BM, R0, BK0, S0, VECTOR0, VE0, TAIL0, PARTIALS, RBMAX, PTX)  # fmt: skip
    elif TWO:
        _segment(pid - p0, p0, x_ptr, stride_xm, M, K, y_ptr, stride_ym, N0, part_ptr, count_ptr, grid_ptr,
                 w1_ptr, N1, row_bytes1,
                 WTYPE1, 1, BM, R1, BK1, S1, VECTOR1, VE1, TAIL1, PARTIALS, RBMAX, PTX)  # fmt: skip


def _programs(m: int, n: int, groups: int, plan: GemvPlan) -> int:
    return groups * triton.cdiv(n, plan.rows) * triton.cdiv(m, min(GEMV_MAX_ROWS, next_pow2(m))) * plan.split


def _ticket_scratch(device: torch.device, programs: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums [programs, slots] and the split tickets (int32, zero; each row block's finisher
    puts its counter back to zero), one pair per device and size: allocated on first use (the eager
    step before a graph capture), then the same memory at every launch and replay."""
    key = (device, "gemv", programs, slots)
    if key not in _scratch:
        _scratch[key] = torch.empty(programs * slots, device=device, dtype=torch.float32)
    return _scratch[key], ticket_counters(device, "gemv", programs)


def _segment_args(w: QWeight, plan: GemvPlan) -> dict:
    return {
        "WTYPE": w.wtype, "R": plan.rows, "BK": plan.block_k, "S": plan.split, "VECTOR": plan.vector,
        "VE": VECTOR_ELEMENTS.get(w.ggml_type, 1), "TAIL": w.cols % plan.block_k != 0,
        "PF": w.row_bytes % 16 == 0,  # `_prefetch`'s bulk ranges are 16-byte multiples
    }  # fmt: skip


def gemv(
    x: torch.Tensor, weights: list[QWeight], groups: int = 1, plans: list[GemvPlan] | None = None, partials: int = 0
) -> torch.Tensor:
    """x [M, groups * K] float32 times one or two weights [N_i, K] (one launch): y [M, sum N_i], the
    weights' products side by side; `groups` for one weight. `plans` overrides `gemv_plan` (tests);
    `partials` = S returns the S unfinished split sums [S, M, N] of one weight instead."""
    m, k = x.shape[0], weights[0].cols
    if len(weights) > 2 or any(w.cols != k for w in weights) or (groups > 1 and len(weights) > 1):
        raise ValueError("gemv takes one weight (optionally grouped) or two of the same width")
    ns = [w.rows // groups for w in weights]
    if plans is None:
        sms = multiprocessors(x.device)
        plans = [gemv_plan(m, n, k, w.ggml_type, groups, sms) for n, w in zip(ns, weights, strict=True)]
        if len(plans) == 2 and plans[0].warps != plans[1].warps:  # one launch, one warp count
            warps = min(p.warps for p in plans)
            plans = [gemv_plan(m, n, k, w.ggml_type, 1, sms, warps) for n, w in zip(ns, weights, strict=True)]
    if partials:
        plans = [replace(plans[0], split=partials)]
    bm = min(GEMV_MAX_ROWS, next_pow2(m))
    counts = [_programs(m, n, g, p) for n, g, p in zip(ns, (groups, 1), plans, strict=False)]
    rbmax = max(p.rows for p in plans) * bm
    if partials:
        y = torch.empty(partials, m, ns[0], device=x.device, dtype=torch.float32)
        part = count = y
    else:
        y = torch.empty(m, groups * sum(ns), device=x.device, dtype=torch.float32)
        part, count = _ticket_scratch(x.device, sum(counts), rbmax) if max(p.split for p in plans) > 1 else (y, y)
    second = weights[-1] if len(weights) == 2 else weights[0]
    seg0, seg1 = _segment_args(weights[0], plans[0]), _segment_args(second, plans[-1])
    _qmatmul_kernel[(sum(counts),)](
        x, x.stride(0), m, k, y, y.stride(-2), part, count, grid_table(x.device),
        weights[0].data, ns[0], weights[0].row_bytes, second.data, ns[-1], second.row_bytes,
        GROUPS=groups, BM=bm, PARTIALS=bool(partials), RBMAX=rbmax, PTX=compiles_ptx(),
        **{f"{key}0": v for key, v in seg0.items()}, TWO=len(weights) == 2, **{f"{key}1": v for key, v in seg1.items()},
        num_warps=plans[0].warps, num_stages=1, **dependent_launch(),
    )  # fmt: skip
    return y


# -- prefill GEMM ----------------------------------------------------------------------------------------
def dequantized(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """w decoded to [rows, cols] of `dtype` in a scratch shared by every weight of that shape.

    The scratch is overwritten by the next decode of the same shape: consume it at once (stream
    order makes that safe on a GPU).
    """
    key = (w.data.device, dtype, w.rows, w.cols)
    if key not in _scratch:
        _scratch[key] = torch.empty(w.rows, w.cols, dtype=dtype, device=w.data.device)
    return dequantize_rows(w.data, w.ggml_type, _scratch[key])


def _matmul_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] in float32; bf16 operands accumulate in fp32 without rounding the result."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:  # cuBLAS / hipBLASLt write fp32 outputs of bf16 products
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())  # CPU (interpreter tests): the same exact products of bf16 values


def _vendor_qmatmul(x: torch.Tensor, w: QWeight, groups: int, precision: Precision) -> torch.Tensor:
    m, n, k = x.shape[0], w.rows // groups, w.cols
    dtype = torch.bfloat16 if precision.fast else torch.float32
    dense = dequantized(w, dtype).view(groups, n, k)
    xg = x.as_strided((groups, m, k), (k, x.stride(0), 1)).to(dtype)
    y = _matmul_fp32_out(xg, dense.transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1).reshape(m, groups * n)


@triton.jit
def _qmatmul_dot_kernel(
    x_ptr, w_ptr, grid_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes, k_per_split,
    SPLIT: tl.constexpr, WTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    group = tl.program_id(2) // SPLIT
    split = tl.program_id(2) % SPLIT
    rows = pid_n * BN + tl.arange(0, BN)
    # out-of-range weight rows re-read the last row instead of masking every byte load; never stored
    row_off = (group * N + tl.minimum(rows, N - 1)).to(tl.int64) * row_bytes
    ms = pid_m * BM + tl.arange(0, BM)
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm + group * K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_rows + ks[None, :], mask=(ms < M)[:, None] & (ks < K)[None, :], other=0.0)
        w = load_weight_tile(w_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK)
        if FAST:
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    y = y_ptr + split * M * stride_ym + ms.to(tl.int64)[:, None] * stride_ym + (group * N + rows)[None, :]
    tl.store(y, acc, mask=(ms < M)[:, None] & (rows < N)[None, :])


def _dot_config(m: int, n: int, bk: int, fast: bool) -> tuple[int, int, int]:
    """(BM, BN, num_warps) of the tensor-core GEMM. GPU: enough programs to keep loads in flight;
    interpreter: few programs.

    The weight operand is decoded in registers, then staged in shared memory for the tensor cores,
    as is the activation tile (one pipeline stage): [BM, BK] + [BN, BK] operands stay within 64 KB
    (the LDS of AMD GPUs), and the 256-wide super-block tiles and the exact 32 x 32 tiles get 8 warps
    so the decoded tile and the fp32 products do not spill registers.
    """
    if interpreting():
        return min(64, next_pow2(m)), min(next_pow2(n), 1024), 1
    cap = 64 if fast else 32  # fp32 operands (FMA products) take twice the registers and shared memory
    bm = min(cap, 16 if m <= 16 else 32 if m <= 32 else 64)
    bn = min(next_pow2(n), 32 if bk == 256 else cap)
    # the 256-wide super-block tiles, and exact products of a 32 x 32 tile (triton 3.6 and 3.9 spill
    # 136-168 B of it on 4 warps for sm_90), take 8 warps
    return bm, bn, 8 if bk == 256 or (not fast and bm * bn >= 32 * 32) else 4


def _dot_qmatmul(x: torch.Tensor, w: QWeight, groups: int, split_k: int, precision: Precision) -> torch.Tensor:
    m, n, k = x.shape[0], w.rows // groups, w.cols
    bk = tile_k(w.ggml_type, k, gemm=True)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    split = triton.cdiv(k, k_per_split)
    y = torch.empty((split, m, n) if split_k > 1 else (m, groups * n), device=x.device, dtype=torch.float32)
    bm, bn, warps = _dot_config(m, n, bk, precision.fast)
    _qmatmul_dot_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), groups * split)](
        x, w.data, grid_table(x.device), y, m, n, k, x.stride(0), groups * n, w.row_bytes, k_per_split,
        SPLIT=split, WTYPE=w.wtype, BM=bm, BN=bn, BK=bk, FAST=precision.fast, num_warps=warps,
    )  # fmt: skip
    return y


# -- the entry points ------------------------------------------------------------------------------------
def qmatmul(
    x: torch.Tensor,
    w: QWeight,
    groups: int = 1,
    split_k: int = 1,
    precision: Precision = EXACT,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """x [M, groups * K] float32 (row stride free, unit column stride) times w [groups * N, K]^T.

    Returns [M, groups * N], or partial sums [split_k, M, N] when split_k > 1 (groups must be 1).
    `use_dot` forces the fused GEMM (True) or GEMV (False) path; by default it follows the number of
    rows: GEMV up to GEMV_MAX_ROWS, the fused tensor-core GEMM up to 16, then the dequantized
    weight through the vendor GEMM (split-K partials stay fused: their weights have 24 rows).
    """
    m, k = x.shape[0], w.cols
    if x.stride(-1) != 1 or x.shape[-1] != groups * k:
        raise ValueError(f"x must be [M, {groups * k}] with contiguous rows, got {tuple(x.shape)}")
    if split_k > 1 and groups != 1:
        raise ValueError("split-K and groups do not combine")
    if use_dot is None and split_k == 1 and m >= VENDOR_GEMM_MIN_ROWS:
        return _vendor_qmatmul(x, w, groups, precision)
    if use_dot or (use_dot is None and m > GEMV_MAX_ROWS):
        return _dot_qmatmul(x, w, groups, split_k, precision)
    if split_k > 1:
        plan = gemv_plan(m, w.rows, k, w.ggml_type)
        bk = plan.block_k
        return gemv(x, [w], partials=triton.cdiv(k, triton.cdiv(triton.cdiv(k, split_k), bk) * bk))
    return gemv(x, [w], groups)


def project(x: torch.Tensor, weights: list[QWeight]) -> torch.Tensor:
    """Decode: x times each weight (all of width K), side by side [M, sum of rows], one GEMV launch
    per two weights (a `FusedLinear`'s parts of two block types)."""
    if x.stride(-1) != 1 or x.shape[-1] != weights[0].cols:
        raise ValueError(f"x must be [M, {weights[0].cols}] with contiguous rows, got {tuple(x.shape)}")
    parts = [gemv(x, weights[i : i + 2]) for i in range(0, len(weights), 2)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a `_qmatmul_kernel` launch streams (see `runtime.KernelWork`): the first weight's pass."""
    if kernel != "_qmatmul_kernel":
        return None
    n1 = a["N1"] if a["TWO"] else 0
    weight = a["GROUPS"] * a["N0"] * a["row_bytes0"] + n1 * a["row_bytes1"]
    activations = 4 * a["M"] * (a["GROUPS"] * (a["K"] + a["N0"]) + n1)
    k_split = triton.cdiv(a["K"], a["S0"])
    loop = a["R0"] * a["row_bytes0"] * a["BK0"] // a["K"] + 4 * a["BM"] * a["BK0"]
    return KernelWork(weight + activations, weight, triton.cdiv(k_split, a["BK0"]), loop)


def reference(x: torch.Tensor, w: QWeight, groups: int = 1) -> torch.Tensor:
    """torch: dequantize the whole weight to float32 and multiply group by group."""
    dense = w.dequantize().view(groups, w.rows // groups, w.cols)
    xg = x.reshape(x.shape[0], groups, w.cols)
    return torch.einsum("mgk,gnk->mgn", xg, dense).reshape(x.shape[0], -1)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The projections of one Flash/PRO layer at decode (one token) and two prefill GEMMs."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    T = GGMLType
    a_proj = 2 * 2 * a.head_dim + 2 * 2 * a.index_head_dim + a.index_n_heads
    decode = [
        ("attn q_a + kv", T.Q8_0, a.q_lora_rank + a.head_dim, a.dim, 1, 1),
        ("compressor + indexer projections", T.F16, a_proj, a.dim, 1, 1),
        ("attn q_b", T.Q8_0, a.n_heads * a.head_dim, a.q_lora_rank, 1, 1),
        ("indexer q_b", T.F16, a.index_n_heads * a.index_head_dim, a.q_lora_rank, 1, 1),
        ("attn output a (grouped)", T.Q8_0, a.o_groups * a.o_lora_rank, a.heads_per_group * a.head_dim, a.o_groups, 1),
        ("attn output b", T.Q8_0, a.dim, a.o_groups * a.o_lora_rank, 1, 1),
        ("mHC mixes (split-K)", T.F16, a.hc_mix_dim, a.hc_mult * a.dim, 1, 8),
        ("output head", T.Q8_0, a.vocab_size, a.dim, 1, 1),
    ]
    cases = []
    for what, ggml_type, n, k, groups, split in decode:
        w = random_qweight(ggml_type, (n, k), dev, gen)
        x = torch.randn(1, groups * k, device=dev, generator=gen)
        cases.append(BenchCase(
            "qmatmul", f"decode {what} {ggml_type.name} {n}x{k}",
            functools.partial(qmatmul, x, w, groups, split), w.nbytes + 4 * (groups * k + n), 2 * n * k,
        ))  # fmt: skip
    for what, (ta, na), (tb, nb), k in (
        ("attention input", (T.Q8_0, a.q_lora_rank + a.head_dim), (T.F16, a_proj), a.dim),
        ("query input", (T.Q8_0, a.n_heads * a.head_dim), (T.F16, a.index_n_heads * a.index_head_dim), a.q_lora_rank),
    ):
        pair = [random_qweight(ta, (na, k), dev, gen), random_qweight(tb, (nb, k), dev, gen)]
        x = torch.randn(1, k, device=dev, generator=gen)
        cases.append(BenchCase(
            "qmatmul", f"decode {what} {ta.name} {na}x{k} + {tb.name} {nb}x{k} (one launch)",
            functools.partial(project, x, pair), sum(w.nbytes for w in pair) + 4 * (k + na + nb), 2 * (na + nb) * k,
        ))  # fmt: skip
    for what, n, k in (
        ("attn q_b", a.n_heads * a.head_dim, a.q_lora_rank),
        ("attn output b", a.dim, a.o_groups * a.o_lora_rank),
    ):
        w = random_qweight(T.Q8_0, (n, k), dev, gen)
        x = torch.randn(shape.prefill, k, device=dev, generator=gen)
        cases.append(BenchCase(
            "qmatmul", f"prefill {what} Q8_0 {shape.prefill}x{n}x{k} (bf16 scratch, vendor GEMM)",
            functools.partial(qmatmul, x, w, precision=FAST), w.nbytes + 4 * shape.prefill * (k + n),
            2 * shape.prefill * n * k,
        ))  # fmt: skip
    return cases
