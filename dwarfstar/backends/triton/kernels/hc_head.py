"""mHC output head: collapse the streams with sigmoid weights, then the output RMSNorm.

Spec §2.5: m = (fn @ flatten(h)) * rsqrt(mean(h^2) + eps), w_s = sigmoid(m_s * scale + base_s) + eps,
y = sum_s w_s h_s, out = RMSNorm(y; output_norm). No Sinkhorn. The 4 mixes come from the split-K
GEMV as partial sums, like `hc_pre`, whose stream loading this kernel shares.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.hc_pre import MIX_SPLIT, load_streams, sum_partials, tokens_per_program
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, next_pow2
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType


@triton.jit
def _hc_head_kernel(
    h_ptr, mix_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, T, D, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    h, mean_sq = load_streams(h_ptr, t, t_ok, D, NHC, BD)
    s = tl.arange(0, NHC)
    mix = sum_partials(mix_ptr, t.to(tl.int64)[:, None] * NHC + s[None, :], t_ok[:, None], T * NHC, SPLIT)
    mix = mix * tl.rsqrt(mean_sq + norm_eps)[:, None]
    w = tl.sigmoid(mix * tl.load(scale_ptr) + tl.load(base_ptr + s)[None, :]) + hc_eps
    y = tl.sum(w[:, :, None] * h, axis=1)
    d = tl.arange(0, BD)
    y = y * tl.rsqrt(tl.sum(y * y, axis=1) / D + norm_eps)[:, None]
    y = y * tl.load(norm_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], y, mask=t_ok[:, None] & (d < D)[None, :])


def hc_head(
    h: torch.Tensor,
    fn: QWeight,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """h [T, n_hc, D] contiguous -> RMSNorm(sum_s w_s h_s; output_norm) [T, D]."""
    t, nhc, d = h.shape
    mix = qmatmul(h.view(t, nhc * d), fn, split_k=MIX_SPLIT)
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    bt, bd = tokens_per_program(t), next_pow2(d)
    _hc_head_kernel[(triton.cdiv(t, bt),)](
        h, mix, scale, base, norm_weight, out, t, d, hc_eps, norm_eps,
        SPLIT=mix.shape[0], NHC=nhc, BT=bt, BD=bd, num_warps=max(4, min(16, bd // 512)),
    )  # fmt: skip
    return out


def reference(h, fn: QWeight, scale, base, norm_weight, hc_eps, norm_eps) -> torch.Tensor:
    y = ops.hc_head(h, fn.dequantize(), scale, base, hc_eps, norm_eps)
    return ops.rms_norm(y, norm_weight, norm_eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    a, dev, gen = shape.args, shape.device, shape.generator()
    fn = random_qweight(GGMLType.F16, (a.hc_mult, a.hc_mult * a.dim), dev, gen)
    h = torch.randn(1, a.hc_mult, a.dim, device=dev, generator=gen)
    scale, base, norm = (
        torch.full((1,), 0.3, device=dev),
        torch.zeros(a.hc_mult, device=dev),
        torch.ones(a.dim, device=dev),
    )
    run = functools.partial(hc_head, h, fn, scale, base, norm, a.hc_eps, a.norm_eps)
    return [BenchCase("hc_head", "decode 1 token", run, fn.nbytes + 4 * (h.numel() + a.dim), 2 * fn.rows * fn.cols)]
