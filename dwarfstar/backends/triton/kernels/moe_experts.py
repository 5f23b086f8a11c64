"""The expert FFN of the MoE (spec §2.4): routed experts and the shared expert, SwiGLU with the clamp
fused into the gate/up product, the route weight applied before the down projection.

Decode form (`decode_ffn`, up to DECODE_TOKENS tokens: a decode step): no sort, two launches, with
grids from T and k alone (a captured step replays them).
- `_decode_gate_up_kernel`, grid (F / BN, T * k + 1): column 0 is the shared expert for all T tokens,
  with its own weights and block type (Q8_0 in ds4 files); column 1 + e is routing entry
  e = t * k + slot, its expert read from `ids` on the device. Each program reads gate and up rows
  and writes silu(min(g, L)) * clamp(u, -L, L) (times the route weight) to its row of `mid`, so the
  mid activations never exist unclamped in memory.
- `_decode_down_kernel`, same columns over D: each program writes its entry's down rows to `parts`;
  the last program of a column block to finish (an atomic ticket, reset for the next launch) adds
  each token's k routed slots, in slot order, then its shared expert, into out [T, D]. No float
  atomics: the sum is the same at every replay.
The loops are `expert_blocks`' decoders: fp32 products (EXACT), or fp16 tensor-core operands under
Precision.fast for the formats that have them (the mid activations are then stored as fp16 too);
for 2-bit experts (both matrices IQ2_XXS or Q2_K, `int8_form`) the fast form is `expert_int8`'s: x
quantized to int8 by the routing launch (`moe_route.route(q8=...)`, or by one more launch here), the
routed mid rows quantized by the gate/up kernel that computes them.

Prefill form (`expert_ffn`): the entries sorted by expert (`moe_sort`). For every tile of one
expert's entries, `_gate_up_kernel` gathers the tokens' input rows, decodes the expert's gate and up
blocks once per K step for all the tile's rows, and writes the clamped SwiGLU times the routing
weight; `_down_kernel` multiplies each tile's mid rows by the expert's down blocks and writes every
entry's output to its own row of a [T, slots, D] buffer (slot = the routing slot, or the last slot
for the shared expert, which runs through the same kernels as one expert over all tokens with weight
1), summed by the caller. Tiles of >= 16 rows go through `tl.dot`; smaller tiles (few entries per
expert) use the GEMV form, where each weight block is read once per step. Each program checks its
tile slot and exits at once when unused, so the grid is sized from T * k alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.expert_blocks import EXACT_TYPES, FAST_TYPES, exact_step, fast_step, tables
from dwarfstar.backends.triton.kernels.expert_int8 import Q8_TYPES, Q8Rows, q8_rows_dot, quantize_rows, store_q8
from dwarfstar.backends.triton.kernels.expert_int8 import tables as q8_tables
from dwarfstar.backends.triton.kernels.moe_sort import ExpertTiles, sort_by_expert
from dwarfstar.backends.triton.kernels.quant_blocks import (
    GEMV_CANDIDATES,
    compiles_ptx,
    gemv_search,
    gemv_tile,
    grid_table,
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
    LoopWork,
    Precision,
    dependent_launch,
    interpreting,
    last_program,
    next_pow2,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import QK_K, GGMLType


@triton.jit
def _product(acc, x, w, USE_DOT: tl.constexpr, FAST: tl.constexpr):
    if USE_DOT:
        if FAST:
            return acc + tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return acc + tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _swiglu(g, u, limit):
    """silu(min(g, L)) * clamp(u, -L, L); silu(g) = g / (1 + e^-g), the exponent capped where silu is ~0."""
    g = tl.minimum(g, limit)
    return tl.div_rn(g, 1.0 + tl.exp(tl.minimum(-g, 80.0))) * tl.minimum(tl.maximum(u, -limit), limit)


def _pruner(weights: int):
    """early_config_prune for a kernel reading `weights` weight tiles per step (gate+up: 2, down: 1):
    the heuristic tile for the interpreter and the tensor-core form, a few GEMV tiles to time."""

    def prune(candidates: list[triton.Config], named: dict, **constants) -> list[triton.Config]:
        ggml_type, bk, bm = GGMLType(constants["WTYPE"]), constants["BK"], constants["BM"]
        use_dot, bn, warps = _tile_config(bm, named["N"], ggml_type, bk, weights, constants["FAST"])
        heuristic = triton.Config({"BN": bn}, num_warps=warps, num_stages=1)
        if interpreting() or use_dot:
            return [heuristic]
        return gemv_search(candidates, heuristic, bm, named["N"], ggml_type, bk)

    return prune


@triton.jit
def _tile(sorted_ptr, tile_start_ptr, tile_rows_ptr, expert, N, row_bytes, BM: tl.constexpr, BN: tl.constexpr):
    """Program (column block, tile): the positions pos of the tile's BM routing entries in sorted order
    (their mid rows), which of them exist (m_ok), the entries, and the block's columns n with the byte
    offsets row_off of `expert`'s rows n."""
    tile = tl.program_id(1)
    pos = tl.load(tile_start_ptr + tile) + tl.arange(0, BM)
    m_ok = tl.arange(0, BM) < tl.load(tile_rows_ptr + tile)
    entry = tl.load(sorted_ptr + pos, mask=m_ok, other=0)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    row_off = (expert * N + tl.minimum(n, N - 1)).to(tl.int64) * row_bytes
    return pos, m_ok, entry, n, row_off


