"""Lightning-indexer scores: sum over heads of weight * ReLU(q_h . k_c), for every visible row c.

Spec §2.3.2. Queries arrive already RoPE'd, Hadamard-rotated and FP4-rounded (`rms_norm_rope`), the
indexer rows likewise from the compressor. Query i (position p0 + i) sees rows c < (p0 + i + 1) / 4;
the kernel also writes that count, which `topk` uses as the row's valid length. One program scores a
block of BN rows for one query: a [heads, dim] x [dim, BN] product on the tensor cores, ReLU, and the
head-weighted sum. Blocks past the visible rows exit at once, so the grid can be sized from the row
buffer's capacity (what a captured decode step needs). `indexer_topk_batch` scores one decode
query for each of B sequences in one launch, each at its own position over its own KV-cache slot,
and selects each one's top-k rows in the same launch (the selection's rounds run by the last
scoring programs to finish, `topk.select_block`).
Rows are read through the sequence's page table (`PagedRows`); a block of BN <= PAGE rows lies in
one page, so its page is one load.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.topk import block_size, finish_rounds, select_block
from dwarfstar.backends.triton.runtime import (
    EXACT,
    BenchCase,
    BenchShape,
    KernelWork,
    PagedRows,
    Precision,
    dependent_launch,
    interpreting,
    last_program,
    next_pow2,
    per_sequence,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.model.pages import PAGE_ROWS


@triton.jit
def _scores_kernel(
    q_ptr, w_ptr, rows_ptr, table_ptr, pos_ptr, slot_ptr, scores_ptr, valid_ptr, cand_scores_ptr, cand_idx_ptr,
    out_ptr, ticket_ptr, stride_w, stride_s, table_stride, weight_scale, k, n_blocks,
    RATIO: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, FAST: tl.constexpr,
    BATCH: tl.constexpr, PAGE: tl.constexpr, SELECT: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
    KP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # BATCH: query i is sequence i's token at pos[i], over the page table of slot slot[i] (table_ptr
    # [slots, table_stride]); else query i is token i of a chunk from pos[0] over one sequence's
    # table. rows_ptr is the pool's pages, [pages * PAGE, DI].
    i = tl.program_id(0)
    if BATCH:
        n_vis = (tl.load(pos_ptr + i) + 1) // RATIO
        table_ptr += tl.load(slot_ptr + i).to(tl.int64) * table_stride
    else:
        n_vis = (tl.load(pos_ptr) + i + 1) // RATIO
    if SELECT or tl.program_id(1) == 0:  # selecting, every program has written the count it reads
        tl.store(valid_ptr + i, n_vis)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    if tl.program_id(1) * BN < n_vis:
        h = tl.arange(0, HI)
        d = tl.arange(0, DI)
        q = tl.load(q_ptr + (i * HI + h[:, None]) * DI + d[None, :])
        page = tl.load(table_ptr + tl.program_id(1) * BN // PAGE).to(tl.int64)
        at = page * PAGE + c % PAGE
        # rows may be bf16 (a compact cache: FP4-rounded, so exact), widened straight after the load
        k_rows = tl.load(rows_ptr + at[:, None] * DI + d[None, :], mask=(c < n_vis)[:, None], other=0.0)
        k_rows = k_rows.to(tl.float32)
        if FAST:
            dots = tl.dot(q.to(tl.bfloat16), tl.trans(k_rows.to(tl.bfloat16)))
        else:
            dots = tl.dot(q, tl.trans(k_rows), input_precision="ieee")
        w = tl.load(w_ptr + i * stride_w + h) * weight_scale
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        tl.store(scores_ptr + i.to(tl.int64) * stride_s + c, score, mask=c < n_vis)
    if SELECT:
        # the last scoring program of each top-k block runs the selection's first round on it (the
        # final one when ROUNDS = 1); with ROUNDS = 2 the last of those runs the final round over the
        # blocks' candidates; with ROUNDS = 0 further launches do
        per_block: tl.constexpr = BLOCK // BN
        blk = tl.program_id(1) // per_block
        members = tl.minimum(per_block, tl.num_programs(1) - blk * per_block)
        if last_program(ticket_ptr + i * n_blocks + blk, members):
            select_block(scores_ptr, scores_ptr, valid_ptr, cand_scores_ptr, cand_idx_ptr, out_ptr, i, blk, stride_s,
                         stride_s, stride_s, n_blocks, k, True, ROUNDS == 1, BLOCK, KP, True)  # fmt: skip
            if ROUNDS == 2:
                if last_program(ticket_ptr + tl.num_programs(0) * n_blocks + i, n_blocks):
                    select_block(cand_scores_ptr, cand_idx_ptr, valid_ptr, out_ptr, out_ptr, out_ptr, i, 0, stride_s,
                                 n_blocks * k, n_blocks * k, 1, k, False, True, BLOCK, KP, True)  # fmt: skip


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a scores launch reads (`runtime.KernelWork`): each query's rows up to the launch's bound
    (`stride_s`, the visible rows rounded up to a power of two), the indexer rows being its stream."""
    if kernel != "_scores_kernel":
        return None
    queries, width = a["q_ptr"].shape[0], a["stride_s"]
    row = a["DI"] * a["rows_ptr"].element_size()
    rows = queries * width * row
    return KernelWork(rows + 8 * queries * width, rows, 1, a["BN"] * row)


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


