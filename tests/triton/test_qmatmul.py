"""Fused dequantize + GEMV/GEMM against dequantize-then-matmul in torch.

The decode GEMV's GPU path (16-byte vectors, rows in a static loop, split-K finished by a ticket) is
forced with explicit plans: the interpreter's own plan takes the block path.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels import qmatmul as qm
from dwarfstar.backends.triton.kernels import quant_blocks as qb
from dwarfstar.backends.triton.runtime import FAST, ticket_counters
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


def exact(x: torch.Tensor, w: QWeight, groups: int = 1) -> torch.Tensor:
    """float64 product of x and the dequantized weight, group by group."""
    dense = w.dequantize().double().view(groups, w.rows // groups, w.cols)
    return torch.einsum("mgk,gnk->mgn", x.double().view(x.shape[0], groups, w.cols), dense).reshape(x.shape[0], -1)


def vector_plan(ggml_type: T, rows: int, split: int = 1, vectors: int = 4) -> qm.GemvPlan:
    """The GPU path's plan with `vectors` threads' worth of 16-byte vectors per pass."""
    return qm.GemvPlan(rows, vectors * qb.VECTOR_ELEMENTS[ggml_type], split, True, 1)


@pytest.mark.parametrize(("ggml_type", "m"), [(T.Q8_0, 1), (T.Q8_0, 8), (T.F16, 5), (T.BF16, 2), (T.F32, 3)])
def test_vector_gemv_ragged_rows_and_k_tail(ggml_type, m, device, quant_blocks):
    """Rows past N (6 = a block of 4 + 2) and a K tail past the last whole pass (K = 160 = 2 x 64 + 32)."""
    w = make_weight(ggml_type, 6, 160, device, quant_blocks, seed=m)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).to(device)
    got = qm.gemv(x, [w], plans=[vector_plan(ggml_type, rows=4, vectors=64 // qb.VECTOR_ELEMENTS[ggml_type])])
    assert rel_err(got.double(), exact(x, w)) < 2e-6


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q8_0])
def test_split_k_finished_by_the_last_ticket(ggml_type, device, quant_blocks):
    """Three splits of K = 288 in passes of 64: 128, 128 and a 32-column tail. The last program of each
    row block adds the partials in split order: twice the same bits, and every ticket back at zero
    for the next launch."""
    w = make_weight(ggml_type, 5, 288, device, quant_blocks)
    x = torch.randn(2, 288, generator=torch.Generator().manual_seed(7)).to(device)
    plan = vector_plan(ggml_type, rows=2, split=3, vectors=64 // qb.VECTOR_ELEMENTS[ggml_type])
    first = qm.gemv(x, [w], plans=[plan])
    assert rel_err(first.double(), exact(x, w)) < 2e-6
    assert torch.equal(qm.gemv(x, [w], plans=[plan]), first)
    tickets = ticket_counters(device, "gemv", 1)  # the launches' buffer (it only grows)
    assert int(tickets.abs().sum()) == 0


def test_two_weights_of_two_block_types_in_one_launch(device, quant_blocks):
    """Q8_0 [6, 256] then F16 [3, 256] side by side, each with its own plan (the F16 one split)."""
    a = make_weight(T.Q8_0, 6, 256, device, quant_blocks, seed=1)
    b = make_weight(T.F16, 3, 256, device, quant_blocks, seed=2)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8)).to(device)
    plans = [vector_plan(T.Q8_0, rows=4), vector_plan(T.F16, rows=2, split=2, vectors=8)]
    got = qm.gemv(x, [a, b], plans=plans)
    assert got.shape == (2, 9)
    assert rel_err(got[:, :6].double(), exact(x, a)) < 2e-6
    assert rel_err(got[:, 6:].double(), exact(x, b)) < 2e-6


def test_project_pairs_the_weights_in_launches(device, quant_blocks):
    """Three weights (the interpreter's plans): two launches, the outputs side by side."""
    ws = [make_weight(t, 6, 128, device, quant_blocks, seed=i) for i, t in enumerate((T.Q8_0, T.F16, T.BF16))]
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9)).to(device)
    got = qm.project(x, ws)
    assert rel_err(got.double(), torch.cat([exact(x, w) for w in ws], dim=1)) < 2e-6


