"""mHC output head: collapse the streams with sigmoid weights, then the output RMSNorm.

Spec §2.5: m = (fn @ flatten(h)) * rsqrt(mean(h^2) + eps), w_s = sigmoid(m_s * scale + base_s) + eps,
y = sum_s w_s h_s, out = RMSNorm(y; output_norm). No Sinkhorn. In a decode step (`fused`) it is one
launch as `hc_pre`'s, with the post of the last sublayer fused in front (`hc_post_head`); prefill
chunks take the 4 mixes from the split-K GEMV as partial sums, and share `hc_pre`'s stream loading.
Without the norm's weight the chunk kernel stops at y: a DSpark drafter's confidence head reads the
collapsed rows before the output norm, which it then takes on its own (`TritonOps.output_norm`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels.hc_pre import (
    MIX_SPLIT,
    as_parts,
    collapse_norm,
    first_streams,
    fused_launch,
    fused_work,
    load_streams,
    post_and_mix,
    square_parts,
    streams_rsqrt,
    sum_partials,
    tokens_per_program,
)
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    KernelWork,
    dependent_launch,
    last_program,
    next_pow2,
    program_values,
    rsqrt_rn,
    wait_for_inputs,
)
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType


@triton.jit
def _hc_head_kernel(
    h_ptr, mix_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, T, D, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    h, mean_sq = load_streams(h_ptr, t, t_ok, D, NHC, BD)
    s = tl.arange(0, NHC)
    mix = sum_partials(mix_ptr, t.to(tl.int64)[:, None] * NHC + s[None, :], t_ok[:, None], T * NHC, SPLIT)
    mix = mix * rsqrt_rn(mean_sq + norm_eps)[:, None]
    w = tl.sigmoid(mix * tl.load(scale_ptr) + tl.load(base_ptr + s)[None, :]) + hc_eps
    y = tl.sum(w[:, :, None] * h, axis=1)
    d = tl.arange(0, BD)
    if NORM:
        y = y * rsqrt_rn(tl.div_rn(tl.sum(y * y, axis=1), D * 1.0) + norm_eps)[:, None]
        y = y * tl.load(norm_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], y, mask=t_ok[:, None] & (d < D)[None, :])


@triton.jit
def _hc_head_fused_kernel(
    h_ptr, parts_ptr, post_ptr, comb_ptr, fn_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, part_ptr, counter_ptr,
    T, D, P, fn_row_bytes, stream_bytes, hc_eps, norm_eps,
    POST: tl.constexpr, WTYPE: tl.constexpr, NHC: tl.constexpr, MIXP: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, NPP: tl.constexpr, FD: tl.constexpr, ONE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    tb, n_prog = tl.program_id(1), tl.num_programs(0)
    post_and_mix(
        h_ptr, parts_ptr, post_ptr, comb_ptr, fn_ptr, part_ptr, tb, T, D, P, fn_row_bytes, stream_bytes, NHC,
        POST, WTYPE, NHC, MIXP, BT, BD,
    )  # fmt: skip
    if last_program(counter_ptr + tb, n_prog):
        s = tl.arange(0, NHC)[None, :]  # [1, NHC]
        for i in range(BT):
            t = tb * BT + i
            if t < T:
                first = first_streams(h_ptr, norm_ptr, t, D, NHC, FD)
                mix = program_values(part_ptr, t, s, s >= 0, n_prog, MIXP + 1, NPP)
                squares = square_parts(part_ptr, t, n_prog, NHC, MIXP, NPP)
                scale, base = tl.load(scale_ptr), tl.load(base_ptr + s)  # with the other loads
                mix = tl.sum(mix, axis=0) * streams_rsqrt(squares, D, norm_eps, NHC)[:, None]
                w = tl.sigmoid(mix * scale + base) + hc_eps
                collapse_norm(h_ptr, first, t, w, norm_ptr, out_ptr, D, norm_eps, NHC, FD, ONE_BLOCK)


def _fused(h, parts, post, comb, fn, scale, base, norm_weight, hc_eps, norm_eps, dims, tokens) -> torch.Tensor:
    t, nhc, d = h.shape
    sizes, grid, part, counters = fused_launch(h, parts, fn, nhc, dims, tokens)
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    before = (h, h, h) if parts is None else (parts, post, comb)  # unread without the post
    _hc_head_fused_kernel[grid](
        h, *before, fn.data, scale, base, norm_weight, out, part, counters, hc_eps=hc_eps, norm_eps=norm_eps,
        **sizes, **dependent_launch(),
    )  # fmt: skip
    return out


def hc_head(
    h: torch.Tensor,
    fn: QWeight,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor | None,
    hc_eps: float,
    norm_eps: float,
    fused: bool = False,
    dims: int | None = None,
    tokens: int | None = None,
) -> torch.Tensor:
    """h [T, n_hc, D] contiguous -> RMSNorm(sum_s w_s h_s; output_norm) [T, D]; `fused` as `hc_pre.hc_pre`'s.
    Without `norm_weight`: sum_s w_s h_s alone (the chunk kernel; a decode step's head always norms)."""
    t, nhc, d = h.shape
    if fused and norm_weight is not None:
        return _fused(h, None, None, None, fn, scale, base, norm_weight, hc_eps, norm_eps, dims, tokens)
    mix = qmatmul(h.view(t, nhc * d), fn, split_k=MIX_SPLIT)
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    bt, bd = tokens_per_program(t), next_pow2(d)
    _hc_head_kernel[(triton.cdiv(t, bt),)](
        h, mix, scale, base, scale if norm_weight is None else norm_weight, out, t, d, hc_eps, norm_eps,
        SPLIT=mix.shape[0], NHC=nhc, BT=bt, BD=bd, NORM=norm_weight is not None, num_warps=max(4, min(16, bd // 512)),
    )  # fmt: skip
    return out


def hc_post_head(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *head, dims=None, tokens=None
) -> torch.Tensor:
    """The post of the last sublayer (h updated in place, as `hc_post`), then `hc_head` of every token,
    `head` its (fn, scale, base, norm_weight, hc_eps, norm_eps), in one launch. For a decode step; a
    prefill chunk runs `hc_post`, then `hc_head`."""
    return _fused(h, as_parts(out), post, comb, *head, dims, tokens)


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a `_hc_head_fused_kernel` launch moves (see `runtime.KernelWork`)."""
    return fused_work(a, a["NHC"]) if kernel == "_hc_head_fused_kernel" else None


def reference(h, fn: QWeight, scale, base, norm_weight, hc_eps, norm_eps) -> torch.Tensor:
    y = ops.hc_head(h, fn.dequantize(), scale, base, hc_eps, norm_eps)
    return ops.rms_norm(y, norm_weight, norm_eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The head of one decode token, alone and with the last sublayer's post fused in front."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    fn = random_qweight(GGMLType.F16, (a.hc_mult, a.hc_mult * a.dim), dev, gen)
    h = torch.randn(1, a.hc_mult, a.dim, device=dev, generator=gen)
    scale, base, norm = (
        torch.full((1,), 0.3, device=dev),
        torch.zeros(a.hc_mult, device=dev),
        torch.ones(a.dim, device=dev),
    )
    const = (fn, scale, base, norm, a.hc_eps, a.norm_eps)
    out = torch.randn(1, a.dim, device=dev, generator=gen)
    post = torch.rand(1, a.hc_mult, device=dev, generator=gen)
    comb = torch.rand(1, a.hc_mult, a.hc_mult, device=dev, generator=gen)
    moved, flops = fn.nbytes + 4 * (h.numel() + a.dim), 2 * fn.rows * fn.cols
    alone = functools.partial(hc_head, h, *const, fused=True)
    after_post = functools.partial(hc_post_head, h, out, post, comb, *const)
    return [
        BenchCase("hc_head", "decode 1 token", alone, moved, flops),
        BenchCase("hc_head", "decode post + head, 1 token", after_post, moved + 4 * (2 * h.numel() + a.dim), flops),
    ]
