"""A decode step's attention rows in one launch: everything that follows the ATTN_INPUT projections.

B sequences, one token each, every one at its own position in its own slot of a KV-cache block
(layout: `model.state`). Program (b, 0) normalises sequence b's low-rank query (q_norm) and
finishes its raw KV row (RMSNorm, RoPE at the position, FP8 rounding of the nope dims) straight into
its ring, row p mod window. Programs (b, 1) and (b, 2) advance the layer's compressors (the
attention rows; the indexer rows in ratio-4 layers): the token's kv and gate, with the position
bias ape[p mod ratio], go into its frontier slot. Where the token completes its window (decided here
from the position, so a captured graph replays the same launch at every position) the program then
pools the window (a softmax gate per column over its slots, online over chunks of slots; ratio 4
pools the previous window's first half of the columns and this window's second half), normalises,
rotates at the window's first position and rounds the row (FP8, or Hadamard + FP4 for the indexer),
writes it into the sequence's page of the row pool, and moves the frontier on (ratio 4: the finished
window becomes the previous one; its own slots are emptied: kv 0, gate -inf).

RoPE angles are formed here from the positions (`rms_norm_rope.rope_cos_sin`), so a decode step has no
angle tables. The results are those of the chunk kernels on each token alone (`compress_chunk`,
`rms_norm_rope`, and the ring and paged-row writes of `TritonOps`): prefill, snapshots and forks
read the same state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.rms_norm_rope import finish_rows, half_hadamard, rope_cos_sin
from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    PagedRows,
    dependent_launch,
    interpreting,
    next_pow2,
    per_sequence,
    wait_for_inputs,
)
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.numerics import rope_angles
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import CompressorSpec

NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity" for the running max: exp(m_old - m_new) stays defined


@triton.jit
def _store_row(rows_ptr, rest_ptr, at, x, keep, D, EXACT: tl.constexpr, BD: tl.constexpr):
    """Row x [BR, BD] (valid where `keep`) into row `at` of a pool: whole float32 rows (EXACT = 0), or
    the first EXACT dims in the pool's bf16 part and the rest in float32 (`SplitRows`)."""
    c = tl.arange(0, BD)[None, :] + 0 * keep.to(tl.int32)  # the tile's shape: one row, or padding rows masked
    if EXACT == 0:
        tl.store(rows_ptr + at * D + c, x, mask=keep)
    else:
        tl.store(rows_ptr + at * EXACT + c, x.to(rows_ptr.dtype.element_ty), mask=keep & (c < EXACT))
        if EXACT < D:
            tl.store(rest_ptr + at * (D - EXACT) + c - EXACT, x, mask=keep & (c >= EXACT))


