"""Lightning-indexer scores: sum over heads of weight * ReLU(q_h . k_c), for every visible row c.

Spec §2.3.2. Queries arrive already RoPE'd, Hadamard-rotated and FP4-rounded (`rms_norm_rope`), the
indexer rows likewise from the compressor. Query i (position p0 + i) sees rows c < (p0 + i + 1) / 4;
the kernel also writes that count, which `topk` uses as the row's valid length. One program scores a
block of BN rows for one query: a [heads, dim] x [dim, BN] product on the tensor cores, ReLU, and the
head-weighted sum. Blocks past the visible rows exit at once, so the grid can be sized from the row
buffer's capacity (what a captured decode step needs). `indexer_scores_batch` scores one decode
query for each of B sequences in one launch, each at its own position over its own KV-cache slot.
Rows are read through the sequence's page table (`PagedRows`); a block of BN <= PAGE rows lies in
one page, so its page is one load.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import (
    EXACT,
    BenchCase,
    BenchShape,
    PagedRows,
    Precision,
    interpreting,
    next_pow2,
    per_sequence,
)
from dwarfstar.model.pages import PAGE_ROWS


@triton.jit
def _scores_kernel(
    q_ptr, w_ptr, rows_ptr, table_ptr, pos_ptr, slot_ptr, scores_ptr, valid_ptr, stride_w, stride_s, table_stride,
    weight_scale,
    RATIO: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, FAST: tl.constexpr,
    BATCH: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    # BATCH: query i is sequence i's token at pos[i], over the page table of slot slot[i] (table_ptr
    # [slots, table_stride]); else query i is token i of a chunk from pos[0] over one sequence's
    # table. rows_ptr is the pool's pages, [pages * PAGE, DI].
    i = tl.program_id(0)
    if BATCH:
        n_vis = (tl.load(pos_ptr + i) + 1) // RATIO
        table_ptr += tl.load(slot_ptr + i).to(tl.int64) * table_stride
    else:
        n_vis = (tl.load(pos_ptr) + i + 1) // RATIO
    if tl.program_id(1) == 0:
        tl.store(valid_ptr + i, n_vis)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    if tl.program_id(1) * BN < n_vis:
        h = tl.arange(0, HI)
        d = tl.arange(0, DI)
        q = tl.load(q_ptr + (i * HI + h[:, None]) * DI + d[None, :])
        page = tl.load(table_ptr + tl.program_id(1) * BN // PAGE).to(tl.int64)
        at = page * PAGE + c % PAGE
        # rows may be bf16 (a compact cache: FP4-rounded, so exact), widened straight after the load
        k = tl.load(rows_ptr + at[:, None] * DI + d[None, :], mask=(c < n_vis)[:, None], other=0.0)
        k = k.to(tl.float32)
        if FAST:
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        w = tl.load(w_ptr + i * stride_w + h) * weight_scale
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        tl.store(scores_ptr + i.to(tl.int64) * stride_s + c, score, mask=c < n_vis)


def indexer_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    rows: PagedRows,
    bound: int,
    pos: torch.Tensor,
    ratio: int,
    precision: Precision = EXACT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Di] contiguous, head_weights [T, H] (row stride free), rows one sequence's paged rows
    (table [n]), `bound` at least the rows the chunk sees, pos int32 [1] = p0 -> (scores [T, bound]
    valid up to each query's count, counts int32 [T])."""
    return _launch(q, head_weights, rows, pos, None, bound, ratio, precision)


def indexer_scores_batch(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    rows: PagedRows,
    pos: torch.Tensor,
    slots: torch.Tensor,
    bound: int,
    ratio: int,
    precision: Precision = EXACT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per sequence: q [B, H, Di], head_weights [B, H], rows a KV-cache block's
    paged rows (table [slots, n]), pos and slots int32 [B] -> (scores [B, bound], counts int32 [B]);
    `bound` is at least every sequence's visible rows."""
    per_sequence(pos, slots)
    return _launch(q, head_weights, rows, pos, slots, bound, ratio, precision)


def _launch(q, head_weights, rows: PagedRows, pos, slots, width, ratio, precision):
    t, heads, dim = q.shape
    scores = torch.empty(t, width, device=q.device, dtype=torch.float32)
    valid = torch.empty(t, dtype=torch.int32, device=q.device)
    bn = min(max(16, next_pow2(width)), PAGE_ROWS) if interpreting() else 16  # a block within one page
    _scores_kernel[(t, max(1, triton.cdiv(width, bn)))](
        q, head_weights, rows.pool, rows.table, pos, slots if slots is not None else pos, scores, valid,
        head_weights.stride(0), width, rows.table_stride, (heads * dim) ** -0.5,
        RATIO=ratio, HI=heads, DI=dim, BN=bn, FAST=precision.fast, BATCH=slots is not None, PAGE=PAGE_ROWS,
        num_warps=8, num_stages=1,
    )  # fmt: skip
    return scores, valid


def reference(q, head_weights, rows, p0: int, ratio: int) -> torch.Tensor:
    """[T, n_rows] scores with invisible rows at -inf, as the reference indexer computes them."""
    t, heads, dim = q.shape
    per_head = torch.einsum("thd,nd->thn", q, rows).relu()
    scores = (per_head * (head_weights * (heads * dim) ** -0.5)[..., None]).sum(1)
    visible = torch.arange(rows.shape[0], device=q.device)[None, :] < ((torch.arange(t) + p0 + 1) // ratio)[:, None]
    return scores.masked_fill(~visible.to(q.device), float("-inf"))


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Decode at context `ctx`: one query against every indexer row (ctx / 4 of them)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    n = max(shape.ctx // 4, 1)
    q = torch.randn(1, a.index_n_heads, a.index_head_dim, device=dev, generator=gen)
    w = torch.randn(1, a.index_n_heads, device=dev, generator=gen)
    rows = PagedRows.scattered(torch.randn(n, a.index_head_dim, device=dev, generator=gen))
    pos = torch.tensor([shape.ctx], dtype=torch.int32, device=dev)
    run = functools.partial(indexer_scores, q, w, rows, n, pos, 4)
    flops = 2 * a.index_n_heads * a.index_head_dim * n
    moved = n * a.index_head_dim * 4 + n * 4
    return [BenchCase("indexer_scores", f"decode at {shape.ctx}: {n} rows", run, moved, flops)]
