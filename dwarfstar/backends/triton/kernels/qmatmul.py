"""Fused dequantize + matrix product over GGUF blocks: GEMV for decode, GEMM for prefill.

y[m, n] = sum_k x[m, k] * W[n, k], W read as GGUF blocks (F32/F16/BF16/Q8_0/Q2_K/Q4_K/IQ2_XXS) in
the aligned layout and decoded tile by tile in registers (`load_weight_tile`).

Two inner products share the fused kernel:
* GEMV (few rows of x, decode): each program owns BN weight rows, decodes each [BN, BK] tile once and
  multiplies it with the BM (<= 8) activation rows on the CUDA cores in fp32. This path is bound by
  memory: each weight byte is read exactly once per token.
* GEMM (prefill): BM x BN output tiles through `tl.dot`, IEEE fp32 operands for exact results or bf16
  operands (fp32 accumulation) with `Precision.fast`, for chunks of up to 16 rows.

Longer prefill chunks decode the weight once into a float32 (exact) or bf16 (fast) scratch with
the block decoder and hand it to the vendor GEMM (`torch.bmm`: cuBLAS, hipBLASLt), whose tiling
beats decoding the weight again in every output tile.

Groups: the grouped low-rank attention output (wo_a) is G independent products, group g taking
columns [g*K, (g+1)*K) of each x row and weight rows [g*N, (g+1)*N). Split-K: for a few rows over a
long K (the 24-row mHC mixes over 4*D = 16384) the K range is split over programs, which write
partial sums [S, M, N] that the consumer kernel adds, so no atomics and deterministic results.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.quant_blocks import (
    GEMV_CANDIDATES,
    dequantize_rows,
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

GEMV_MAX_ROWS = 8  # above this many activation rows the tensor-core GEMM wins
# from this many rows on (prefill chunks) decoding the weight once into a scratch and calling the
# vendor GEMM (cuBLAS, hipBLASLt) beats decoding it in every output tile, as llama.cpp finds above 16
VENDOR_GEMM_MIN_ROWS = 17

_scratch: dict[tuple, torch.Tensor] = {}


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


def _prune(candidates: list[triton.Config], named: dict, **constants) -> list[triton.Config]:
    """The heuristic tile for the interpreter and the tensor-core GEMM; a few GEMV tiles to time."""
    ggml_type, bk, use_dot = GGMLType(constants["WTYPE"]), constants["BK"], constants["USE_DOT"]
    bm, bn, warps = _config(named["M"], named["N"], ggml_type, bk, use_dot, constants["FAST"])
    heuristic = triton.Config({"BN": bn}, num_warps=warps, num_stages=1)
    if interpreting() or use_dot:
        return [heuristic]
    return gemv_search(candidates, heuristic, bm, named["N"], ggml_type, bk)


@triton.autotune(
    configs=GEMV_CANDIDATES,
    key=["M", "N", "K", "SPLIT", "WTYPE", "BM", "BK", "USE_DOT", "FAST"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _qmatmul_kernel(
    x_ptr, w_ptr, grid_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes, k_per_split,
    SPLIT: tl.constexpr, WTYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_DOT: tl.constexpr, FAST: tl.constexpr,
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
        if USE_DOT:
            if FAST:
                acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            else:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    y = y_ptr + split * M * stride_ym + ms.to(tl.int64)[:, None] * stride_ym + (group * N + rows)[None, :]
    tl.store(y, acc, mask=(ms < M)[:, None] & (rows < N)[None, :])


def _config(m: int, n: int, ggml_type: GGMLType, bk: int, use_dot: bool, fast: bool) -> tuple[int, int, int]:
    """(BM, BN, num_warps). GPU: enough programs to keep loads in flight; interpreter: few programs.

    The GEMM's weight operand is decoded in registers, then staged in shared memory for the tensor
    cores, as is the activation tile (one pipeline stage): [BM, BK] + [BN, BK] operands stay within
    64 KB (the LDS of AMD GPUs), and the 256-wide super-block tiles get 8 warps so the decoded tile
    does not spill registers.
    """
    if interpreting():
        return (min(64, next_pow2(m)) if use_dot else 1, min(next_pow2(n), 1024 if use_dot else 4096), 1)
    if not use_dot:
        bm = next_pow2(m)
        return bm, *gemv_tile(bm, n, ggml_type, bk)
    cap = 64 if fast else 32  # fp32 operands (FMA products) take twice the registers and shared memory
    bm = min(cap, 16 if m <= 16 else 32 if m <= 32 else 64)
    if bk == 256:
        return bm, min(next_pow2(n), 32), 8
    return bm, min(next_pow2(n), cap), 4


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
    m = x.shape[0]
    k = w.cols
    n = w.rows // groups
    if x.stride(-1) != 1 or x.shape[-1] != groups * k:
        raise ValueError(f"x must be [M, {groups * k}] with contiguous rows, got {tuple(x.shape)}")
    if split_k > 1 and groups != 1:
        raise ValueError("split-K and groups do not combine")
    if use_dot is None and split_k == 1 and m >= VENDOR_GEMM_MIN_ROWS:
        return _vendor_qmatmul(x, w, groups, precision)
    if use_dot is None:
        use_dot = m > GEMV_MAX_ROWS
    bk = tile_k(w.ggml_type, k, gemm=use_dot)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    split = triton.cdiv(k, k_per_split)
    out_shape = (split, m, groups * n) if split_k > 1 else (m, groups * n)
    y = torch.empty(out_shape, device=x.device, dtype=torch.float32)
    bm = _config(m, n, w.ggml_type, bk, use_dot, precision.fast)[0]

    def grid(meta: dict) -> tuple[int, int, int]:
        return triton.cdiv(n, meta["BN"]), triton.cdiv(m, bm), groups * split

    _qmatmul_kernel[grid](
        x, w.data, grid_table(x.device), y, m, n, k, x.stride(0), groups * n, w.row_bytes, k_per_split,
        SPLIT=split, WTYPE=w.wtype, BM=bm, BK=bk, USE_DOT=use_dot, FAST=precision.fast,
    )  # fmt: skip
    return y


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a `_qmatmul_kernel` launch streams (see `runtime.KernelWork`)."""
    if kernel != "_qmatmul_kernel":
        return None
    groups = a["y_ptr"].shape[-1] // a["N"]
    weight = groups * a["N"] * a["row_bytes"]
    activations = 4 * a["M"] * (groups * a["K"] + groups * a["N"] * a["SPLIT"])
    loop = a["BN"] * a["row_bytes"] * a["BK"] // a["K"] + 4 * a["BM"] * a["BK"]
    return KernelWork(weight + activations, weight, triton.cdiv(a["k_per_split"], a["BK"]), loop)


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
