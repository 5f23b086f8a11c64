"""V4.1's mHC collapse (reference `Block.hc_pre`): a sublayer's input RMSNorm(sum_k pre_k h_k; norm) from its streams
and the pre weights the sublayer before computed (the one-hot (1, 0, ..., 0) for the first), and the
output head's, with the last FFN's pre and the output norm. One program per token (`hc_pre.collapse_norm`:
a row of up to 4096 dims in registers, a longer one in blocks, scaled once its sum of squares is known).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.hc_pre import collapse_block, collapse_norm, first_streams
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape


@triton.jit
def _hc_collapse_kernel(
    h_ptr, pre_ptr, norm_ptr, out_ptr, D, eps, NHC: tl.constexpr, FD: tl.constexpr, ONE_BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    pre = tl.load(pre_ptr + t.to(tl.int64) * NHC + tl.arange(0, NHC)[None, :])  # [1, NHC]
    first = first_streams(h_ptr, norm_ptr, t, D, NHC, FD)
    collapse_norm(h_ptr, first, t, pre, norm_ptr, out_ptr, D, eps, NHC, FD, ONE_BLOCK)


def hc_collapse(h: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """h [T, n, D] contiguous, pre [T, n], norm [D] -> RMSNorm(sum_k pre_k h_k; norm) [T, D]."""
    t, nhc, d = h.shape
    if not h.is_contiguous() or pre.shape != h.shape[:2] or norm.shape != (d,):
        raise ValueError(f"collapse of streams {tuple(h.shape)} with pre {tuple(pre.shape)}, norm {tuple(norm.shape)}")
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    fd = collapse_block(d)
    _hc_collapse_kernel[(t,)](h, pre.contiguous(), norm, out, d, eps, NHC=nhc, FD=fd, ONE_BLOCK=fd >= d, num_warps=8)
    return out


def reference(h, pre, norm, eps):
    return ops.rms_norm((pre.unsqueeze(-1) * h).sum(1), norm, eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The collapse of a decode token and of a prefill chunk."""
    a, dev, gen = shape.args, shape.device, shape.generator()  # V4's fields of the same meaning
    norm = torch.rand(a.dim, device=dev, generator=gen)
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        pre = torch.rand(t, a.hc_mult, device=dev, generator=gen)
        run = functools.partial(hc_collapse, h, pre, norm, a.norm_eps)
        cases.append(BenchCase("hc_collapse", f"V4.1 {what} {t} tokens", run, 4 * (h.numel() + t * a.dim)))
    return cases