@triton.jit
def _compress_token(
    u_ptr, g_ptr, ape_ptr, norm_ptr, fkv_ptr, fgate_ptr, rows_ptr, rest_ptr, table_ptr, inv_ptr, had_ptr,
    p, slot, eps, D,
    RATIO: tl.constexpr, QAT: tl.constexpr, EXACT: tl.constexpr, ROPE_DIM: tl.constexpr, BD: tl.constexpr,
    SC: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """One token of one sequence through a compressor (module docstring): u/g_ptr its projections,
    fkv/fgate_ptr its frontier, table_ptr its page table."""
    OVERLAP: tl.constexpr = RATIO == 4
    BW: tl.constexpr = 2 * BD if OVERLAP else BD
    N_SLOTS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO  # frontier rows, and slots a row pools
    OFF: tl.constexpr = RATIO if OVERLAP else 0  # first frontier row of the window in progress
    W = 2 * D if OVERLAP else D
    j = p % RATIO
    fkv_ptr += slot * (N_SLOTS * W)
    fgate_ptr += slot * (N_SLOTS * W)
    cw = tl.arange(0, BW)
    okw = cw < W
    tl.store(fkv_ptr + (OFF + j) * W + cw, tl.load(u_ptr + cw, mask=okw, other=0.0), mask=okw)
    gate = tl.load(g_ptr + cw, mask=okw, other=0.0) + tl.load(ape_ptr + j * W + cw, mask=okw, other=0.0)
    tl.store(fgate_ptr + (OFF + j) * W + cw, gate, mask=okw)
    if j == RATIO - 1:
        tl.debug_barrier()  # the token's slot is written for every thread of the program
        c = tl.arange(0, BD)
        okc = (c < D)[None, :]
        m = tl.full((BD,), NEG, tl.float32)
        l = tl.zeros((BD,), tl.float32)
        acc = tl.zeros((BD,), tl.float32)
        for s0 in range(0, N_SLOTS, SC):  # online softmax over the slots, SC at a time
            i = s0 + tl.arange(0, SC)
            if OVERLAP:  # the previous window's first half of the columns, this window's second half
                at = i[:, None] * W + c[None, :] + tl.where(i < RATIO, 0, D)[:, None]
            else:
                at = i[:, None] * W + c[None, :]
            kv = tl.load(fkv_ptr + at, mask=okc, other=0.0)
            g = tl.load(fgate_ptr + at, mask=okc, other=0.0)
            m_new = tl.maximum(m, tl.max(g, axis=0))
            alpha = tl.exp(m - m_new)
            w = tl.exp(g - m_new[None, :])
            l = l * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(kv * w, axis=0)
            m = m_new
        r = tl.arange(0, RATIO)
        if OVERLAP:  # the finished window, whole, becomes the previous one
            done_kv = tl.load(fkv_ptr + (OFF + r)[:, None] * W + cw[None, :], mask=okw[None, :], other=0.0)
            done_gate = tl.load(fgate_ptr + (OFF + r)[:, None] * W + cw[None, :], mask=okw[None, :], other=0.0)
            tl.debug_barrier()  # every thread has read the window before it moves
            tl.store(fkv_ptr + r[:, None] * W + cw[None, :], done_kv, mask=okw[None, :])
            tl.store(fgate_ptr + r[:, None] * W + cw[None, :], done_gate, mask=okw[None, :])
        else:
            tl.debug_barrier()
        for s0 in range(OFF, N_SLOTS, SC):  # the window in progress starts empty
            i = s0 + tl.arange(0, SC)
            at = i[:, None] * W + cw[None, :]
            ok = (i < N_SLOTS)[:, None] & okw[None, :]
            tl.store(fkv_ptr + at, tl.zeros((SC, BW), tl.float32), mask=ok)
            tl.store(fgate_ptr + at, tl.full((SC, BW), float("-inf"), tl.float32), mask=ok)
        # the row: RMSNorm, RoPE at the window's first position, rounding; a one-row tile, or 16 rows
        # (zero padding) where the Hadamard transform runs on the tensor cores
        BR: tl.constexpr = 16 if QAT == 2 else 1
        first = tl.arange(0, BR)[:, None] == 0
        x = tl.where(first, tl.div_rn(acc, l)[None, :], 0.0)
        keep = first & okc
        row = p // RATIO
        cos, sin = rope_cos_sin(tl.zeros([1], tl.int32) + row * RATIO, inv_ptr, D, ROPE_DIM, False, BD)
        x = finish_rows(x, keep, norm_ptr, cos, sin, had_ptr, D, eps, 2, True, QAT, ROPE_DIM, BR, BD)
        page = tl.load(table_ptr + row // PAGE).to(tl.int64)
        _store_row(rows_ptr, rest_ptr, page * PAGE + row % PAGE, x, keep, D, EXACT, BD)


@triton.jit
def _rows_kernel(
    pos_ptr, slot_ptr, inv_ptr, had_ptr,
    qa_ptr, qa_norm_ptr, qr_ptr, kv_ptr, kv_norm_ptr, ring_ptr,
    au_ptr, ag_ptr, a_ape_ptr, a_norm_ptr, a_fkv_ptr, a_fgate_ptr, a_rows_ptr, a_rest_ptr, a_table_ptr,
    iu_ptr, ig_ptr, i_ape_ptr, i_norm_ptr, i_fkv_ptr, i_fgate_ptr, i_rows_ptr, i_rest_ptr, i_table_ptr,
    stride_qa, stride_kv, stride_a, stride_i, a_table_stride, i_table_stride, window, eps, QL, D, DI,
    RATIO: tl.constexpr, QAT: tl.constexpr, A_EXACT: tl.constexpr, I_EXACT: tl.constexpr, ROPE_DIM: tl.constexpr,
    BQ: tl.constexpr, BD: tl.constexpr, BDI: tl.constexpr, SC: tl.constexpr, PAGE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    role = tl.program_id(1)  # 0: the query and KV rows; 1: the attention compressor; 2: the indexer's
    p = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if role == 0:
        cq = tl.arange(0, BQ)[None, :]
        x = tl.load(qa_ptr + b * stride_qa + cq, mask=cq < QL, other=0.0)
        x = finish_rows(x, cq < QL, qa_norm_ptr, x, x, had_ptr, QL, eps, 2, False, 0, 0, 1, BQ)
        tl.store(qr_ptr + b * QL + cq, x, mask=cq < QL)
        c = tl.arange(0, BD)[None, :]
        x = tl.load(kv_ptr + b * stride_kv + c, mask=c < D, other=0.0)
        cos, sin = rope_cos_sin(tl.zeros([1], tl.int32) + p, inv_ptr, D, ROPE_DIM, False, BD)
        x = finish_rows(x, c < D, kv_norm_ptr, cos, sin, had_ptr, D, eps, 2, True, 1 if QAT else 0, ROPE_DIM, 1, BD)
        tl.store(ring_ptr + (slot * window + p % window) * D + c, x, mask=c < D)
    elif role == 1:
        _compress_token(au_ptr + b * stride_a, ag_ptr + b * stride_a, a_ape_ptr, a_norm_ptr, a_fkv_ptr, a_fgate_ptr,
                        a_rows_ptr, a_rest_ptr, a_table_ptr + slot * a_table_stride, inv_ptr, had_ptr, p, slot, eps,
                        D, RATIO, 1 if QAT else 0, A_EXACT, ROPE_DIM, BD, SC, PAGE)  # fmt: skip
    else:
        _compress_token(iu_ptr + b * stride_i, ig_ptr + b * stride_i, i_ape_ptr, i_norm_ptr, i_fkv_ptr, i_fgate_ptr,
                        i_rows_ptr, i_rest_ptr, i_table_ptr + slot * i_table_stride, inv_ptr, had_ptr, p, slot, eps,
                        DI, 4, 2 if QAT else 0, I_EXACT, ROPE_DIM, BDI, 8, PAGE)  # fmt: skip


@dataclass(frozen=True)
class Compressing:
    """One compressor's inputs to `decode_rows`: the tokens' projections kv and gate [B, width] (column
    slices of one buffer), its position bias ape [ratio, width] and norm [dim], the block's frontiers
    [slots, rows, width] and its paged rows (a block's page tables, [slots, n])."""

    kv: torch.Tensor
    gate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor
    frontier_kv: torch.Tensor
    frontier_gate: torch.Tensor
    rows: PagedRows

    def args(self) -> tuple:
        pool, rest, exact = self.rows.parts()
        return (self.kv, self.gate, self.ape, self.norm, self.frontier_kv, self.frontier_gate, pool, rest,
                self.rows.table), (self.kv.stride(0), self.rows.table_stride, exact)  # fmt: skip


def decode_rows(
    pos: torch.Tensor,
    slots: torch.Tensor,
    inv_freq: torch.Tensor,
    q_a: torch.Tensor,
    q_norm: torch.Tensor,
    kv: torch.Tensor,
    kv_norm: torch.Tensor,
    rings: torch.Tensor,
    ratio: int,
    rope_dim: int,
    eps: float,
    qat: bool,
    attn: Compressing | None = None,
    indexer: Compressing | None = None,
) -> torch.Tensor:
    """The decode step's rows in one launch (module docstring); returns the normalised low-rank
    queries [B, q_lora_rank].

    pos, slots int32 [B]: each sequence's position and slot in the block; inv_freq float64
    [rope_dim / 2]; q_a [B, q_lora_rank] and kv [B, head_dim] (row strides free); rings [slots,
    window, head_dim] float32; `attn` with a compressed layer's `ratio`, `indexer` in ratio-4 layers;
    `qat`: FP8 / FP4 rounding of the rows (the compact pools' bf16 parts hold them exactly).
    """
    per_sequence(pos, slots)
    b, ql = q_a.shape
    d = kv.shape[1]
    if (attn is None) != (ratio == 0) or (indexer is not None) != (ratio == 4):
        raise ValueError(f"a ratio-{ratio} layer has {'no ' if ratio == 0 else ''}attention compressor"
                         f"{' and an indexer' if ratio == 4 else ''}")  # fmt: skip
    for comp in (c for c in (attn, indexer) if c is not None):
        if comp.kv.stride(1) != 1 or comp.gate.stride(1) != 1 or comp.kv.stride(0) != comp.gate.stride(0):
            raise ValueError("a compressor's kv and gate must be column slices of one buffer")
    qr = torch.empty(b, ql, device=q_a.device, dtype=torch.float32)
    bd = next_pow2(max(d, 64))
    a_ptrs, (stride_a, a_table_stride, a_exact) = attn.args() if attn is not None else ((q_a,) * 9, (0, 0, 0))
    i_ptrs, (stride_i, i_table_stride, i_exact) = indexer.args() if indexer is not None else ((q_a,) * 9, (0, 0, 0))
    di = indexer.norm.shape[0] if indexer is not None else 64
    bdi = next_pow2(max(di, 64))
    if indexer is not None and qat and di & (di - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two row, got {di}")
    sc = max(ratio, 8) if interpreting() else 8  # slots per pooling step: one step in the interpreter
    roles = 1 + (attn is not None) + (indexer is not None)
    _rows_kernel[(b, roles)](
        pos, slots, inv_freq, half_hadamard(bdi, q_a.device), q_a, q_norm, qr, kv, kv_norm, rings,
        *a_ptrs, *i_ptrs, q_a.stride(0), kv.stride(0), stride_a, stride_i, a_table_stride, i_table_stride,
        rings.shape[1], eps, ql, d, di,
        RATIO=max(ratio, 1), QAT=qat, A_EXACT=a_exact, I_EXACT=i_exact, ROPE_DIM=rope_dim,
        BQ=next_pow2(ql), BD=bd, BDI=bdi, SC=sc, PAGE=PAGE_ROWS, num_warps=4, num_stages=1, **dependent_launch(),
    )  # fmt: skip
    return qr


def reference_compress(
    spec: CompressorSpec,
    comp: Compressing,
    positions: list[int],
    slots: list[int],
    inv_freq: torch.Tensor,
    rope_dim: int,
    eps: float,
    qat: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `decode_rows` does to one compressor, by the reference ops on copies (nothing is written):
    (rows [B, dim] finished as the reference finishes them, zero where no window completes, `done`
    [B] bool, the new frontiers kv and gate [B, ...] of the sequences' slots)."""
    pooled, done, front_kv, front_gate = ops.compress_step(
        spec, comp.frontier_kv[slots].float(), comp.frontier_gate[slots].float(), comp.kv.float(),
        comp.gate.float(), comp.ape, comp.norm, torch.tensor(positions), eps,
    )  # fmt: skip
    rows = torch.zeros(len(slots), spec.dim)
    if pooled.shape[0]:
        cos, sin = rope_angles(torch.tensor(positions)[done] // spec.ratio * spec.ratio, inv_freq)
        pooled = ops.apply_rope(pooled, cos, sin)
        if qat:
            pooled = ops.fp8_round_nope(pooled, rope_dim) if spec.kind == "attn" else ops.indexer_round(pooled)
        rows[done] = pooled
    return rows, done, front_kv, front_gate


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """A batch of 8 sequences in a ratio-4 layer, half of them completing a window."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    b, ratio = 8, 4
    inv = torch.tensor(yarn_inv_freq(a, a.layer(2)), dtype=torch.float64, device=dev)
    pos = (torch.arange(b, device=dev) + shape.ctx).to(torch.int32)
    slots = torch.arange(b, dtype=torch.int32, device=dev)
    n_rows = shape.ctx // ratio + 1

    def compressing(kind: str, dim: int, exact: int) -> Compressing:
        spec = CompressorSpec(kind, ratio, dim)
        width = spec.frontier_shape[1]
        both = torch.randn(b, 2 * width, device=dev, generator=gen)
        rows = PagedRows.scattered(torch.zeros(b, n_rows, dim, device=dev), exact_dims=exact)
        front = (b, *spec.frontier_shape)
        return Compressing(both[:, :width], both[:, width:], torch.randn(ratio, width, device=dev, generator=gen),
                           torch.ones(dim, device=dev), torch.randn(front, device=dev, generator=gen),
                           torch.randn(front, device=dev, generator=gen), rows)  # fmt: skip

    q_a = torch.randn(b, a.q_lora_rank, device=dev, generator=gen)
    kv = torch.randn(b, a.head_dim, device=dev, generator=gen)
    rings = torch.zeros(b, a.window, a.head_dim, device=dev)
    ones = torch.ones(a.head_dim, device=dev)
    attn = compressing("attn", a.head_dim, a.head_dim - a.rope_dim)
    indexer = compressing("indexer", a.index_head_dim, a.index_head_dim)
    q_norm = torch.ones(a.q_lora_rank, device=dev)
    run = functools.partial(decode_rows, pos, slots, inv, q_a, q_norm, kv, ones, rings, ratio, a.rope_dim, a.norm_eps,
                            True, attn, indexer)  # fmt: skip
    moved = 4 * b * (a.q_lora_rank * 2 + a.head_dim * 2 + 2 * 2 * 8 * (2 * a.head_dim + 2 * a.index_head_dim))
    return [BenchCase("decode_rows", f"decode batch of {b}, ratio 4 at {shape.ctx}", run, moved)]
