"""Fused dequantize + GEMV/GEMM against dequantize-then-matmul in torch."""

from __future__ import annotations

import pytest
import torch
import triton

from dwarfstar.backends.triton.kernels import qmatmul as qm
from dwarfstar.backends.triton.runtime import FAST
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize


def make_weight(ggml_type, rows, cols, device, quant_blocks, seed=0) -> QWeight:
    if ggml_type in (T.Q2_K, T.Q4_K, T.IQ2_XXS):
        raw = torch.from_numpy(quant_blocks(ggml_type, rows * cols // 256, seed))
    else:
        values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
        raw = torch.from_numpy(quantize(values, ggml_type))
    return QWeight.from_bytes(raw, ggml_type, (rows, cols), device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS])
@pytest.mark.parametrize("m", [1, 3, 12, 20])  # GEMV, GEMV, fused tensor-core GEMM, vendor GEMM
def test_matches_dequantized_product(ggml_type, m, device, quant_blocks):
    w = make_weight(ggml_type, 24, 512, device, quant_blocks, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(2)).to(device)
    assert rel_err(qm.qmatmul(x, w), qm.reference(x, w)) < 2e-6


@pytest.mark.parametrize("ggml_type", [T.F32, T.Q8_0])
@pytest.mark.parametrize("use_dot", [False, True])
def test_partial_tile_and_row_stride(ggml_type, use_dot, device, quant_blocks):
    """K = 96 ends inside a 128-column tile; x rows are a strided view (a column slice of a wider buffer)."""
    w = make_weight(ggml_type, 10, 96, device, quant_blocks)
    wide = torch.randn(17, 200, generator=torch.Generator().manual_seed(3)).to(device)
    x = wide[:, 50:146]
    assert rel_err(qm.qmatmul(x, w, use_dot=use_dot), qm.reference(x.contiguous(), w)) < 2e-6


@pytest.mark.parametrize("m", [5, 20])
def test_grouped_block_diagonal(m, device, quant_blocks):
    """Two groups: group g multiplies columns [g*K, (g+1)*K) of x by weight rows [g*N, (g+1)*N)."""
    w = make_weight(T.Q8_0, 2 * 16, 64, device, quant_blocks)
    x = torch.randn(m, 2 * 64, generator=torch.Generator().manual_seed(4)).to(device)
    got = qm.qmatmul(x, w, groups=2)
    dense = w.dequantize()
    want = torch.cat((x[:, :64] @ dense[:16].T, x[:, 64:] @ dense[16:].T), dim=1)
    assert rel_err(got, want) < 2e-6


def test_split_k_partials_sum_to_the_product(device, quant_blocks):
    w = make_weight(T.F16, 24, 1024, device, quant_blocks)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(5)).to(device)
    partial = qm.qmatmul(x, w, split_k=4)
    assert partial.shape == (4, 2, 24)
    assert rel_err(partial.sum(0), qm.reference(x, w)) < 2e-6


def test_fast_precision_uses_bf16_operands(device, quant_blocks):
    w = make_weight(T.Q4_K, 32, 512, device, quant_blocks)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(6)).to(device)
    err = rel_err(qm.qmatmul(x, w, precision=FAST), qm.reference(x, w))
    assert 1e-5 < err < 2e-2  # bf16 rounding of the operands shows, but stays small


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS])
def test_prefill_scratch_is_the_torch_dequantizer_bit_for_bit(ggml_type, device, quant_blocks):
    """The vendor-GEMM path decodes the whole weight with the block decoder: exactly `dequantize`."""
    w = make_weight(ggml_type, 20, 512, device, quant_blocks, seed=9)
    assert torch.equal(qm.dequantized(w, torch.float32), w.dequantize())


def test_vendor_gemm_reuses_one_scratch_per_shape(device, quant_blocks):
    a, b = (make_weight(T.Q8_0, 16, 256, device, quant_blocks, seed=s) for s in (10, 11))
    x = torch.randn(24, 300, generator=torch.Generator().manual_seed(12)).to(device)[:, 20:276]  # strided rows
    ya, yb = qm.qmatmul(x, a), qm.qmatmul(x, b)
    assert qm.dequantized(a, torch.float32).data_ptr() == qm.dequantized(b, torch.float32).data_ptr()
    assert rel_err(ya, qm.reference(x.contiguous(), a)) < 2e-6
    assert rel_err(yb, qm.reference(x.contiguous(), b)) < 2e-6


@pytest.mark.parametrize("warp", [32, 64])  # NVIDIA warps, AMD wavefronts
def test_gemv_autotune_search_keeps_vector_loads_and_registers(warp, monkeypatch):
    """The autotuned GEMV tiles: the heuristic (with 1 and 2 stages) and same-register-cost variants
    in which every one of 64..256 threads loads a full 128-bit vector of the Q2_K weight tile."""
    from dwarfstar.backends.triton.kernels import quant_blocks as qb

    monkeypatch.setattr(qb, "warp_size", lambda: warp)
    heuristic = triton.Config({"BN": 32}, num_warps=128 // warp, num_stages=1)
    configs = qb.gemv_search(qb.GEMV_CANDIDATES, heuristic, bm=1, n=4096, ggml_type=T.Q2_K, bk=256)
    shapes = {(c.kwargs["BN"], c.num_warps * warp, c.num_stages) for c in configs}
    assert shapes == {(32, 128, 1), (32, 128, 2), (16, 64, 1), (64, 256, 1)}
    for bn, threads, _ in shapes:
        assert bn * 64 >= 16 * threads  # 64 payload bytes per row and super-block
        assert bn * 256 // threads <= 64  # product elements per thread, as the heuristic
