"""Sink attention over the raw window plus compressed rows, with the inverse RoPE on the output.

Spec §2.3. One shared K = V head (MQA), so a program takes BH query heads of one token at once and
reads each key row once for all of them. The rows a query at position p sees:
* the raw window: positions max(0, p - W + 1) .. p, rows of `window` (the state's previous rows
  followed by this chunk's rows);
* compressed rows: all rows c < (p + 1) / ratio (ratio 128), or the indexer's selected rows, -1
  padded (ratio 4); none for ratio 0. They are read through the sequence's page table
  (`PagedRows`): row c is row c % PAGE of page table[c // PAGE] of the pool.
Scores are online-softmaxed block by block; the per-head sink logit joins only the denominator.

Decode has one query token, so its rows are split over S programs per head group (flash decoding):
each keeps its running max, sum and weighted values, and the splits merge pairwise up a binary tree
in the same launch, each pair by the one of its two programs that draws the pair's last atomic
ticket (DECODE_PLAN's "last program finishes"), the lower split first, so the result is
deterministic and the step one launch; the tree's last holder adds the sink. With S = 1 (prefill)
the program finishes its rows itself. Either way the finish undoes the RoPE on the output's tail dims
(V carries the rotation), with angles formed from the position in the kernel, so the grouped output
projection reads the result directly. Row counts come from the device position, and the launch
depends only on T, S and the buffer capacity, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.rms_norm_rope import rope_cos_sin, rotate_pairs
from dwarfstar.backends.triton.runtime import (
    EXACT,
    FAST,
    BenchCase,
    BenchShape,
    PagedRows,
    Precision,
    dependent_launch,
    interpreting,
    last_program,
    multiprocessors,
    next_pow2,
    per_sequence,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.pages import PAGE_ROWS

COMP_NONE, COMP_ALL, COMP_SELECTED = 0, 1, 2
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps exp(m_old - m_new) defined when a block is all masked


@triton.jit
def _position(pos_ptr, i, BATCH: tl.constexpr):
    """Query i's position: sequence i's in a batch, token i's of the chunk from pos[0] otherwise (read
    again where the output is finished, rather than kept in a register through the row loops)."""
    if BATCH:
        return tl.load(pos_ptr + i)
    else:
        return tl.load(pos_ptr) + i


@triton.jit
def _finish(acc, m, l, sinks_ptr, inv_ptr, p, out_ptr, i, hg, heads_ok, D,
            H: tl.constexpr, ROPE_DIM: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    h = hg * BH + tl.arange(0, BH)
    sink = tl.load(sinks_ptr + h, mask=heads_ok, other=0.0)
    big = tl.maximum(sink, m)
    scale = tl.exp(m - big)
    o = acc * tl.div_rn(scale, tl.exp(sink - big) + l * scale)[:, None]
    cos, sin = rope_cos_sin(tl.zeros([1], tl.int32) + p, inv_ptr, D, ROPE_DIM, True, BD)
    o = rotate_pairs(o, cos, sin, BH, BD)
    d = tl.arange(0, BD)
    tl.store(out_ptr + (i.to(tl.int64) * H + h[:, None]) * D + d[None, :], o, mask=heads_ok[:, None] & (d < D)[None, :])


@triton.jit
def _attention_kernel(
    q_ptr, win_ptr, comp_ptr, comp_rest_ptr, table_ptr, sel_ptr, sinks_ptr, pos_ptr, slot_ptr, inv_ptr, out_ptr,
    m_ptr, l_ptr, acc_ptr, ticket_ptr, reach_ptr,
    D, n_prev, window, n_sel, table_stride, sm_scale,
    H: tl.constexpr, COMP: tl.constexpr, RATIO: tl.constexpr, SPLIT: tl.constexpr, ROPE_DIM: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr, BATCH: tl.constexpr,
    COMP_EXACT: tl.constexpr, PAGE: tl.constexpr, OWN_SPLIT: tl.constexpr, LOG_CAP: tl.constexpr,
    REACH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # BATCH: query i is sequence i's one token, at position pos[i], over the ring and page table of
    # KV-cache slot slot[i] (win_ptr [slots * window, D], table_ptr [slots, table_stride]); else query i
    # is token i of one sequence's chunk over its linear window rows (n_prev earlier rows, then the
    # chunk) and its page table (table_ptr). comp_ptr is the pool's pages, [pages * PAGE, D].
    # COMP_EXACT > 0: a compressed row's first COMP_EXACT dims are read from comp_ptr (row stride
    # COMP_EXACT: bf16 in a compact cache), the others from comp_rest_ptr (row stride D - COMP_EXACT);
    # 0: whole rows from comp_ptr. A compile-time width, so a half of the row that lies in one part
    # is one load, as for whole rows. REACH (a chunk with a bidirectional image span): query i reads the
    # window rows reach[i, 0] .. reach[i, 1] (`image_spans.window_reach`) instead of its causal window.
    i = tl.program_id(0)  # query token in the chunk, or sequence in the batch
    hg = tl.program_id(1)
    split = tl.program_id(2)
    h = hg * BH + tl.arange(0, BH)
    heads_ok = h < H
    # rows are handled as two halves of BD / 2 columns, so the bf16 tensor-core operands of a step fit
    # in 32 KB; the fp32 (FMA) products of the exact path keep q and k in 65 KB on NVIDIA, 16 KB on AMD
    BD2: tl.constexpr = BD // 2
    d = tl.arange(0, BD2)
    q_row = q_ptr + (i.to(tl.int64) * H + h[:, None]) * D
    q_lo = tl.load(q_row + d[None, :], mask=heads_ok[:, None] & (d < D)[None, :], other=0.0)
    q_hi = tl.load(q_row + BD2 + d[None, :], mask=heads_ok[:, None] & (BD2 + d < D)[None, :], other=0.0)
    p = _position(pos_ptr, i, BATCH)
    if BATCH:
        slot = tl.load(slot_ptr + i).to(tl.int64)
        hi = p  # positions: the ring holds position q in row q mod window
        ring_base = slot * window
        pages = table_ptr + slot * table_stride
    else:
        hi = n_prev + i  # the query's own row of the linear window
        ring_base = 0
        pages = table_ptr
    lo = tl.maximum(0, hi - window + 1)
    if REACH:
        lo = tl.load(reach_ptr + 2 * i)
        hi = tl.load(reach_ptr + 2 * i + 1)
    n_win = hi - lo + 1
    if COMP == 1:
        n_comp = (p + 1) // RATIO
    elif COMP == 2:
        n_comp = n_sel
    else:
        n_comp = 0
    nb_win = tl.cdiv(n_win, BN)
    n_split = _own_split(nb_win + tl.cdiv(n_comp, BN), SPLIT, OWN_SPLIT, LOG_CAP)
    m = tl.full((BH,), NEG, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc_lo = tl.zeros((BH, BD2), tl.float32)
    acc_hi = tl.zeros((BH, BD2), tl.float32)
    # blocks of the window, then of the compressed rows; block j of the sequence goes to split j % n_split
    # (two loops rather than a branch choosing the base pointer, which AMD's Triton 3.6 cannot compile)
    r = tl.arange(0, BN)
    mine = split < n_split  # splits past the query's own count read nothing (OWN_SPLIT)
    for b in range(split, tl.where(mine, nb_win, 0), n_split):
        row = lo + b * BN + r
        at = ring_base + row % window if BATCH else row
        m, l, acc_lo, acc_hi = _block(q_lo, q_hi, win_ptr, win_ptr, at, row <= hi, D, sm_scale, m, l,
                                      acc_lo, acc_hi, BD2, FAST, 0)  # fmt: skip
    for b in range((split - nb_win % n_split + n_split) % n_split, tl.where(mine, tl.cdiv(n_comp, BN), 0), n_split):
        c = b * BN + r
        if COMP == 2:
            row = tl.load(sel_ptr + i * n_sel + c, mask=c < n_sel, other=-1)
            ok = row >= 0
        else:
            row = c
            ok = c < n_comp
        page = tl.load(pages + row // PAGE, mask=ok, other=0).to(tl.int64)
        m, l, acc_lo, acc_hi = _block(q_lo, q_hi, comp_ptr, comp_rest_ptr, page * PAGE + row % PAGE, ok, D,
                                      sm_scale, m, l, acc_lo, acc_hi, BD2, FAST, COMP_EXACT)  # fmt: skip
    if SPLIT == 1:
        acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), [BH, BD])
        p = _position(pos_ptr, i, BATCH)
        _finish(acc, m, l, sinks_ptr, inv_ptr, p, out_ptr, i, hg, heads_ok, D, H, ROPE_DIM, BH, BD)
    elif mine:  # the splits' partial results merge pairwise, up a tree (`_merge_splits`)
        tickets = ticket_ptr + (i * tl.num_programs(1) + hg) * SPLIT
        _merge_splits(m, l, acc_lo, acc_hi, m_ptr, l_ptr, acc_ptr, tickets, sinks_ptr, inv_ptr, pos_ptr, out_ptr, i, hg,
                      split, n_split, heads_ok, D, H, SPLIT, ROPE_DIM, BH, BD, BATCH)  # fmt: skip


@triton.jit
def _own_split(blocks, SPLIT: tl.constexpr, OWN_SPLIT: tl.constexpr, LOG_CAP: tl.constexpr):
    """The splits a query's key blocks are dealt to: the launch's SPLIT, or with OWN_SPLIT the largest
    power of two up to 2^LOG_CAP and up to its own `blocks`, which depends on nothing but the query's
    position and the layer (not on the other sequences of a batch nor on the launch's grid)."""
    if OWN_SPLIT:
        n = tl.full([], 1, tl.int32)
        for _ in tl.static_range(LOG_CAP):
            n = tl.where(2 * n <= blocks, 2 * n, n)
        n = tl.minimum(n, SPLIT)  # the grid's (never below it where the launch's bound holds the rows)
    else:
        n = tl.full([], SPLIT, tl.int32)
    return n


@triton.jit
def _block(q_lo, q_hi, rows_ptr, rest_ptr, row, ok, D, sm_scale, m, l, acc_lo, acc_hi,
           BD2: tl.constexpr, FAST: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    """One online-softmax step over the key rows `row` (masked by `ok`): whole rows of `rows_ptr`
    (EXACT = 0), or their first EXACT dims there and the rest in `rest_ptr`."""
    k_lo = _load_cols(rows_ptr, rest_ptr, row, ok, D, 0, BD2, EXACT)
    k_hi = _load_cols(rows_ptr, rest_ptr, row, ok, D, BD2, BD2, EXACT)
    s = _dot(q_lo, tl.trans(k_lo), FAST) + _dot(q_hi, tl.trans(k_hi), FAST)
    s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc_lo = acc_lo * alpha[:, None] + _dot(p, k_lo, FAST)
    acc_hi = acc_hi * alpha[:, None] + _dot(p, k_hi, FAST)
    return m_new, l, acc_lo, acc_hi


@triton.jit
def _load_cols(rows_ptr, rest_ptr, row, ok, D, C0: tl.constexpr, BW: tl.constexpr, EXACT: tl.constexpr):
    """Columns C0 .. C0 + BW of the rows in float32 (a bf16 part is widened straight after its load)."""
    r = row.to(tl.int64)[:, None]
    c = C0 + tl.arange(0, BW)
    if EXACT == 0:
        cols = tl.load(rows_ptr + r * D + c[None, :], mask=ok[:, None] & (c < D)[None, :], other=0.0)
    else:
        head = tl.load(rows_ptr + r * EXACT + c[None, :], mask=ok[:, None] & (c < EXACT)[None, :], other=0.0)
        if C0 + BW <= EXACT:  # these columns lie in the leading part only
            cols = head.to(tl.float32)
        else:
            in_tail = (c >= EXACT) & (c < D)
            tail = tl.load(rest_ptr + r * (D - EXACT) + (c - EXACT)[None, :], mask=ok[:, None] & in_tail[None, :],
                           other=0.0)  # fmt: skip
            cols = head.to(tl.float32) + tail
    return cols


@triton.jit
def _dot(a, b, FAST: tl.constexpr):
    if FAST:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _merge_splits(m, l, acc_lo, acc_hi, m_ptr, l_ptr, acc_ptr, ticket_ptr, sinks_ptr, inv_ptr, pos_ptr, out_ptr, i,
                  hg, split, n_split, heads_ok, D, H: tl.constexpr, SPLIT: tl.constexpr, ROPE_DIM: tl.constexpr,
                  BH: tl.constexpr, BD: tl.constexpr, BATCH: tl.constexpr):  # fmt: skip
    """Split `split`'s partial result (m, l, acc) of a (token, head group) merged with the others of the
    first n_split, pairwise up a binary tree: at width w the subtrees starting at f and f + w (f a
    multiple of 2w) merge, the lower one first, by whichever of their two holders draws the last of
    the pair's two tickets (`runtime.last_program`; ticket_ptr holds SPLIT counters, the pair's is
    f + w - 1); the other stops. The holder of the whole tree finishes. So the step's path has log2
    n_split merges of one partial each, where merging all of them in one program read them one
    after another (n_split round trips to L2). The tree's shape depends on n_split only, so the
    result does too (batch invariance); one split finishes its own rows, with their own bits."""
    BD2: tl.constexpr = BD // 2
    h = hg * BH + tl.arange(0, BH)
    d = tl.arange(0, BD2)
    base = (i.to(tl.int64) * H + h) * SPLIT  # [BH]: each head's split 0
    lo_ok = heads_ok[:, None] & (d < D)[None, :]
    hi_ok = heads_ok[:, None] & (BD2 + d < D)[None, :]
    first = split  # the first split of the subtree this program holds
    holding = split < n_split
    width = 1
    while width < n_split:
        other = first ^ width  # the sibling subtree's first split
        if holding & (other < n_split):
            part = base + first
            tl.store(m_ptr + part, m, mask=heads_ok)
            tl.store(l_ptr + part, l, mask=heads_ok)
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc_lo, mask=lo_ok)
            tl.store(acc_ptr + part[:, None] * D + BD2 + d[None, :], acc_hi, mask=hi_ok)
            holding = last_program(ticket_ptr + (first & ~(2 * width - 1)) + width - 1, 2)
            if holding:
                them = base + other
                m_o = tl.load(m_ptr + them, mask=heads_ok, other=NEG, cache_modifier=".cg")
                l_o = tl.load(l_ptr + them, mask=heads_ok, other=0.0, cache_modifier=".cg")
                lo_o = tl.load(acc_ptr + them[:, None] * D + d[None, :], mask=lo_ok, other=0.0, cache_modifier=".cg")
                hi_o = tl.load(acc_ptr + them[:, None] * D + BD2 + d[None, :], mask=hi_ok, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                low = first < other  # this program's subtree is the lower one: it goes first
                m_a, m_b = tl.where(low, m, m_o), tl.where(low, m_o, m)
                m = tl.maximum(m_a, m_b)
                w_a, w_b = tl.exp(m_a - m), tl.exp(m_b - m)
                l = tl.where(low, l, l_o) * w_a + tl.where(low, l_o, l) * w_b
                acc_lo = tl.where(low, acc_lo, lo_o) * w_a[:, None] + tl.where(low, lo_o, acc_lo) * w_b[:, None]
                acc_hi = tl.where(low, acc_hi, hi_o) * w_a[:, None] + tl.where(low, hi_o, acc_hi) * w_b[:, None]
                first = tl.minimum(first, other)
        width *= 2
    if holding:
        acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), [BH, BD])
        _finish(acc, m, l, sinks_ptr, inv_ptr, _position(pos_ptr, i, BATCH), out_ptr, i, hg, heads_ok, D, H, ROPE_DIM,
                BH, BD)  # fmt: skip


