"""Group the (token, slot) routing entries by expert and cut them into tiles for the expert GEMM of a
prefill chunk (a decode step's few entries skip the sort: `moe_experts.decode_ffn`).

Entry j = t * k + slot of the [T, k] expert ids. Three small launches, all sized from T * k and the
expert count, never from the data, so a decode step can be captured in a CUDA graph:

1. `_count_kernel`: a histogram of experts by atomic add; the value the add returns is the entry's
   rank inside its expert (the order within an expert does not matter: rows are independent).
2. `_tiles_kernel` (one program): exclusive prefix sums give each expert's start in sorted order and
   its first tile; tile slot s then belongs to the expert whose tile range contains s, found with
   one [tiles, experts] comparison instead of a serial loop over experts. Each tile holds up to BM
   entries of one expert; unused tile slots get expert -1. Experts nobody chose get no tile.
3. `_scatter_kernel`: sorted[start(expert) + rank] = entry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2


@dataclass
class ExpertTiles:
    sorted_entries: torch.Tensor  # int32 [T * k]: entries grouped by expert
    tile_expert: torch.Tensor  # int32 [n_tiles], -1 for an unused slot
    tile_start: torch.Tensor  # int32 [n_tiles]: first position in sorted_entries
    tile_rows: torch.Tensor  # int32 [n_tiles]: entries in the tile (<= block_m)
    block_m: int
    k: int  # routing slots per token: entry // k is the token


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, n, B: tl.constexpr):
    j = tl.program_id(0) * B + tl.arange(0, B)
    ok = j < n
    expert = tl.load(ids_ptr + j, mask=ok, other=0)
    tl.store(rank_ptr + j, tl.atomic_add(counts_ptr + expert, 1, mask=ok), mask=ok)


@triton.jit
def _tiles_kernel(
    counts_ptr, start_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, E, n_tiles,
    BM: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BE)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    start = tl.cumsum(counts, axis=0) - counts  # exclusive: first sorted position of each expert
    tl.store(start_ptr + e, start, mask=e < E)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)
    tile_first = tile_end - tiles
    for s0 in range(0, n_tiles, BS):
        s = s0 + tl.arange(0, BS)
        # experts entirely before slot s; the slot's expert is the next one (tile ranges are ordered)
        before = (tile_end[None, :] <= s[:, None]) & (e < E)[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        first = tl.sum(tl.where(before, tiles[None, :], 0), axis=1)  # = tile_first[expert]
        begin = tl.sum(tl.where(before, counts[None, :], 0), axis=1)  # = start[expert]
        upto = (tile_first[None, :] <= s[:, None]) & (e < E)[None, :]
        end = tl.sum(tl.where(upto, counts[None, :], 0), axis=1)  # = start[expert] + counts[expert]
        row0 = begin + (s - first) * BM
        used = expert < E
        tl.store(tile_expert_ptr + s, tl.where(used, expert, -1), mask=s < n_tiles)
        tl.store(tile_start_ptr + s, row0, mask=s < n_tiles)
        tl.store(tile_rows_ptr + s, tl.where(used, tl.minimum(end - row0, BM), 0), mask=s < n_tiles)


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, start_ptr, sorted_ptr, n, B: tl.constexpr):
    j = tl.program_id(0) * B + tl.arange(0, B)
    ok = j < n
    expert = tl.load(ids_ptr + j, mask=ok, other=0)
    at = tl.load(start_ptr + expert, mask=ok, other=0) + tl.load(rank_ptr + j, mask=ok, other=0)
    tl.store(sorted_ptr + at, j, mask=ok)


def tile_rows_for(n_entries: int, n_experts: int, max_rows: int = 64) -> int:
    """Tile height: tensor-core tiles (up to max_rows) once experts average 12+ entries, else GEMV rows."""
    mean = n_entries / n_experts
    if interpreting():
        return min(max_rows, next_pow2(n_entries))
    rows = 64 if mean >= 48 else 32 if mean >= 24 else 16 if mean >= 12 else 1
    return min(rows, max_rows)


def sort_by_expert(ids: torch.Tensor, n_experts: int, block_m: int | None = None) -> ExpertTiles:
    """ids int32 [T, k] -> the entries grouped by expert and the tile table."""
    t, k = ids.shape
    n = t * k
    block_m = block_m or tile_rows_for(n, n_experts)
    device = ids.device
    counts = torch.zeros(n_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    start = torch.empty(n_experts, dtype=torch.int32, device=device)
    n_tiles = triton.cdiv(n, block_m) + min(n_experts, n)
    tiles = ExpertTiles(
        sorted_entries=torch.empty(n, dtype=torch.int32, device=device),
        tile_expert=torch.empty(n_tiles, dtype=torch.int32, device=device),
        tile_start=torch.empty(n_tiles, dtype=torch.int32, device=device),
        tile_rows=torch.empty(n_tiles, dtype=torch.int32, device=device),
        block_m=block_m,
        k=k,
    )
    b = min(1024, next_pow2(n))
    _count_kernel[(triton.cdiv(n, b),)](ids, counts, rank, n, B=b)
    be = next_pow2(n_experts)
    _tiles_kernel[(1,)](
        counts, start, tiles.tile_expert, tiles.tile_start, tiles.tile_rows, n_experts, n_tiles,
        BM=block_m, BE=be, BS=max(1, min(64, 16384 // be)), num_warps=4,
    )  # fmt: skip
    _scatter_kernel[(triton.cdiv(n, b),)](ids, rank, start, tiles.sorted_entries, n, B=b)
    return tiles


def single_expert_tiles(t: int, device: torch.device | str, block_m: int | None = None) -> ExpertTiles:
    """All T tokens through one expert (the shared expert), without a sort; the same table for every
    layer and step of a chunk size, so it is built once (read-only)."""
    return _single_expert_tiles(t, torch.device(device), block_m or tile_rows_for(t, 1))


@functools.lru_cache(maxsize=64)
def _single_expert_tiles(t: int, device: torch.device, block_m: int) -> ExpertTiles:
    n_tiles = triton.cdiv(t, block_m)
    starts = torch.arange(n_tiles, dtype=torch.int32, device=device) * block_m
    return ExpertTiles(
        sorted_entries=torch.arange(t, dtype=torch.int32, device=device),
        tile_expert=torch.zeros(n_tiles, dtype=torch.int32, device=device),
        tile_start=starts,
        tile_rows=(t - starts).clamp(max=block_m),
        block_m=block_m,
        k=1,
    )


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Sorting a decode token's and a prefill chunk's routing entries (launch latency, mostly)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        ids = torch.randint(0, a.n_routed_experts, (t, a.n_activated_experts), device=dev, generator=gen)
        ids = ids.to(torch.int32)
        run = functools.partial(sort_by_expert, ids, a.n_routed_experts)
        cases.append(BenchCase("moe_sort", f"{what} {t} x {a.n_activated_experts} entries", run, 16 * ids.numel()))
    return cases
