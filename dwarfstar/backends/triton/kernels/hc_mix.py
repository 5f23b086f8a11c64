"""V4.1's mHC mix (lagged mHC, reference `Block.hc_mixes`): a sublayer's (pre, post, comb) from its input streams.

The mixes and Sinkhorn are V4's (`hc_pre`: the 24 mixes fn @ flatten(h) from the split-K GEMV,
scaled by rsqrt(mean(h^2) + eps); pre = sigmoid + eps, post = 2 sigmoid, comb through Sinkhorn), but
nothing is collapsed here: V4.1 collapses a sublayer's input with the pre of the sublayer before
(`hc_collapse`), so the pre is written out for the next one. One program per BT tokens, the streams in
registers (`hc_pre.load_streams`).

In a decode step (`hc_post_mix`) a sublayer's mHC steps are one launch of V4's kernel
(`hc_pre._hc_pre_fused_kernel`, as `hc_pre.hc_post_pre`) with LAGGED: the post of the sublayer before
(in place, when there is one), the partial mixes and squares of each program's BD dims, and in the
last program of a token to finish the sums in a fixed order and Sinkhorn; the pre is written out, and
the collapse plus the sublayer's norm take the pre of the sublayer before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import hc_collapse
from dwarfstar.backends.triton.kernels import hc_post as post_kernel
from dwarfstar.backends.triton.kernels.hc_pre import MIX_SPLIT, as_parts, launch_fused, stream_mixes
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType


@triton.jit
def _hc_mix_kernel(
    h_ptr, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, D, iters, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    _, pre, post, comb = stream_mixes(
        h_ptr, mix_ptr, scale_ptr, base_ptr, t, t_ok, T, D, iters, hc_eps, norm_eps, SPLIT, NHC, BD
    )
    s = tl.arange(0, NHC)
    t2, t3 = t_ok[:, None], t_ok[:, None, None]
    tl.store(pre_ptr + t[:, None] * NHC + s[None, :], pre, mask=t2)
    tl.store(post_ptr + t[:, None] * NHC + s[None, :], post, mask=t2)
    tl.store(comb_ptr + t[:, None, None] * NHC * NHC + (NHC * s[:, None] + s[None, :])[None, :, :], comb, mask=t3)


def hc_mix(
    h: torch.Tensor, fn: QWeight, scale: torch.Tensor, base: torch.Tensor, iters: int, hc_eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n, D] contiguous -> (pre [T, n], post [T, n], comb [T, n, n]); fn [(2 + n) * n, n * D]."""
    t, nhc, d = h.shape
    if not h.is_contiguous() or fn.rows != nhc * (nhc + 2) or fn.cols != nhc * d:
        raise ValueError(f"mHC mix [{fn.rows}, {fn.cols}] does not fit streams {tuple(h.shape)} (contiguous)")
    mix = qmatmul(h.view(t, nhc * d), fn, split_k=MIX_SPLIT)
    pre = torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    post = torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    comb = torch.empty(t, nhc, nhc, device=h.device, dtype=torch.float32)
    bt = min(16, next_pow2(t)) if interpreting() else 1
    bd = next_pow2(d)
    _hc_mix_kernel[(triton.cdiv(t, bt),)](
        h, mix, scale, base, pre, post, comb, t, d, iters, hc_eps, norm_eps,
        SPLIT=mix.shape[0], NHC=nhc, BT=bt, BD=bd, num_warps=max(4, min(16, bd // 512)),
    )  # fmt: skip
    return pre, post, comb


def hc_post_mix(
    h: torch.Tensor,
    after: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: QWeight,
    scale: torch.Tensor,
    base: torch.Tensor,
    pre: torch.Tensor,
    norm: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    dims: int | None = None,
    tokens: int | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A sublayer's mHC steps in one launch (a decode step): h [T, n, D] contiguous updated in place by
    the post `after` (the sublayer before's output [T, D] or parts [T, P, D], post [T, n], comb
    [T, n, n]; None: none), its mix ((pre, post, comb) as `hc_mix`), and the collapse with `pre` [T, n]
    (the sublayer before's) normed by `norm` [D] ([T, D], as `hc_collapse`). `dims` and `tokens` size
    the programs (`hc_pre.fused_launch`); the launch is `hc_pre.launch_fused`'s."""
    d = h.shape[2]
    if pre.shape != h.shape[:2] or norm.shape != (d,):
        raise ValueError(f"collapse of streams {tuple(h.shape)} with pre {tuple(pre.shape)}, norm {tuple(norm.shape)}")
    parts, post, comb = (None, None, None) if after is None else (as_parts(after[0]), *after[1:])
    x, *mixes = launch_fused(
        h, parts, post, comb, fn, scale, base, norm, iters, hc_eps, norm_eps, dims, tokens, lag=pre.contiguous()
    )
    return tuple(mixes), x  # type: ignore[return-value]


def reference(h, fn: QWeight, scale, base, iters, hc_eps, norm_eps):
    return ops.hc_mix(h, fn.dequantize(), scale, base, iters, hc_eps, norm_eps)


def reference_post_mix(h, after, fn: QWeight, scale, base, pre, norm, iters, hc_eps, norm_eps):
    """(new streams, (pre, post, comb), x): `hc_post`'s reference (with `after`), `hc_mix`'s, `hc_collapse`'s."""
    h = h if after is None else post_kernel.reference(h, *after)
    return h, reference(h, fn, scale, base, iters, hc_eps, norm_eps), hc_collapse.reference(h, pre, norm, norm_eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The mix of a decode token and of a prefill chunk (F32 fn), and a decode step's one launch with and
    without the post before it."""
    a, dev, gen = shape.args, shape.device, shape.generator()  # V4's fields of the same meaning
    mixes = a.hc_mult * (a.hc_mult + 2)
    fn = random_qweight(GGMLType.F32, (mixes, a.hc_mult * a.dim), dev, gen)
    scale, base = torch.rand(3, device=dev, generator=gen), torch.randn(mixes, device=dev, generator=gen)
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        run = functools.partial(hc_mix, h, fn, scale, base, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        cases.append(BenchCase("hc_mix", f"V4.1 {what} {t} tokens", run, fn.nbytes + 4 * h.numel()))
    h = torch.randn(1, a.hc_mult, a.dim, device=dev, generator=gen)
    after = (torch.randn(1, a.dim, device=dev, generator=gen), torch.rand(1, a.hc_mult, device=dev, generator=gen),
             torch.rand(1, a.hc_mult, a.hc_mult, device=dev, generator=gen))  # fmt: skip
    pre, norm = torch.rand(1, a.hc_mult, device=dev, generator=gen), torch.rand(a.dim, device=dev, generator=gen)
    for what, before in (("post + mix + collapse", after), ("mix + collapse (no post before)", None)):
        run = functools.partial(hc_post_mix, h, before, fn, scale, base, pre, norm, a.hc_sinkhorn_iters, a.hc_eps,
                                a.norm_eps)  # fmt: skip
        moved = fn.nbytes + 4 * ((3 if before else 2) * h.numel() + 2 * a.dim)
        cases.append(BenchCase("hc_mix", f"V4.1 decode {what}, 1 token", run, moved))
    return cases
