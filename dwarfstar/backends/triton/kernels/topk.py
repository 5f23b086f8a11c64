"""Top-k indices of each row of a score matrix, on the device, with a per-row valid length.

Used by the lightning indexer (k = 512 Flash / 1024 PRO among up to 262k compressed rows at 1M
context) and by device sampling (up to 1024 of the vocabulary).

A round splits each row into blocks of BLOCK entries; one program finds its block's k best by radix
selection instead of sorting: scores are mapped to unsigned integers of the same order, and the
k-th largest is found four bits at a time (8 steps, each one 16-bin histogram). The entries above
it, plus as many entries equal to it as fit, lowest index first, are compacted in index order.
Rounds repeat on the survivors (score and index) until one block remains: log_{BLOCK/k}(n) rounds,
each launch sized from the buffer's capacity, not the data, so a decode step launches the same
kernels at every position. A row with no more than k valid entries selects them all in the first
round. Ties at the boundary go to the lower index, so the selection is deterministic; the indices
come out in ascending order, not by score.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    dependent_launch,
    interpreting,
    next_pow2,
    wait_for_inputs,
)


@triton.jit
def order_key(scores, valid):
    """uint32-ordered int64 keys of float32 scores (0 .. 2^32 - 1); invalid entries get -1."""
    bits = scores.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)  # positive: above 2^31; negative: reversed
    return tl.where(valid, key, -1)


@triton.jit
def kth_largest(key, k):
    """The k-th largest key, or -1 if fewer than k keys are valid (>= 0).

    Radix selection four bits at a time: a 16-bin histogram of the next digit of the keys that share
    the digits chosen so far gives, with the count of keys already above them, the largest digit
    that keeps at least k keys at or above the threshold.
    """
    n_valid = tl.sum((key >= 0).to(tl.int32), axis=0)
    prefix = tl.full((), 0, tl.int64)
    above = tl.full((), 0, tl.int32)  # keys greater than every key sharing the prefix
    d = tl.arange(0, 32)
    for step in tl.static_range(8):
        shift = 28 - 4 * step
        match = (key >= 0) & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
        hist = tl.histogram(tl.where(match, (key >> shift) & 15, 16).to(tl.int32), 32)  # bins 16+: no match
        hist = tl.where(d < 16, hist, 0)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # matching keys with digit >= d
        best = tl.max(tl.where((d < 16) & (above + at_least >= k), d, 0), axis=0)
        above += tl.sum(tl.where(d > best, hist, 0), axis=0)
        prefix += best.to(tl.int64) << shift
    return tl.where(n_valid >= k, prefix, -1)


@triton.jit
def _load(ptr, mask, other, CG: tl.constexpr):
    if CG:  # written by other programs of the launch: read past L1
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def select_block(
    scores_ptr, idx_ptr, valid_ptr, out_scores_ptr, out_idx_ptr, final_ptr, row, blk, N, n_in, stride_in, n_blocks, k,
    FIRST: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr, CG: tl.constexpr,
):  # fmt: skip
    """One block of one row in a round: its k best (score, index) candidates, compacted in index order
    into slots (row * n_blocks + blk) * k of the round's outputs. A row with no more than k valid
    entries is done by the first round: its indices, then -1, straight into `final_ptr` [rows, k].
    CG: the inputs were written by other programs of the same launch."""
    n_row = tl.minimum(_load(valid_ptr + row, True, 0, CG), N)
    if n_row <= k:  # everything valid is selected, by the first round: indices in order, then -1
        if FIRST and blk == 0:
            j = tl.arange(0, KP)
            tl.store(final_ptr + row * k + j, tl.where(j < n_row, j, -1), mask=j < k)
    else:
        i = blk * BLOCK + tl.arange(0, BLOCK)
        in_row = row.to(tl.int64) * stride_in + i
        if FIRST:
            idx = i
            live = i < n_row
        else:
            idx = _load(idx_ptr + in_row, i < n_in, -1, CG)
            live = idx >= 0
        s = _load(scores_ptr + in_row, live, 0.0, CG)
        key = order_key(s, live)
        kth = kth_largest(key, k)
        above = key > kth
        tied = (key == kth).to(tl.int32)
        take = above | ((tl.cumsum(tied, axis=0) <= k - tl.sum(above.to(tl.int32), axis=0)) & (tied != 0))
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
        out = (row.to(tl.int64) * n_blocks + blk) * k + slot
        tl.store(out_idx_ptr + out, tl.where(live, idx, -1), mask=take)
        if not FINAL:
            tl.store(out_scores_ptr + out, s, mask=take)


@triton.jit
def _round_kernel(
    scores_ptr, idx_ptr, valid_ptr, out_scores_ptr, out_idx_ptr, final_ptr, N, n_in, stride_in, n_blocks, k,
    FIRST: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    select_block(scores_ptr, idx_ptr, valid_ptr, out_scores_ptr, out_idx_ptr, final_ptr, tl.program_id(0),
                 tl.program_id(1), N, n_in, stride_in, n_blocks, k, FIRST, FINAL, BLOCK, KP, False)  # fmt: skip


def block_size(k: int) -> int:
    return max(next_pow2(4 * k), 256 if interpreting() else 4096)


def topk_indices(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, N] float32 (row stride free), valid int32 [R] -> int32 [R, k], -1 where fewer.

    Row r selects among its first min(valid[r], N) entries, in ascending index order.
    """
    rows, n = scores.shape
    out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    return finish_rounds(scores, out, valid, n, n, scores.stride(0), k, out, first=True)