_KEY = ["K", "N", "WTYPE", "BM", "BK", "USE_DOT", "FAST"]


@triton.autotune(configs=GEMV_CANDIDATES, key=[*_KEY, "WEIGHTED"], prune_configs_by={"early_config_prune": _pruner(2)})
@triton.jit
def _gate_up_kernel(
    x_ptr, gate_ptr, up_ptr, grid_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr,
    route_w_ptr, mid_ptr, K, N, stride_x, row_bytes, k_slots, limit,
    WTYPE: tl.constexpr, WEIGHTED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_DOT: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    expert = tl.load(tile_expert_ptr + tl.program_id(1))
    if expert >= 0:
        pos, m_ok, entry, n, row_off = _tile(sorted_ptr, tile_start_ptr, tile_rows_ptr, expert, N, row_bytes, BM, BN)
        x_rows = x_ptr + (entry // k_slots).to(tl.int64)[:, None] * stride_x
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
            acc_g = _product(acc_g, x, load_weight_tile(gate_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK),
                             USE_DOT, FAST)  # fmt: skip
            acc_u = _product(acc_u, x, load_weight_tile(up_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK),
                             USE_DOT, FAST)  # fmt: skip
        mid = _swiglu(acc_g, acc_u, limit)
        if WEIGHTED:
            mid = mid * tl.load(route_w_ptr + entry, mask=m_ok, other=0.0)[:, None]
        out = mid_ptr + pos.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(out, mid, mask=m_ok[:, None] & (n < N)[None, :])


@triton.autotune(configs=GEMV_CANDIDATES, key=_KEY, prune_configs_by={"early_config_prune": _pruner(1)})
@triton.jit
def _down_kernel(
    mid_ptr, down_ptr, grid_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, out_ptr,
    K, N, row_bytes, k_slots, out_slots, slot_offset,
    WTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_DOT: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    expert = tl.load(tile_expert_ptr + tl.program_id(1))
    if expert >= 0:
        pos, m_ok, entry, n, row_off = _tile(sorted_ptr, tile_start_ptr, tile_rows_ptr, expert, N, row_bytes, BM, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(mid_ptr + pos.to(tl.int64)[:, None] * K + ks[None, :],
                        mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
            acc = _product(acc, x, load_weight_tile(down_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK), USE_DOT, FAST)
        row = (entry // k_slots) * out_slots + entry % k_slots + slot_offset
        tl.store(out_ptr + row.to(tl.int64)[:, None] * N + n[None, :], acc, mask=m_ok[:, None] & (n < N)[None, :])


def _tile_config(block_m: int, n: int, ggml_type: GGMLType, bk: int, weights: int, fast: bool) -> tuple[bool, int, int]:
    """(use tl.dot, BN, num_warps) for tiles of block_m rows reading `weights` weight tiles per step.

    Tensor-core tiles stage their operands in shared memory (one pipeline stage): the [block_m, bk]
    activations and `weights` decoded [BN, bk] tiles stay within 64 KB, the LDS of AMD GPUs; 8 warps
    keep the decoded tiles in registers without spilling.
    """
    use_dot = block_m >= 16
    if interpreting():
        return use_dot, min(next_pow2(n), 256), 1
    if not use_dot:
        return False, *gemv_tile(block_m, n, ggml_type, bk)
    rows = 65536 // (bk * (2 if fast else 4))  # operand rows of bk columns that fit in 64 KB
    room = max(1, (rows - block_m) // weights)
    # two decoded 256-column tiles of 32 rows next to the operands spill (AMD 132 B, NVIDIA 24 B): 16
    widest = 16 if weights * bk > 256 else 32
    return True, max(16, min(widest, 1 << (room.bit_length() - 1))), 8


def expert_ffn(
    x: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down: QWeight,
    tiles: ExpertTiles,
    route_weights: torch.Tensor | None,
    out: torch.Tensor,
    slot_offset: int,
    limit: float,
    precision: Precision = EXACT,
) -> None:
    """out[t, slot_offset + slot] = down_e(SwiGLU_clamped(gate_e x_t, up_e x_t) * w) for every entry.

    x [T, D] (row stride free); gate/up [E * F, D] and down [E * D, F] as expert stacks; out
    [T, slots, D] contiguous; route_weights [T * k] float32, or None for weight 1 (shared expert).
    """
    d, f = gate.cols, gate.expert_rows
    n_entries = tiles.sorted_entries.numel()
    n_tiles = tiles.tile_expert.numel()
    mid = torch.empty(n_entries, f, device=x.device, dtype=torch.float32)
    use_dot = tiles.block_m >= 16
    bk = tile_k(gate.ggml_type, d, gemm=use_dot)
    grid = grid_table(x.device)
    _gate_up_kernel[lambda meta: (triton.cdiv(f, meta["BN"]), n_tiles)](
        x, gate.data, up.data, grid, tiles.sorted_entries, tiles.tile_expert, tiles.tile_start, tiles.tile_rows,
        route_weights if route_weights is not None else x, mid, d, f, x.stride(0), gate.row_bytes, tiles.k, limit,
        WTYPE=gate.wtype, WEIGHTED=route_weights is not None, BM=tiles.block_m, BK=bk,
        USE_DOT=use_dot, FAST=precision.fast,
    )  # fmt: skip
    bk = tile_k(down.ggml_type, f, gemm=use_dot)
    _down_kernel[lambda meta: (triton.cdiv(d, meta["BN"]), n_tiles)](
        mid, down.data, grid, tiles.sorted_entries, tiles.tile_expert, tiles.tile_start, tiles.tile_rows, out,
        f, d, down.row_bytes, tiles.k, out.shape[1], slot_offset,
        WTYPE=down.wtype, BM=tiles.block_m, BK=bk, USE_DOT=use_dot, FAST=precision.fast,
    )  # fmt: skip


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a launch streams (`runtime.KernelWork`). Sorted tiles (prefill): each tile's expert rows
    once; the decode form: each routing entry's expert rows (as if no two entries shared an expert)
    and the shared expert's once, its main loop the routed rows' (RBK columns of BN rows a pass)."""
    if kernel in ("_gate_up_kernel", "_down_kernel"):
        matrices = 2 if kernel == "_gate_up_kernel" else 1
        entries = a["sorted_ptr"].numel()
        tiles = triton.cdiv(entries, a["BM"]) if a["k_slots"] == 1 else entries
        weight = tiles * matrices * a["N"] * a["row_bytes"]
        activations = 4 * entries * (a["K"] + a["N"])
        loop = matrices * a["BN"] * a["row_bytes"] * a["BK"] // a["K"] + 4 * a["BM"] * a["BK"]
        return KernelWork(weight + activations, weight, triton.cdiv(a["K"], a["BK"]), loop)
    if kernel in ("_decode_gate_up_kernel", "_decode_down_kernel"):
        gate_up = kernel == "_decode_gate_up_kernel"
        matrices = 2 if gate_up else 1
        entries, t = a["T"] * a["k"], a["T"]
        k_in, rows, shared_rows = (a["D"], a["F"], a["FS"]) if gate_up else (a["F"], a["D"], a["D"])
        weight = matrices * (entries * rows * a["row_bytes"] + shared_rows * a["srow_bytes"])
        activations = 4 * (entries + t) * (k_in + rows)
        blocks = triton.cdiv(a["FM"] if gate_up else a["D"], a["BN"])
        x_bytes = (a["x_ptr"] if gate_up else a["mid_ptr"]).element_size()  # mid: fp16 under Precision.fast
        routed = _decode_loops("routed", blocks * entries, matrices, a["RTYPE"], a["BN"], a["row_bytes"], k_in,
                               a["RBK"], 1, x_bytes, a["RFAST"], q8=a["RQ8"])  # fmt: skip
        apart = 1 if a["SFAST"] else t  # `_shared_rows`' fp32 form takes the tokens one at a time
        shared = _decode_loops("shared", blocks, matrices, a["STYPE"], a["SBN"], a["srow_bytes"], k_in, a["SBK"],
                               t // apart, x_bytes, a["SFAST"], parts=a["BN"] // a["SBN"] * apart,
                               rows_loaded=a["TB"] if a["SFAST"] else 1)  # fmt: skip
        return KernelWork(weight + activations, weight, loops=routed + shared)
    return None


def _decode_loops(name: str, programs: int, matrices: int, wtype: int, bn: int, row_bytes: int, k_in: int,
                  bk: int, t: int, x_bytes: int, fast: bool, parts: int = 1,
                  rows_loaded: int = 1, q8: bool = False) -> tuple[LoopWork, ...]:  # fmt: skip
    """The loops of `_routed_rows` / `_shared_rows` (`_rows_dot`) as `runtime.LoopWork`s: one per matrix
    of bn rows and bk columns an iteration (the fp32 and tensor-core forms run gate, then up), or in
    the int8 form (q8) one over both; `parts` row parts of k_in / bk iterations each; t activation
    rows (`rows_loaded` of them loaded: masked rows too), 16 in the tensor-core form. Where a
    compiled loop holds a row's columns in its threads rather than a column's rows, every row loads
    the activations itself: the fp32 2-bit loops (a row's 256 floats a super-block) and the int8
    form (a byte per column, a float scale and a sum per 16: Q2_K's 64 bytes and 8 floats for each of
    4 runs a super-block, IQ2_XXS's 32 bytes and a scale pair for each of 8 groups; sm_90 SASS under
    triton 3.6: per thread and pass of two super-blocks, 32 16-byte and 48 4-byte activation loads
    for Q2_K's one row; for IQ2_XXS's, 16-byte loads of two lattice rows' activation words; the gate
    and up products sharing them)."""
    ggml_type = GGMLType(wtype)
    per_loop = matrices if q8 else 1
    weight = per_loop * bn * row_bytes * bk // k_in
    x_bytes = x_bytes if not q8 else 1 + 4 / 16 + 4 / 16
    x = int((16 if fast and name == "shared" else rows_loaded) * x_bytes * bk)
    if q8:
        x = bn * (4 * 96 if ggml_type == GGMLType.Q2_K else 8 * 40)
    elif not fast and ggml_type in (GGMLType.Q2_K, GGMLType.IQ2_XXS):
        x *= bn
    lookups, gathers = 0, ()
    if ggml_type == GGMLType.IQ2_XXS:  # a lattice row and its signs per 8 columns, from cached tables
        rows = per_loop * bn * bk // 8
        entry = 4 if q8 else 16  # the int8 form's nibble codes and sign nibbles (`expert_int8.tables`), else fp16 pairs
        signs = 16 if fast else 4  # fp16 pair masks, else a word (the int8 form's nibbles, the fp32 one's spread)
        lookups = rows * (entry + signs)
        gathers = ((rows, 256 * entry), (rows, 128 * signs))  # 256 lattice rows, 128 sign indexes
    what = ("gate", "up") if matrices == 2 and not q8 else ("gate/up" if matrices == 2 else "down",)
    return tuple(
        LoopWork(f"{name} {ggml_type.name} {m}", programs, parts * k_in // bk, weight, int(weight + t * x_bytes * bk),
                 weight + x + lookups, gathers)
        for m in what
    )  # fmt: skip


# -- decode form ---------------------------------------------------------------------------------------
DECODE_TOKENS = 8  # up to this many tokens a step runs the decode form: no sort, one launch per projection
# weight rows per program of the int8 loops, gate/up then down (multiples of the 32-column activation
# blocks): 32 in the gate/up kernel leaves registers for two super-blocks a pass
Q8_ROWS = (32, 64)
# the fp32 gate/up kernel's registers on NVIDIA: ptxas gives its IQ2_XXS loop 80 (6 programs of 4
# warps an SM); held to 64 (8) it spills nothing and issues 10 more instructions a pass (sm_90 under
# triton 3.6; gpu-plan, flash 2k exact: 14.125 -> 13.846 ms a step at batch 1, 31.922 -> 29.833 at 4)
FP32_GATE_UP_REGISTERS = 64


@triton.jit
def _rows_dot(x_ptr, x_off, x_ok, w1_ptr, w2_ptr, tab_ptr, row_off, K,
              WTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr,
              FAST: tl.constexpr, BCAST: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Products of BN weight rows (w1, and w2 when TWO) with activation rows: [R, BN] each, R = x_off's
    length. FAST: the tensor-core form over 16 rows (BCAST: one row in all 16, every result row equal);
    PTX: the fp32 form may hold NVIDIA inline assembly."""
    if FAST:  # one matrix after the other: a super-block of both would not fit the registers
        a1 = tl.zeros([BN, 16], tl.float32)
        for sb in range(0, K // 256):
            a1 += fast_step(w1_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST, WTYPE, BN)
        a2 = a1
        if TWO:
            a2 = tl.zeros([BN, 16], tl.float32)
            for sb in range(0, K // 256):
                a2 += fast_step(w2_ptr, tab_ptr, row_off, sb, K, x_ptr, x_off, x_ok, BCAST, WTYPE, BN)
        return tl.trans(a1), tl.trans(a2)
    else:
        a1 = _exact_rows(w1_ptr, tab_ptr, row_off, K, x_ptr, x_off, x_ok, WTYPE, BN, BK, PTX)
        a2 = a1
        if TWO:
            a2 = _exact_rows(w2_ptr, tab_ptr, row_off, K, x_ptr, x_off, x_ok, WTYPE, BN, BK, PTX)
        return tl.sum(a1, axis=2), tl.sum(a2, axis=2)


@triton.jit
def _exact_rows(w_ptr, tab_ptr, row_off, K, x_ptr, x_off, x_ok, WTYPE: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """`exact_step`'s partial sums over all K for one matrix: `_rows_dot` runs gate, then up, each in its
    own loop (same sums in the same order as one loop over both, half the live values: the IQ2_XXS
    gate/up kernel on sm_90 under triton 3.6 took 255 registers and 40 B of stack with one loop)."""
    a = exact_step(w_ptr, tab_ptr, row_off, 0, K, x_ptr, x_off, x_ok, WTYPE, BN, BK, PTX)
    for k0 in range(BK, K, BK):
        a += exact_step(w_ptr, tab_ptr, row_off, k0, K, x_ptr, x_off, x_ok, WTYPE, BN, BK, PTX)
    return a


@triton.jit
def _shared_rows(x_ptr, x_row0, stride_x, w1_ptr, w2_ptr, tab_ptr, out_ptr, out_row0, stride_out,
                 n0, T, K, N, row_bytes, limit, WTYPE: tl.constexpr, BN: tl.constexpr, SBN: tl.constexpr,
                 BK: tl.constexpr, FAST: tl.constexpr, TB: tl.constexpr, GATED: tl.constexpr,
                 PTX: tl.constexpr):  # fmt: skip
    """The shared expert's rows n0..n0+BN (SBN at a time) for every token: activation rows x_row0 + t,
    output rows out_row0 + t; GATED: SwiGLU of w1 and w2 (gate, up), else w1 alone (down). The fp32
    form takes one token at a time (its rows' weights come again from the cache for the next): with
    all of them at once its registers, which the launch's routed programs share, held 168 at 4 tokens
    against 72 at one (gate/up, exact, sm_90 under triton 3.6)."""
    TS: tl.constexpr = 16 if FAST else 1  # tokens a pass
    for t0 in range(0, T if TS < TB else 1, TS):  # a constant single pass where one holds every token
        rows = t0 + tl.arange(0, TS)
        ok = rows < T
        x_off = (x_row0 + tl.where(ok, rows, 0)).to(tl.int64) * stride_x
        for part in range(0, BN // SBN):
            n = n0 + part * SBN + tl.arange(0, SBN)
            row_off = tl.minimum(n, N - 1).to(tl.int64) * row_bytes
            a1, a2 = _rows_dot(x_ptr, x_off, ok, w1_ptr, w2_ptr, tab_ptr, row_off, K, WTYPE, SBN, BK, GATED, FAST,
                               False, PTX)  # fmt: skip
            y = _swiglu(a1, a2, limit) if GATED else a1
            out = out_ptr + (out_row0 + rows).to(tl.int64)[:, None] * stride_out + n[None, :]
            tl.store(out, y, mask=ok[:, None] & (n < N)[None, :])


@triton.jit
def _routed_rows(x_ptr, x_row, stride_x, w1_ptr, w2_ptr, tab_ptr, out_ptr, out_row, stride_out,
                 n0, expert, K, N, row_bytes, limit, scale, WTYPE: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, FAST: tl.constexpr, GATED: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """One routing entry's rows n0..n0+BN of `expert`: activation row x_row, output row out_row
    (GATED: SwiGLU of gate and up, times `scale`)."""
    rows = tl.arange(0, 16 if FAST else 1)
    x_off = tl.full(rows.shape, 0, tl.int64) + x_row.to(tl.int64) * stride_x
    n = n0 + tl.arange(0, BN)
    row_off = (expert.to(tl.int64) * N + tl.minimum(n, N - 1)) * row_bytes
    a1, a2 = _rows_dot(x_ptr, x_off, rows >= 0, w1_ptr, w2_ptr, tab_ptr, row_off, K, WTYPE, BN, BK, GATED, FAST, True,
                       PTX)  # fmt: skip
    y = _swiglu(a1, a2, limit) * scale if GATED else a1
    out = out_ptr + out_row.to(tl.int64) * stride_out + rows[:, None] * 0 + n[None, :]
    tl.store(out, y, mask=(rows == 0)[:, None] & (n < N)[None, :])  # FAST: 16 equal rows


@triton.jit
def _routed_rows_q8(xq_ptr, xs_ptr, xm_ptr, x_row, stride_x, w1_ptr, w2_ptr, tab_ptr, out_ptr, os_ptr,
                    om_ptr, out_row, stride_out, n0, expert, K, N, row_bytes, limit, scale, WTYPE: tl.constexpr,
                    BN: tl.constexpr, GATED: tl.constexpr, PTX: tl.constexpr, SBP: tl.constexpr):  # fmt: skip
    """`_routed_rows` over int8 activations (`expert_int8.Q8Rows` buffers xq as int32 words, xs, xm;
    row x_row): GATED quantizes its SwiGLU rows into row out_row of the Q8Rows out, os, om (the
    down projection's input), else stores the floats at out_ptr (the parts)."""
    n = n0 + tl.arange(0, BN)
    row_off = (expert.to(tl.int64) * N + tl.minimum(n, N - 1)) * row_bytes
    x0 = x_row.to(tl.int64) * stride_x
    a1, a2 = q8_rows_dot(xq_ptr, xs_ptr, xm_ptr, x0, w1_ptr, w2_ptr, tab_ptr, row_off, K, WTYPE, BN, GATED, PTX,
                         SBP)  # fmt: skip
    if GATED:
        store_q8(_swiglu(a1, a2, limit) * scale, out_ptr, os_ptr, om_ptr, out_row.to(tl.int64) * stride_out,
                 n0, N, BN, PTX)  # fmt: skip
    else:
        tl.store(out_ptr + out_row.to(tl.int64) * stride_out + n, a1, mask=n < N)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, route_w_ptr, gate_ptr, up_ptr, sgate_ptr, sup_ptr, tab_ptr, mid_ptr,
    xq_ptr, xs_ptr, xm_ptr, mq_ptr, ms_ptr, mm_ptr,
    T, k, D, F, FS, FM, stride_x, row_bytes, srow_bytes, limit,
    RTYPE: tl.constexpr, STYPE: tl.constexpr, BN: tl.constexpr, SBN: tl.constexpr, RBK: tl.constexpr,
    SBK: tl.constexpr, RFAST: tl.constexpr, SFAST: tl.constexpr, TB: tl.constexpr, RQ8: tl.constexpr,
    PTX: tl.constexpr, SBP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # column 0: the shared expert for every token (the longest programs, so scheduled first); column
    # 1 + e: routing entry e = t * k + slot. mid rows: e for the entries, T * k + t for the shared expert
    col = tl.program_id(1)
    n0 = tl.program_id(0) * BN
    if col == 0:
        _shared_rows(x_ptr, 0, stride_x, sgate_ptr, sup_ptr, tab_ptr, mid_ptr, T * k, FM, n0, T, D, FS,
                     srow_bytes, limit, STYPE, BN, SBN, SBK, SFAST, TB, True, PTX)  # fmt: skip
    else:
        e = col - 1
        if RQ8:  # int8 rows x_q (D columns) in, int8 mid rows m_q (FM columns) out
            _routed_rows_q8(xq_ptr, xs_ptr, xm_ptr, e // k, D, gate_ptr, up_ptr, tab_ptr, mq_ptr,
                            ms_ptr, mm_ptr, e, FM, n0, tl.load(ids_ptr + e), D, F, row_bytes, limit,
                            tl.load(route_w_ptr + e), RTYPE, BN, True, PTX, SBP)  # fmt: skip
        else:
            _routed_rows(x_ptr, e // k, stride_x, gate_ptr, up_ptr, tab_ptr, mid_ptr, e, FM, n0,
                         tl.load(ids_ptr + e), D, F, row_bytes, limit, tl.load(route_w_ptr + e), RTYPE, BN, RBK,
                         RFAST, True, PTX)  # fmt: skip


@triton.jit
def _decode_down_kernel(
    mid_ptr, ids_ptr, down_ptr, sdown_ptr, tab_ptr, part_ptr, tickets_ptr, out_ptr, mq_ptr, ms_ptr, mm_ptr,
    T, k, F, FS, FM, D, row_bytes, srow_bytes, stride_out,
    RTYPE: tl.constexpr, STYPE: tl.constexpr, BN: tl.constexpr, SBN: tl.constexpr, RBK: tl.constexpr,
    SBK: tl.constexpr, RFAST: tl.constexpr, SFAST: tl.constexpr, TB: tl.constexpr, RQ8: tl.constexpr,
    PTX: tl.constexpr, SBP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # every program writes its products to part (rows as in mid); the last program of a column block
    # to finish (a ticket per block, back to 0 for the next launch) sums each token's k routed slots,
    # in slot order, then its shared expert, into out
    nb = tl.program_id(0)
    col = tl.program_id(1)
    if col == 0:
        _shared_rows(mid_ptr, T * k, FM, sdown_ptr, sdown_ptr, tab_ptr, part_ptr, T * k, D, nb * BN, T, FS, D,
                     srow_bytes, 0.0, STYPE, BN, SBN, SBK, SFAST, TB, False, PTX)  # fmt: skip
    else:
        e = col - 1
        if RQ8:
            _routed_rows_q8(mq_ptr, ms_ptr, mm_ptr, e, FM, down_ptr, down_ptr, tab_ptr, part_ptr,
                            part_ptr, part_ptr, e, D, nb * BN, tl.load(ids_ptr + e), F, D, row_bytes, 0.0, 1.0, RTYPE,
                            BN, False, PTX, SBP)  # fmt: skip
        else:
            _routed_rows(mid_ptr, e, FM, down_ptr, down_ptr, tab_ptr, part_ptr, e, D, nb * BN,
                         tl.load(ids_ptr + e), F, D, row_bytes, 0.0, 1.0, RTYPE, BN, RBK, RFAST, False,
                         PTX)  # fmt: skip
    if last_program(tickets_ptr + nb, T * k + 1):
        t = tl.arange(0, TB)
        n = nb * BN + tl.arange(0, BN)
        ok = (t < T)[:, None] & (n < D)[None, :]
        total = tl.zeros([TB, BN], tl.float32)
        for slot in range(0, k):
            at = part_ptr + (t * k + slot).to(tl.int64)[:, None] * D + n[None, :]
            total += tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
        at = part_ptr + (T * k + t).to(tl.int64)[:, None] * D + n[None, :]
        total += tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + n[None, :], total, mask=ok)


def _decode_rows(ggml_type: GGMLType, fast: bool, warps: int) -> tuple[int, int]:
    """(rows, BK) of a decode loop over `warps` warps: a row of a super-block step takes 16 threads for
    Q8_0's 256 columns, 8 for Q4_K, MXFP4 and the 2-bit formats (half a 16-byte run each for these);
    the tensor-core form takes 16-row mma tiles, two per warp. The 2-bit formats took 4 threads a row
    until the H200 measured their gate/up kernel at 184 registers (2 programs an SM, 180 us a launch,
    48% of the step); 8 a row holds it at 128 on sm_90 under triton 3.6 (gpu-plan: 13.6 against
    16.1 ms a batch-1 exact step, modelled)."""
    if interpreting():  # programs run one after another: as few as possible
        return 256, 256 if ggml_type in EXACT_TYPES else tile_k(ggml_type, QK_K)
    if fast and ggml_type in FAST_TYPES:
        return 32 * warps, 256
    if ggml_type in EXACT_TYPES:
        return warps * warp_size() // {GGMLType.Q8_0: 16, GGMLType.Q4_K: 8, GGMLType.MXFP4: 8}.get(ggml_type, 8), 256
    return 16, tile_k(ggml_type, QK_K)


def int8_form(gate: QWeight, down: QWeight, precision: Precision) -> bool:
    """Whether `decode_ffn` takes int8 activations (`expert_int8`): Precision.fast, 2-bit gate/up and down."""
    return precision.fast and gate.ggml_type in Q8_TYPES and down.ggml_type in Q8_TYPES


def decode_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    routed: tuple[QWeight, QWeight, QWeight],
    shared: tuple[QWeight, QWeight, QWeight],
    limit: float,
    precision: Precision = EXACT,
    xq: Q8Rows | None = None,
) -> torch.Tensor:
    """[T, D] float32: each token's k routed experts (ids int32 [T, k], route_weights float32 [T, k],
    applied before the down projection) and the shared expert, summed in slot order then shared.

    Two launches whatever T is (at most DECODE_TOKENS): gate+up, then down with the sum; their grids
    depend on T and k only, so a captured decode step replays them. In the `int8_form`, xq is x as
    int8 rows (`expert_int8.quantize_rows`'s values, stored by the routing launch); None: one more
    launch quantizes x.
    """
    t, k = ids.shape
    if t > DECODE_TOKENS:
        raise ValueError(f"the decode form takes at most {DECODE_TOKENS} tokens, got {t}")
    gate, up, down = routed
    sgate, sup, sdown = shared
    d, f, fs = gate.cols, gate.expert_rows, sgate.rows
    device, tb = x.device, next_pow2(t)
    fm = max(f, fs)
    fast = precision.fast
    mid = torch.empty(t * k + t, fm, device=device, dtype=torch.float16 if fast else torch.float32)
    parts = torch.empty(t * k + t, d, device=device)
    out = torch.empty(t, d, device=device)
    # the 2-bit recipe's fast form: int8 activations (`expert_int8`), x quantized by the routing launch
    # (or here), the routed mid rows by the gate/up kernel
    q8 = int8_form(gate, down, precision)
    if not q8:
        xq = Q8Rows.empty(1, 32, device)
    elif xq is None:
        xq = quantize_rows(x)
    elif xq.q.shape != x.shape:
        raise ValueError(f"int8 rows {tuple(xq.q.shape)} for activations {tuple(x.shape)}")
    mq = Q8Rows.empty(t * k, fm, device) if q8 else xq
    tab = q8_tables(device) if q8 else tables(device)
    ids, route_weights = ids.contiguous(), route_weights.contiguous()
    for step, (w, s) in enumerate(((gate, sgate), (down, sdown))):
        rfast, sfast = fast and not q8 and w.ggml_type in FAST_TYPES, fast and s.ggml_type in FAST_TYPES
        # the tensor-core form on 2 warps (4 would pick wgmma, which stages the activations in shared
        # memory); IQ2_XXS's on 1 up to 4 tokens: its lattice rows, looked up where the mma operand
        # layout wants them, would cross warps on 2 (a round trip through shared memory per group);
        # from 5 tokens the shared expert's rows in the same program would spill on 1. The int8 loops
        # on 4 warps, two super-blocks a pass where K allows (SBP: twice the weight bytes in flight per
        # program). Registers decide it since the H200's measurement (gpu-plan's stall): the launch's
        # programs all hold what its largest branch needs, so the shared expert's rows take the tokens
        # one at a time (`_shared_rows`), and the gate/up kernel holds 80 registers at 1 to 8 tokens
        # (it held 168 at 4 tokens with all of them at once: modelled 26.41 against 23.89 ms a batch-4
        # fast step). Gate/up: 32 rows a program (64 took 255 registers and spilled under triton 3.6,
        # the H200 image's, `nox -s gpu_image`: 8 B, 120 B with two super-blocks a pass).
        warps = (1 if w.ggml_type == GGMLType.IQ2_XXS and tb <= 4 else 2) if rfast else 4
        bn, rbk = _decode_rows(w.ggml_type, rfast, warps)
        sbn, sbk = _decode_rows(s.ggml_type, sfast, warps)
        if q8:  # whole activation blocks per program (the gate/up kernel quantizes its mid columns)
            bn = 256 if interpreting() else Q8_ROWS[step]
        bn = min(bn, next_pow2(max(fm, d)))
        sbn = min(sbn, bn)
        # the pipeliner would stage IQ2_XXS's table lookups of the fast form through shared memory
        stages = 1 if interpreting() or (rfast and w.ggml_type == GGMLType.IQ2_XXS) else 3
        consts = dict(RTYPE=w.wtype, STYPE=s.wtype, BN=bn, SBN=sbn, RBK=rbk, SBK=sbk, RFAST=rfast, SFAST=sfast,
                      TB=tb, RQ8=q8, PTX=compiles_ptx(), SBP=2 if q8 and w.cols % 512 == 0 else 1,
                      num_warps=warps, num_stages=stages, **dependent_launch())  # fmt: skip
        if step == 0 and not (q8 or rfast) and compiles_ptx():
            consts["maxnreg"] = FP32_GATE_UP_REGISTERS
        if step == 0:
            grid = (triton.cdiv(fm, bn), t * k + 1)
            _decode_gate_up_kernel[grid](
                x, ids, route_weights, gate.data, up.data, sgate.data, sup.data, tab, mid,
                xq.q.view(torch.int32), xq.scale, xq.sums, mq.q, mq.scale, mq.sums,
                t, k, d, f, fs, fm, x.stride(0), gate.row_bytes, sgate.row_bytes, limit, **consts,
            )  # fmt: skip
        else:
            blocks = triton.cdiv(d, bn)
            _decode_down_kernel[(blocks, t * k + 1)](
                mid, ids, down.data, sdown.data, tab, parts, ticket_counters(device, "experts", blocks), out,
                mq.q.view(torch.int32), mq.scale, mq.sums,
                t, k, f, fs, fm, d, down.row_bytes, sdown.row_bytes, out.stride(0), **consts,
            )  # fmt: skip
    return out


def reference(x, gate: QWeight, up: QWeight, down: QWeight, ids, route_weights, limit) -> torch.Tensor:
    """[T, k, D]: each routing slot's expert output, from dequantized experts (ids None: one shared expert)."""
    g, u, dn = (w.dequantize().view(w.experts, w.expert_rows, w.cols) for w in (gate, up, down))
    if ids is None:
        return (ops.swiglu_clamped(x @ g[0].T, x @ u[0].T, limit) @ dn[0].T).unsqueeze(1)
    t, k = ids.shape
    out = torch.zeros(t, k, x.shape[1], device=x.device)
    for tok in range(t):
        for slot in range(k):
            e = int(ids[tok, slot])
            mid = ops.swiglu_clamped(x[tok] @ g[e].T, x[tok] @ u[e].T, limit) * route_weights[tok, slot]
            out[tok, slot] = mid @ dn[e].T
    return out


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The decode form (q2 recipe: IQ2_XXS gate/up, Q2_K down, with the Q8_0 shared expert) for 1 and 4
    tokens, exact and fast, and the routed experts of a prefill chunk (sorted tiles, bf16 dot); then
    the same for MXFP4 experts (ds4's files that keep the official FP4 experts), 1 token exact and prefill."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    e, f, d, k = a.n_routed_experts, a.moe_inter_dim, a.dim, a.n_activated_experts
    shared = tuple(random_qweight(GGMLType.Q8_0, s, dev, gen) for s in ((f, d), (f, d), (d, f)))
    cases = []
    for gate_up, down_type, runs in (
        (GGMLType.IQ2_XXS, GGMLType.Q2_K, ((1, EXACT), (4, EXACT), (1, FAST), (4, FAST))),
        (GGMLType.MXFP4, GGMLType.MXFP4, ((1, EXACT),)),
    ):
        gate = random_qweight(gate_up, (e, f, d), dev, gen)
        up = random_qweight(gate_up, (e, f, d), dev, gen)
        down = random_qweight(down_type, (e, d, f), dev, gen)
        per_expert = (gate.nbytes + up.nbytes + down.nbytes) // e
        label = "" if gate_up == GGMLType.IQ2_XXS else f"{gate_up.name} "
        for t, precision in runs:
            x = torch.randn(t, d, device=dev, generator=gen)
            ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
            weights = torch.rand(t, k, device=dev, generator=gen)
            run = functools.partial(decode_ffn, x, ids, weights, (gate, up, down), shared, a.swiglu_limit, precision)
            moved = min(e, t * k) * per_expert + sum(w.nbytes for w in shared)
            name = f"{label}decode {t} tokens x {k} experts + shared ({'fast' if precision.fast else 'exact'})"
            cases.append(BenchCase("moe_experts", name, run, moved, 6 * t * (k + 1) * f * d))
        t = shape.prefill
        x = torch.randn(t, d, device=dev, generator=gen)
        ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        weights = torch.rand(t * k, device=dev, generator=gen)
        tiles = sort_by_expert(ids, e)
        out = torch.empty(t, k + 1, d, device=dev)
        run = functools.partial(expert_ffn, x, gate, up, down, tiles, weights, out, 0, a.swiglu_limit, FAST)
        name = f"{label}prefill (bf16 dot) {t} tokens x {k} experts"
        cases.append(BenchCase("moe_experts", name, run, min(e, t * k) * per_expert, 6 * t * k * f * d))
    return cases
