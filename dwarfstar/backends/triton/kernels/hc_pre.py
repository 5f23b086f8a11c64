"""mHC pre-mix: from the 24 mixes to the sublayer input, with Sinkhorn, in one kernel per token.

Spec §2.2. The 24 mixes `fn @ flatten(h)` come from the fused GEMV (`qmatmul`, split over K: 24 rows
of 16384 columns would leave the GPU idle) as partial sums that this kernel adds. Per token it then:
scales the mixes by rsqrt(mean(h^2) + eps); takes pre = sigmoid(.) + eps and post = 2 sigmoid(.);
runs Sinkhorn on the 4 x 4 combination logits (row softmax, column normalise, 19 rounds of row and
column normalisation); collapses x = sum_s pre_s h_s; and applies the sublayer's RMSNorm, so the
output is the attention or MoE input directly. The token's 4 streams stay in registers throughout
(4 x 4096 floats for Flash).

BT tokens per program: 1 on a GPU (a program per token fills the chip in prefill; decode is one
token anyway), 16 in the interpreter, where each program instance costs a fixed overhead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType

MIX_SPLIT = 8  # K splits of the 24-row mix GEMV (4 * D columns)


@triton.jit
def load_streams(h_ptr, t, t_ok, D, NHC: tl.constexpr, BD: tl.constexpr):
    """The streams of tokens t [BT] as a [BT, NHC, BD] tile, and the mean square of all NHC * D values."""
    s = tl.arange(0, NHC)
    d = tl.arange(0, BD)
    off = (t.to(tl.int64)[:, None, None] * NHC + s[None, :, None]) * D + d[None, None, :]
    h = tl.load(h_ptr + off, mask=t_ok[:, None, None] & (d < D)[None, None, :], other=0.0)
    mean_sq = tl.sum(tl.sum(h * h, axis=2), axis=1) / (NHC * D)
    return h, mean_sq


@triton.jit
def sum_partials(ptr, offsets, mask, split_stride, SPLIT: tl.constexpr):
    """sum over SPLIT partial results laid out `split_stride` apart, at `offsets` (any shape)."""
    acc = tl.zeros(offsets.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ptr + s * split_stride + offsets, mask=mask, other=0.0)
    return acc


@triton.jit
def _hc_pre_kernel(
    h_ptr, mix_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, post_ptr, comb_ptr,
    T, D, iters, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    h, mean_sq = load_streams(h_ptr, t, t_ok, D, NHC, BD)
    rs = tl.rsqrt(mean_sq + norm_eps)  # [BT]
    n_mix = NHC * (NHC + 2)
    s = tl.arange(0, NHC)
    t2, t3 = t_ok[:, None], t_ok[:, None, None]
    row = t.to(tl.int64) * n_mix
    stride = T * n_mix
    pre = sum_partials(mix_ptr, row[:, None] + s[None, :], t2, stride, SPLIT) * rs[:, None]
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + s)[None, :]) + hc_eps
    post = sum_partials(mix_ptr, row[:, None] + NHC + s[None, :], t2, stride, SPLIT) * rs[:, None]
    post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + NHC + s)[None, :])
    jk = 2 * NHC + NHC * s[:, None] + s[None, :]  # [NHC, NHC]: comb[j, k] at 8 + 4j + k
    comb = sum_partials(mix_ptr, row[:, None, None] + jk[None, :, :], t3, stride, SPLIT) * rs[:, None, None]
    comb = comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + jk)[None, :, :]
    # Sinkhorn: row softmax (+eps), column normalisation, then iters - 1 rounds of row and column
    comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    x = tl.sum(pre[:, :, None] * h, axis=1)  # [BT, BD], from the raw (un-normalised) streams
    d = tl.arange(0, BD)
    x = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + norm_eps)[:, None]
    x = x * tl.load(norm_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], x, mask=t2 & (d < D)[None, :])
    tl.store(post_ptr + t[:, None] * NHC + s[None, :], post, mask=t2)
    tl.store(comb_ptr + t[:, None, None] * NHC * NHC + (NHC * s[:, None] + s[None, :])[None, :, :], comb, mask=t3)


def tokens_per_program(t: int) -> int:
    return min(16, next_pow2(t)) if interpreting() else 1


def hc_pre(
    h: torch.Tensor,
    fn: QWeight,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n_hc, D] contiguous -> (RMSNorm(collapsed x; norm_weight) [T, D], post [T, n], comb [T, n, n])."""
    t, nhc, d = h.shape
    mix = qmatmul(h.view(t, nhc * d), fn, split_k=MIX_SPLIT)
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    post = torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    comb = torch.empty(t, nhc, nhc, device=h.device, dtype=torch.float32)
    bt, bd = tokens_per_program(t), next_pow2(d)
    _hc_pre_kernel[(triton.cdiv(t, bt),)](
        h, mix, scale, base, norm_weight, out, post, comb, t, d, iters, hc_eps, norm_eps,
        SPLIT=mix.shape[0], NHC=nhc, BT=bt, BD=bd, num_warps=max(4, min(16, bd // 512)),
    )  # fmt: skip
    return out, post, comb


def reference(h, fn: QWeight, scale, base, norm_weight, iters, hc_eps, norm_eps):
    x, post, comb = ops.hc_pre(h, fn.dequantize(), scale, base, iters, hc_eps, norm_eps)
    return ops.rms_norm(x, norm_weight, norm_eps), post, comb


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """mHC pre of one decode token and of a prefill chunk, the mix GEMV included."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    fn = random_qweight(GGMLType.F16, (a.hc_mix_dim, a.hc_mult * a.dim), dev, gen)
    scale, base = torch.full((3,), 0.3, device=dev), torch.zeros(a.hc_mix_dim, device=dev)
    norm = torch.ones(a.dim, device=dev)
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        run = functools.partial(hc_pre, h, fn, scale, base, norm, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        moved = fn.nbytes + 4 * (h.numel() + t * a.dim)
        cases.append(BenchCase("hc_pre", f"{what} {t} tokens", run, moved, 2 * t * fn.rows * fn.cols))
    return cases