def finish_rounds(
    cand_scores: torch.Tensor,
    cand_idx: torch.Tensor,
    valid: torch.Tensor,
    width: int,
    n_in: int,
    stride: int,
    k: int,
    out: torch.Tensor,
    first: bool = False,
) -> torch.Tensor:
    """Rounds over candidates (scores and indices [R, n_in], row stride `stride`; with `first`, the
    scores [R, width] themselves, the indices implied) until one block remains, the last round writing
    `out` [R, k]; `width` is what the scores had, which bounds each row's valid count."""
    rows, block = out.shape[0], block_size(k)
    while first or n_in > k:
        n_blocks = triton.cdiv(n_in, block)
        final = n_blocks == 1
        next_scores = out if final else torch.empty(rows, n_blocks * k, device=out.device)
        next_idx = out if final else torch.empty(rows, n_blocks * k, dtype=torch.int32, device=out.device)
        _round_kernel[(rows, n_blocks)](
            cand_scores, cand_idx, valid, next_scores, next_idx, out, width, n_in, stride, n_blocks, k,
            FIRST=first, FINAL=final, BLOCK=block, KP=next_pow2(k), num_warps=8, **dependent_launch(),
        )  # fmt: skip
        cand_scores, cand_idx, n_in, stride, first = next_scores, next_idx, n_blocks * k, n_blocks * k, False
    return out


@triton.jit
def _valid_first_kernel(picks_ptr, scores_ptr, pos_ptr, out_ptr, n, k, stride_s, ratio, KP: tl.constexpr):
    # one program per query: its picks it can see (index < (p + 1) // ratio) scoring above -inf, ascending,
    # then -1 (the others and the padding sorted past every index as n)
    r = tl.program_id(0)
    j = tl.arange(0, KP)
    ok = j < k
    pick = tl.load(picks_ptr + r * k + j, mask=ok, other=0)
    seen = (tl.load(pos_ptr + r) + 1) // ratio
    score = tl.load(scores_ptr + r.to(tl.int64) * stride_s + pick, mask=ok, other=0.0)
    keep = ok & (pick < seen) & (score != float("-inf"))
    key = tl.sort(tl.where(keep, pick, n))
    tl.store(out_ptr + r * k + j, tl.where(key == n, -1, key).to(tl.int64), mask=ok)


def valid_first(scores: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """`backends.reference.v41.select.valid_first` in one launch: scores float32 [T, n] (row stride free),
    picks int32 [T, K] (each in 0..n - 1), positions [T] on the device -> int64 [T, K]."""
    t, k = picks.shape
    out = torch.empty(t, k, dtype=torch.int64, device=picks.device)
    if t and k:
        _valid_first_kernel[(t,)](
            picks.to(torch.int32).contiguous(), scores, positions, out, scores.shape[1], k, scores.stride(0), ratio,
            KP=next_pow2(k), num_warps=4,
        )  # fmt: skip
    return out


def reference(scores: torch.Tensor, valid: torch.Tensor, k: int) -> list[set[int]]:
    """The chosen index set per row: all valid entries if at most k, else the k best (torch.topk)."""
    chosen = []
    for row, n in zip(scores, valid.tolist(), strict=True):
        n = min(n, scores.shape[1])
        chosen.append(set(range(n)) if n <= k else set(row[:n].topk(k).indices.tolist()))
    return chosen


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The indexer's selection at decode: index_topk of the ctx / 4 row scores; then V4.1's kept picks
    ordered (`valid_first`)."""
    a, dev = shape.args, shape.device
    n = max(shape.ctx // 4, 1)
    scores = torch.randn(1, n, device=dev, generator=shape.generator())
    valid = torch.full((1,), n, dtype=torch.int32, device=dev)
    run = functools.partial(topk_indices, scores, valid, a.index_topk)
    k = min(a.index_topk, n)
    picks = torch.arange(k, dtype=torch.int32, device=dev)[None, :]
    order = functools.partial(valid_first, scores, picks, torch.full((1,), shape.ctx, device=dev), 4)
    return [
        BenchCase("topk", f"decode: top {a.index_topk} of {n}", run, 4 * n),
        BenchCase("topk", f"V4.1 decode: {k} kept picks ordered", order, 16 * k),
    ]