def decode_split(device: torch.device, t: int, groups: int, row_blocks: int) -> int:
    """Row splits per (token, head group) so the t * groups * splits programs cover every SM.

    A power of two (each is a kernel specialisation), at most the key blocks a program could read.
    """
    want = triton.next_power_of_2(triton.cdiv(multiprocessors(device), t * groups))
    return max(1, min(want, 1 << (max(1, row_blocks).bit_length() - 1)))


def own_split(device: torch.device, precision: Precision, t: int, groups: int, row_blocks: int) -> tuple[int, int]:
    """(the launch's splits, log2 of the cap of each query's own) for a decode launch.

    Exact decode (batch invariance, issue 37): a query's key blocks are dealt over as many splits as
    one token alone would take, `decode_split` for t = 1 over its own blocks (the kernel's
    `_own_split`), so the order its scores and values add in depends on its position only, not on how
    many sequences share the launch or how far the others reach; the grid has the most any of them
    takes. Fast decode keeps one split count for the launch: (`decode_split`, 0).
    """
    if precision.fast:
        return decode_split(device, t, groups, row_blocks), 0
    cap = decode_split(device, 1, groups, 1 << 30)
    return min(cap, decode_split(device, 1, groups, row_blocks)), cap.bit_length() - 1


def _tiles(heads: int, d: int, window: int) -> tuple[int, int]:
    """Heads per program (tl.dot needs at least 16 rows) and key rows per block."""
    if interpreting():  # big blocks: the interpreter pays per program
        return max(16, next_pow2(heads)), max(16, min(128, next_pow2(window)))
    return 16, 16 if next_pow2(d) >= 512 else 32