def indexer_topk_batch(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    rows: PagedRows,
    pos: torch.Tensor,
    slots: torch.Tensor,
    bound: int,
    ratio: int,
    k: int,
    precision: Precision = EXACT,
) -> torch.Tensor:
    """One decode query per sequence, scored and selected: q [B, H, Di], head_weights [B, H], rows a
    KV-cache block's paged rows (table [slots, n]), pos and slots int32 [B], `bound` at least every
    sequence's visible rows -> the chosen rows int32 [B, k] in ascending order, -1 padded (`topk`).

    The selection's first round runs in the scoring launch (the last scoring program of each top-k
    block, by ticket), and its final round too where the blocks' candidates fit one block (up to
    block_size / k blocks: 32,768 rows, 128k context, at Flash's k = 512): one launch; beyond,
    `topk.finish_rounds` launches the other rounds."""
    per_sequence(pos, slots)
    b = q.shape[0]
    block = block_size(k)
    n_blocks = triton.cdiv(bound, block)
    rounds = 1 if n_blocks == 1 else 2 if n_blocks * k <= block else 0
    out = torch.empty(b, k, dtype=torch.int32, device=q.device)
    cand_scores, cand_idx = out, out
    if n_blocks > 1:
        cand_scores = torch.empty(b, n_blocks * k, device=q.device)
        cand_idx = torch.empty(b, n_blocks * k, dtype=torch.int32, device=q.device)
    tickets = ticket_counters(q.device, "indexer", b * (n_blocks + 1))
    scores, valid = _launch(q, head_weights, rows, pos, slots, bound, ratio, precision,
                            select=(cand_scores, cand_idx, out, tickets, k, n_blocks, rounds, block))  # fmt: skip
    if rounds == 0:
        finish_rounds(cand_scores, cand_idx, valid, bound, n_blocks * k, n_blocks * k, k, out)
    return out


def _launch(q, head_weights, rows: PagedRows, pos, slots, width, ratio, precision, select=None):
    t, heads, dim = q.shape
    scores = torch.empty(t, width, device=q.device, dtype=torch.float32)
    valid = torch.empty(t, dtype=torch.int32, device=q.device)
    # a block within one page, the same whatever the width (a batch's bound): a row's scores keep their bits
    bn = PAGE_ROWS if interpreting() else 16
    cand_scores, cand_idx, out, tickets, k, n_blocks, rounds, block = select or (scores, valid, valid, valid, 0, 1,
                                                                                   1, bn)  # fmt: skip
    _scores_kernel[(t, max(1, triton.cdiv(width, bn)))](
        q, head_weights, rows.pool, rows.table, pos, slots if slots is not None else pos, scores, valid,
        cand_scores, cand_idx, out, tickets, head_weights.stride(0), width, rows.table_stride,
        (heads * dim) ** -0.5, k, n_blocks,
        RATIO=ratio, HI=heads, DI=dim, BN=bn, FAST=precision.fast, BATCH=slots is not None, PAGE=PAGE_ROWS,
        SELECT=select is not None, ROUNDS=rounds, BLOCK=block, KP=next_pow2(max(k, 1)),
        num_warps=8, num_stages=1, **dependent_launch(),
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
    """Decode at context `ctx`: one query against every indexer row (ctx / 4 of them); and a batch of
    4 sequences scored and selected in one launch."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    n = max(shape.ctx // 4, 1)
    q = torch.randn(1, a.index_n_heads, a.index_head_dim, device=dev, generator=gen)
    w = torch.randn(1, a.index_n_heads, device=dev, generator=gen)
    rows = PagedRows.scattered(torch.randn(n, a.index_head_dim, device=dev, generator=gen))
    pos = torch.tensor([shape.ctx], dtype=torch.int32, device=dev)
    run = functools.partial(indexer_scores, q, w, rows, n, pos, 4)
    flops = 2 * a.index_n_heads * a.index_head_dim * n
    moved = n * a.index_head_dim * 4 + n * 4
    b = 4
    qb = torch.randn(b, a.index_n_heads, a.index_head_dim, device=dev, generator=gen)
    wb = torch.randn(b, a.index_n_heads, device=dev, generator=gen)
    block = PagedRows.scattered(torch.randn(b, n, a.index_head_dim, device=dev, generator=gen).bfloat16().float())
    block = PagedRows(block.pool.bfloat16(), block.table)  # a compact cache's indexer rows
    posb = torch.full((b,), shape.ctx, dtype=torch.int32, device=dev)
    slots = torch.arange(b, dtype=torch.int32, device=dev)
    batch = functools.partial(indexer_topk_batch, qb, wb, block, posb, slots, n, 4, a.index_topk)
    return [
        BenchCase("indexer_scores", f"decode at {shape.ctx}: {n} rows", run, moved, flops),
        BenchCase(
            "indexer_scores",
            f"decode batch of {b} at {shape.ctx}: scores and top-{a.index_topk}",
            batch,
            b * (n * a.index_head_dim * 2 + n * 8),
            b * flops,
        ),  # fmt: skip
    ]
