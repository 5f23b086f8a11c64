"""Grouped expert FFN over the entries sorted by expert: gate/up with the SwiGLU clamp fused, then down.

Spec §2.4. For every tile of one expert's entries (`moe_sort`), `_gate_up_kernel` gathers the tokens'
input rows, decodes the expert's gate and up blocks once per K step for all the tile's rows, and
writes silu(min(g, L)) * clamp(u, -L, L) * routing weight, so the mid activations never exist
unclamped in memory. `_down_kernel` multiplies each tile's mid rows by the expert's down blocks and
writes every entry's output to its own row of a [T, slots, D] buffer: slot = the routing slot for
routed experts, and the last slot for the shared expert, which runs through the same kernels as a
single expert over all tokens with weight 1. `hc_post` then adds the slots, in order.

Tiles of >= 16 rows (prefill) go through `tl.dot`; small tiles (decode: one token per expert) use
the GEMV form, where each weight block is read exactly once per step. Each program checks its tile
slot and exits at once when unused, so the grid is sized from T * k alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.moe_sort import ExpertTiles, single_expert_tiles, sort_by_expert
from dwarfstar.backends.triton.kernels.quant_blocks import (
    GEMV_CANDIDATES,
    gemv_search,
    gemv_tile,
    grid_table,
    load_weight_tile,
    tile_k,
)
from dwarfstar.backends.triton.runtime import (
    EXACT,
    FAST,
    BenchCase,
    BenchShape,
    KernelWork,
    Precision,
    interpreting,
    next_pow2,
)
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType


@triton.jit
def _product(acc, x, w, USE_DOT: tl.constexpr, FAST: tl.constexpr):
    if USE_DOT:
        if FAST:
            return acc + tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return acc + tl.sum(x[:, None, :] * w[None, :, :], axis=2)


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


_KEY = ["K", "N", "WTYPE", "BM", "BK", "USE_DOT", "FAST"]


@triton.autotune(configs=GEMV_CANDIDATES, key=[*_KEY, "WEIGHTED"], prune_configs_by={"early_config_prune": _pruner(2)})
@triton.jit
def _gate_up_kernel(
    x_ptr, gate_ptr, up_ptr, grid_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr,
    route_w_ptr, mid_ptr, K, N, stride_x, row_bytes, k_slots, limit,
    WTYPE: tl.constexpr, WEIGHTED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_DOT: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        start = tl.load(tile_start_ptr + tile)
        m = tl.arange(0, BM)
        m_ok = m < tl.load(tile_rows_ptr + tile)
        entry = tl.load(sorted_ptr + start + m, mask=m_ok, other=0)
        x_rows = x_ptr + (entry // k_slots).to(tl.int64)[:, None] * stride_x
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        row_off = (expert * N + tl.minimum(n, N - 1)).to(tl.int64) * row_bytes
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
            acc_g = _product(acc_g, x, load_weight_tile(gate_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK),
                             USE_DOT, FAST)  # fmt: skip
            acc_u = _product(acc_u, x, load_weight_tile(up_ptr, grid_ptr, row_off, k0, K, WTYPE, BN, BK),
                             USE_DOT, FAST)  # fmt: skip
        g = tl.minimum(acc_g, limit)
        # silu(g) = g / (1 + e^-g); capping the exponent keeps it finite where silu is ~0 anyway
        mid = g / (1.0 + tl.exp(tl.minimum(-g, 80.0))) * tl.minimum(tl.maximum(acc_u, -limit), limit)
        if WEIGHTED:
            mid = mid * tl.load(route_w_ptr + entry, mask=m_ok, other=0.0)[:, None]
        out = mid_ptr + (start + m).to(tl.int64)[:, None] * N + n[None, :]
        tl.store(out, mid, mask=m_ok[:, None] & (n < N)[None, :])


@triton.autotune(configs=GEMV_CANDIDATES, key=_KEY, prune_configs_by={"early_config_prune": _pruner(1)})
@triton.jit
def _down_kernel(
    mid_ptr, down_ptr, grid_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, out_ptr,
    K, N, row_bytes, k_slots, out_slots, slot_offset,
    WTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_DOT: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        start = tl.load(tile_start_ptr + tile)
        m = tl.arange(0, BM)
        m_ok = m < tl.load(tile_rows_ptr + tile)
        entry = tl.load(sorted_ptr + start + m, mask=m_ok, other=0)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        row_off = (expert * N + tl.minimum(n, N - 1)).to(tl.int64) * row_bytes
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(mid_ptr + (start + m).to(tl.int64)[:, None] * K + ks[None, :],
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
    """What a gate/up or down launch streams (`runtime.KernelWork`): each tile's expert rows once, as
    if no two tiles shared an expert (decode: a tile per routed entry; the shared expert's tiles)."""
    if kernel not in ("_gate_up_kernel", "_down_kernel"):
        return None
    matrices = 2 if kernel == "_gate_up_kernel" else 1
    entries = a["sorted_ptr"].numel()
    tiles = triton.cdiv(entries, a["BM"]) if a["k_slots"] == 1 else entries
    weight = tiles * matrices * a["N"] * a["row_bytes"]
    activations = 4 * entries * (a["K"] + a["N"])
    loop = matrices * a["BN"] * a["row_bytes"] * a["BK"] // a["K"] + 4 * a["BM"] * a["BK"]
    return KernelWork(weight + activations, weight, triton.cdiv(a["K"], a["BK"]), loop)


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
    """Routed experts (q2 recipe: IQ2_XXS gate/up, Q2_K down) for one decode token and a prefill
    chunk, and the Q8_0 shared expert for one token."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    e, f, d, k = a.n_routed_experts, a.moe_inter_dim, a.dim, a.n_activated_experts
    gate = random_qweight(GGMLType.IQ2_XXS, (e, f, d), dev, gen)
    up = random_qweight(GGMLType.IQ2_XXS, (e, f, d), dev, gen)
    down = random_qweight(GGMLType.Q2_K, (e, d, f), dev, gen)
    per_expert = (gate.nbytes + up.nbytes + down.nbytes) // e
    cases = []
    for what, t, precision in (("decode", 1, EXACT), ("prefill (bf16 dot)", shape.prefill, FAST)):
        x = torch.randn(t, d, device=dev, generator=gen)
        ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        weights = torch.rand(t * k, device=dev, generator=gen)
        tiles = sort_by_expert(ids, e)
        out = torch.empty(t, k + 1, d, device=dev)
        run = functools.partial(expert_ffn, x, gate, up, down, tiles, weights, out, 0, a.swiglu_limit, precision)
        touched = min(e, t * k) * per_expert
        cases.append(BenchCase("moe_experts", f"{what} {t} tokens x {k} experts", run, touched, 6 * t * k * f * d))
    shared = [random_qweight(GGMLType.Q8_0, s, dev, gen) for s in ((f, d), (f, d), (d, f))]
    x = torch.randn(1, d, device=dev, generator=gen)
    out = torch.empty(1, k + 1, d, device=dev)
    run = functools.partial(expert_ffn, x, *shared, single_expert_tiles(1, dev), None, out, k, a.swiglu_limit)
    cases.append(BenchCase("moe_experts", "decode shared expert Q8_0", run, sum(w.nbytes for w in shared), 6 * f * d))
    return cases