def attention(
    q: torch.Tensor,
    window_rows: torch.Tensor,
    n_prev: int,
    window: int,
    sinks: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    pos: torch.Tensor,
    comp_rows: PagedRows | None = None,
    ratio: int = 0,
    selected: torch.Tensor | None = None,
    split: int | None = 1,
    precision: Precision = EXACT,
    comp_bound: int | None = None,
    reach: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [T, H, D] with the RoPE undone.

    `split` row splits per head group; None chooses them from the device (`decode_split`): enough
    programs for every SM when a chunk has few tokens, 1 for prefill.
    q [T, H, D] contiguous; window_rows [n_prev + T, D] (the state's raw rows, then the chunk's);
    comp_rows the sequence's paged rows (table [n]) with `ratio` (all visible rows) or `selected`
    int32 [T, k] (ratio-4 layers), `comp_bound` the rows the chunk can see at most (default: all the
    table reaches; it sizes the split); pos int32 [1] = p0; inv_freq float64 [rope_dim / 2], the
    layer's RoPE frequencies (the inverse rotation's angles are formed from the positions).
    `reach` int32 [T, 2] (a chunk with a bidirectional image span, `image_spans.window_reach`): each
    query's first and last window row, in place of its causal window; the compressed rows stay causal.
    """
    t, heads, d = q.shape
    bh, bn = _tiles(heads, d, window)
    out = torch.empty(t, heads, d, device=q.device, dtype=torch.float32)
    log_cap = 0
    if split is None:
        # bounded by buffer sizes, not by the device position, so a captured decode step stays valid
        n_comp = 0
        if comp_rows is not None:
            n_comp = selected.shape[1] if selected is not None else comp_bound or comp_rows.capacity
        row_blocks = triton.cdiv(min(window, window_rows.shape[0]), bn) + triton.cdiv(n_comp, bn)
        if t == 1:  # a decode step alone: as the batch form splits it
            split, log_cap = own_split(q.device, precision, 1, triton.cdiv(heads, bh), row_blocks)
        else:
            split = decode_split(q.device, t, triton.cdiv(heads, bh), row_blocks)
    return _launch(q, window_rows, comp_rows, selected, sinks, pos, None, inv_freq, out, split, precision,
                   n_prev=n_prev, window=window, ratio=ratio, rope_dim=rope_dim, bh=bh, bn=bn,
                   log_cap=log_cap, reach=reach)  # fmt: skip


def block_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    sinks: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    pos: torch.Tensor,
    precision: Precision = EXACT,
) -> torch.Tensor:
    """A block's queries q [T, H, D] at positions pos[0].. over all of rows [R, D] (the window before
    the block, then the block's own T rows): output [T, H, D] with the RoPE undone (a DSpark block
    attends within itself both ways). The chunk form, in one launch: its query i reads the `window`
    rows up to its own, n_prev + i - window + 1 .. n_prev + i; over the rows followed by their first
    T - 1 again, with n_prev = R - 1 and window = R, those are rows i .. R - 1 + i, every one of the R
    once (only the order the sum takes them in turns with i)."""
    r, t = rows.shape[0], q.shape[0]
    wrapped = torch.cat((rows, rows[: t - 1]))
    return attention(q, wrapped, r - 1, r, sinks, inv_freq, rope_dim, pos, split=1, precision=precision)


def attention_batch(
    q: torch.Tensor,
    rings: torch.Tensor,
    sinks: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    pos: torch.Tensor,
    slots: torch.Tensor,
    comp_rows: PagedRows | None = None,
    comp_bound: int = 0,
    ratio: int = 0,
    selected: torch.Tensor | None = None,
    precision: Precision = EXACT,
) -> torch.Tensor:
    """One decode token for each of B sequences in one launch: output [B, H, D] with the RoPE undone.

    q [B, H, D] contiguous; rings [slots, window, D], the KV cache block's raw windows, already
    holding each sequence's own row (position p in row p mod window); comp_rows the block's paged
    rows (table [slots, n]) with `ratio` (all visible rows) or `selected` int32 [B, k] (ratio-4
    layers), `comp_bound` the rows any of them can see (it sizes the split); pos, slots int32 [B]:
    each sequence's position and slot in the block; inv_freq float64 [rope_dim / 2]. The splits of a
    (sequence, head group) are combined by the last of them to finish (ticket counters of
    `runtime.ticket_counters`), so the step is one launch.
    """
    per_sequence(pos, slots)
    b, heads, d = q.shape
    window = rings.shape[1]
    bh, bn = _tiles(heads, d, window)
    out = torch.empty(b, heads, d, device=q.device, dtype=torch.float32)
    n_comp = 0 if comp_rows is None else selected.shape[1] if selected is not None else comp_bound
    row_blocks = triton.cdiv(window, bn) + triton.cdiv(n_comp, bn)
    split, log_cap = own_split(q.device, precision, b, triton.cdiv(heads, bh), row_blocks)
    return _launch(q, rings.view(-1, d), comp_rows, selected, sinks, pos, slots, inv_freq, out, split, precision,
                   n_prev=0, window=window, ratio=ratio, rope_dim=rope_dim, bh=bh, bn=bn, log_cap=log_cap)  # fmt: skip


def _launch(q, window_rows, comp_rows, selected, sinks, pos, slots, inv_freq, out, split, precision, *,
            n_prev, window, ratio, rope_dim, bh, bn, log_cap=0, reach=None):  # fmt: skip
    """The attention launch shared by the chunk and batch forms; log_cap > 0: each query's own split
    (`own_split`); `reach`: the chunk form's window rows per query (`attention`)."""
    t, heads, d = q.shape
    bd, groups = next_pow2(d), triton.cdiv(heads, bh)
    comp = COMP_NONE if comp_rows is None else (COMP_SELECTED if selected is not None else COMP_ALL)
    m = l = acc = out
    if split > 1:
        m = torch.empty(t, heads, split, device=q.device, dtype=torch.float32)
        l = torch.empty(t, heads, split, device=q.device, dtype=torch.float32)
        acc = torch.empty(t, heads, split, d, device=q.device, dtype=torch.float32)
    comp_ptr, comp_rest, comp_exact = comp_rows.parts() if comp_rows is not None else (window_rows, window_rows, 0)
    table, table_stride = (comp_rows.table, comp_rows.table_stride) if comp_rows is not None else (pos, 0)
    sel_ptr = selected if selected is not None else pos
    tickets = ticket_counters(q.device, "attention", t * groups * split) if split > 1 else pos
    _attention_kernel[(t, groups, split)](
        q, window_rows, comp_ptr, comp_rest, table, sel_ptr, sinks, pos, slots if slots is not None else pos,
        inv_freq, out, m, l, acc, tickets, reach if reach is not None else pos, d, n_prev, window,
        selected.shape[1] if selected is not None else 0, table_stride, 1.0 / math.sqrt(d),
        H=heads, COMP=comp, RATIO=max(ratio, 1), SPLIT=split, ROPE_DIM=rope_dim,
        BH=bh, BN=bn, BD=bd, FAST=precision.fast, BATCH=slots is not None, COMP_EXACT=comp_exact, PAGE=PAGE_ROWS,
        OWN_SPLIT=log_cap > 0, LOG_CAP=log_cap, REACH=reach is not None, num_warps=8 if bd >= 512 else 4,
        num_stages=1, **dependent_launch(),
    )  # fmt: skip
    return out