def test_vector_gemv_grouped_like_wo_a(device, quant_blocks):
    """Two groups of 6 rows (a block of 4 and a ragged one each), each reading its own 64 columns of x."""
    w = make_weight(T.Q8_0, 2 * 6, 64, device, quant_blocks, seed=3)
    x = torch.randn(2, 2 * 64, generator=torch.Generator().manual_seed(10)).to(device)
    got = qm.gemv(x, [w], groups=2, plans=[vector_plan(T.Q8_0, rows=4, split=2, vectors=2)])
    assert rel_err(got.double(), exact(x, w, groups=2)) < 2e-6


@triton.jit
def _to_float_kernel(q_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, qb.int8_to_float(tl.load(q_ptr + i), False))


def test_int8_to_float_is_exact_for_every_byte(device):
    q = torch.arange(-128, 128, dtype=torch.int8, device=device)
    out = torch.empty(256, device=device)
    _to_float_kernel[(1,)](q, out)
    assert torch.equal(out, q.float())


def test_decode_plans_keep_the_weights_in_flight(monkeypatch):
    """The GPU heuristic at Flash shapes on 132 SMs: two 16-byte vectors or more per thread, and K split
    until the resident programs hold 3.4 MB (or the whole weight), unless a split would drop below
    two passes of K."""
    monkeypatch.setattr(qm, "interpreting", lambda: False)
    monkeypatch.setattr(qm, "warp_size", lambda: 32)
    shapes = [(T.Q8_0, 1536, 4096, 1), (T.Q8_0, 32768, 1024, 1), (T.Q8_0, 1024, 4096, 8), (T.Q8_0, 4096, 8192, 1),
              (T.F16, 2624, 4096, 1), (T.F16, 8192, 1024, 1), (T.F16, 256, 4096, 1), (T.F16, 24, 16384, 1)]  # fmt: skip
    for m in (1, 4):
        for ggml_type, n, k, groups in shapes:
            plan = qm.gemv_plan(m, n, k, ggml_type, groups, sms=132)
            assert plan.vector and plan.rows * 16 >= 32 and plan.block_k <= k
            row_bytes = qm.aligned_row_bytes(ggml_type, k)
            pass_bytes = plan.rows * plan.block_k * row_bytes // k
            programs = qm._programs(m, n, groups, plan)
            resident = min(programs, 132 * qm._resident(plan, m, qb.VECTOR_ELEMENTS[ggml_type]))
            passes = k // plan.split // plan.block_k
            filled = resident * pass_bytes >= min(qm.IN_FLIGHT, groups * n * row_bytes)
            assert passes >= 2 and (filled or passes < 4 or resident < programs)


@triton.jit
def _prefetch_ranges_kernel(out_ptr, M, N, row_bytes, BM: tl.constexpr, R: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    for r in tl.static_range(R):
        start, size = qm.prefetch_range(pid, r, M, N, row_bytes, BM, R, S)
        tl.store(out_ptr + (pid * R + r) * 2, start)
        tl.store(out_ptr + (pid * R + r) * 2 + 1, size.to(tl.int64))


@pytest.mark.parametrize(
    "m,n,row_bytes,groups,bm,r,s",
    [(1, 10, 4352, 1, 1, 4, 1), (1, 9, 4352, 1, 1, 4, 3), (4, 6, 1008, 1, 2, 2, 2), (1, 5, 8704, 3, 1, 4, 4)],
)
def test_prefetch_asks_for_every_weight_byte_once(m, n, row_bytes, groups, bm, r, s, device):
    """The decode GEMV's L2 prefetch (`qmatmul._prefetch`, issued before a dependent launch's wait):
    over all programs, every byte of the weight is asked for once (per m-tile), in 16-byte multiples,
    each program only within its own rows' split share (ragged rows, K splits, groups)."""
    programs = groups * triton.cdiv(n, r) * triton.cdiv(m, bm) * s
    out = torch.full((programs, r, 2), -1, dtype=torch.int64, device=device)
    _prefetch_ranges_kernel[(programs,)](out, m, n, row_bytes, BM=bm, R=r, S=s)
    ranges = out.cpu()
    asked = torch.zeros(groups * n * row_bytes, dtype=torch.int32)
    share = triton.cdiv(triton.cdiv(row_bytes, s), 16) * 16
    for pid in range(programs):
        split = pid % s
        for start, size in ranges[pid].tolist():
            assert size >= 0 and start % 16 == 0 and size % 16 == 0
            if size:
                within = start % row_bytes
                assert within == split * share and within + size <= row_bytes  # its split's share of a row
                asked[start : start + size] += 1
    assert torch.equal(asked, torch.full_like(asked, triton.cdiv(m, bm)))  # every byte, once per m-tile
