"""mHC post-mix: new streams from the sublayer output, in place.

Spec §2.2: stream k becomes post_k * o + sum_j comb[j, k] * h_j (column k of comb). The sublayer
output may come in P parts that are summed first, in order: the MoE passes its k routed expert
slots and the shared expert as [T, k + 1, D], so the expert outputs are combined here instead of
in a separate pass over memory. Each program owns a [n_hc, BD] slice of one token's streams, reads
it whole before writing it back, so updating h in place is safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2


@triton.jit
def _hc_post_kernel(
    h_ptr, parts_ptr, post_ptr, comb_ptr, T, D, P,
    NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, NHC)
    ok = (t < T)[:, None] & (d < D)[None, :]
    t64 = t.to(tl.int64)
    o = tl.zeros((BT, BD), dtype=tl.float32)
    for p in range(P):
        o += tl.load(parts_ptr + (t64[:, None] * P + p) * D + d[None, :], mask=ok, other=0.0)
    t_ok = (t < T)[:, None]
    post = tl.load(post_ptr + t[:, None] * NHC + s[None, :], mask=t_ok, other=0.0)  # [BT, k]
    mixed = post[:, :, None] * o[:, None, :]  # [BT, k, BD]
    for j in tl.static_range(NHC):
        comb_j = tl.load(comb_ptr + (t[:, None] * NHC + j) * NHC + s[None, :], mask=t_ok, other=0.0)  # [BT, k]
        h_j = tl.load(h_ptr + (t64[:, None] * NHC + j) * D + d[None, :], mask=ok, other=0.0)  # [BT, BD]
        mixed += comb_j[:, :, None] * h_j[:, None, :]
    h_off = (t64[:, None, None] * NHC + s[None, :, None]) * D + d[None, None, :]
    tl.store(h_ptr + h_off, mixed, mask=ok[:, None, :])


def hc_post(h: torch.Tensor, parts: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h [T, n, D] (updated in place and returned), parts [T, P, D] or [T, D], post [T, n], comb [T, n, n]."""
    t, nhc, d = h.shape
    parts = parts if parts.dim() == 3 else parts.unsqueeze(1)
    if not (h.is_contiguous() and parts.is_contiguous()):
        raise ValueError("h and parts must be contiguous")
    if interpreting():
        bt, bd = min(16, next_pow2(t)), next_pow2(d)
    else:
        bt, bd = 1, min(1024, next_pow2(d))
    grid = (triton.cdiv(t, bt), triton.cdiv(d, bd))
    _hc_post_kernel[grid](h, parts, post, comb, t, d, parts.shape[1], NHC=nhc, BT=bt, BD=bd, num_warps=4)
    return h


def reference(h, parts, post, comb) -> torch.Tensor:
    out = parts.sum(1) if parts.dim() == 3 else parts
    return ops.hc_post(out, h, post, comb)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """mHC post after the MoE (k routed slots + the shared expert summed in) for decode and prefill."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        parts = torch.randn(t, a.n_activated_experts + 1, a.dim, device=dev, generator=gen)
        post = torch.rand(t, a.hc_mult, device=dev, generator=gen)
        comb = torch.rand(t, a.hc_mult, a.hc_mult, device=dev, generator=gen)
        run = functools.partial(hc_post, h, parts, post, comb)
        cases.append(
            BenchCase("hc_post", f"{what} {t} tokens, {parts.shape[1]} parts", run, 4 * (2 * h.numel() + parts.numel()))
        )
    return cases