def reference(q, window_rows, n_prev, window, sinks, angles, p0, comp_rows=None, ratio=0, selected=None):
    """ops.sink_attention over the same visible rows, then the inverse RoPE."""
    t = q.shape[0]
    qpos = torch.arange(t, device=q.device) + n_prev  # window row index of each query's own row
    rows = torch.arange(window_rows.shape[0], device=q.device)
    age = qpos[:, None] - rows[None, :]
    keys, mask = window_rows, (age >= 0) & (age < window)
    if comp_rows is not None:
        if selected is not None:
            vis = torch.zeros(t, comp_rows.shape[0], dtype=torch.bool, device=q.device)
            for r, sel in enumerate(selected.tolist()):
                vis[r, [c for c in sel if c >= 0]] = True
        else:
            n_vis = (torch.arange(t, device=q.device) + p0 + 1) // ratio
            vis = torch.arange(comp_rows.shape[0], device=q.device)[None, :] < n_vis[:, None]
        keys, mask = torch.cat((window_rows, comp_rows)), torch.cat((mask, vis), dim=1)
    o = ops.sink_attention(q, keys, mask, sinks)
    return ops.apply_rope(o, *angles, inverse=True)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Decode of one token at context `ctx` in a ratio-4 layer (window + top-k rows) and a ratio-128
    layer (window + every row), and a prefill chunk of a ratio-128 layer starting at position 0."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    inv = torch.tensor(yarn_inv_freq(a, a.layer(a.n_layers - 1)), dtype=torch.float64, device=dev)
    sinks = torch.zeros(a.n_heads, device=dev)
    cases = []
    exact = a.head_dim - a.rope_dim
    row_bytes = 2 * exact + 4 * a.rope_dim

    def compact(*lead: int, n: int) -> PagedRows:  # random rows as a compact cache keeps them (Triton with QAT)
        return PagedRows.scattered(torch.randn(*lead, max(n, 1), a.head_dim, device=dev, generator=gen), 0, exact)

    def case(name: str, t: int, p0: int, n_comp: int, ratio: int, selected, split: int | None, precision=EXACT):
        q = torch.randn(t, a.n_heads, a.head_dim, device=dev, generator=gen)
        n_prev = min(p0, a.window)
        window_rows = torch.randn(n_prev + t, a.head_dim, device=dev, generator=gen)
        comp = compact(n=n_comp)
        pos = torch.tensor([p0], dtype=torch.int32, device=dev)
        window_read, comp_read = min(p0 + t, a.window), selected.shape[1] if selected is not None else n_comp
        rows_read = window_read + comp_read
        run = functools.partial(
            attention, q, window_rows, n_prev, a.window, sinks, inv, a.rope_dim, pos, comp, ratio, selected,
            split, precision,
        )  # fmt: skip
        moved = 4 * a.head_dim * (window_read + 2 * t * a.n_heads) + row_bytes * comp_read  # float32 window
        cases.append(BenchCase("attention", name, run, moved, 4 * t * a.n_heads * a.head_dim * rows_read))

    n4, n128 = shape.ctx // 4, shape.ctx // 128
    k = min(a.index_topk, n4)
    sel = torch.randperm(n4, device=dev, generator=gen)[:k].to(torch.int32).view(1, k)
    case(f"decode ratio 4 at {shape.ctx}: {a.window} + {k} rows", 1, shape.ctx, n4, 4, sel, None)
    case(f"decode ratio 128 at {shape.ctx}: {a.window} + {n128} rows", 1, shape.ctx, n128, 128, None, None)
    t = shape.prefill
    case(f"prefill ratio 128, {t} tokens from 0 (bf16 dot)", t, 0, t // 128, 128, None, 1, FAST)
    cases.append(_batch_case(shape, inv, sinks, BATCH_BENCH, n4, k, compact, row_bytes))
    return cases


BATCH_BENCH = 8  # sequences of the batched decode bench case


def _batch_case(shape: BenchShape, inv, sinks, b: int, n4: int, k: int, compact, row_bytes: int) -> BenchCase:
    """One launch for b sequences, each at context `ctx` in its own slot: a ratio-4 decode step."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    q = torch.randn(b, a.n_heads, a.head_dim, device=dev, generator=gen)
    rings = torch.randn(b, a.window, a.head_dim, device=dev, generator=gen)
    comp = compact(b, n=n4)
    pos = torch.full((b,), shape.ctx, dtype=torch.int32, device=dev)
    slots = torch.arange(b, dtype=torch.int32, device=dev)
    sel = torch.stack([torch.randperm(n4, device=dev, generator=gen)[:k] for _ in range(b)]).to(torch.int32)
    run = functools.partial(attention_batch, q, rings, sinks, inv, a.rope_dim, pos, slots, comp, n4, 4, sel)
    rows_read = b * (a.window + k)
    moved = 4 * a.head_dim * (b * a.window + 2 * b * a.n_heads) + row_bytes * b * k
    name = f"decode batch of {b}, ratio 4 at {shape.ctx}: {a.window} + {k} rows each"
    return BenchCase("attention", name, run, moved, 4 * a.n_heads * a.head_dim * rows_read)
