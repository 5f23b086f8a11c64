"""V4.1's Engram gate (V4.1's reference `Engram.forward`): the streams enriched by the Engram projection.

Per token, with H [n, D] its streams and kv = W_kv . fp8(E) [(n + 1) * D] (the caller's: the rows'
FP8 rounding in `rms_norm_rope`, the product in `qmatmul`), key_k = kv[k * D : (k + 1) * D] and the
value kv[n * D :] shared by the n streams, w = q_weight * k_weight [n, D]:

    dot_k = (sum_c H_k[c] w_k[c] key_k[c]) * rsqrt(mean(H_k^2) + eps) * rsqrt(mean(key_k^2) + eps) / sqrt(D)
    g_k   = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6)))
    H_k  += g_k * value

One program per (token, stream), its D dims in blocks of BD: a pass for the three sums, a pass for
the new stream (written to a new tensor: the caller's streams are left as they were).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2, rsqrt_rn
from dwarfstar.model.numerics import elementwise

GATE_FLOOR = 1e-6  # |dot| is floored before the square root (`backends.reference.v41.engram`)


@triton.jit
def _engram_gate_kernel(h_ptr, kv_ptr, w_ptr, out_ptr, D, eps, sqrt_d, floor, NHC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    h_row = h_ptr + (t * NHC + k) * D
    key_row = kv_ptr + (t * (NHC + 1) + k) * D
    hh = tl.zeros([BD], tl.float32)
    kk = tl.zeros([BD], tl.float32)
    hwk = tl.zeros([BD], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        h = tl.load(h_row + d, mask=ok, other=0.0)
        key = tl.load(key_row + d, mask=ok, other=0.0)
        hh += h * h
        kk += key * key
        hwk += h * tl.load(w_ptr + k * D + d, mask=ok, other=0.0) * key
    r = rsqrt_rn(tl.div_rn(tl.sum(hh, axis=0), D * 1.0) + eps) * rsqrt_rn(tl.div_rn(tl.sum(kk, axis=0), D * 1.0) + eps)
    dot = tl.div_rn(tl.sum(hwk, axis=0) * r, sqrt_d)
    sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    gate = tl.sigmoid(sign * tl.sqrt_rn(tl.maximum(tl.abs(dot), floor)))
    value_row = kv_ptr + (t * (NHC + 1) + NHC) * D
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        h = tl.load(h_row + d, mask=ok, other=0.0)
        tl.store(out_ptr + (t * NHC + k) * D + d, h + gate * tl.load(value_row + d, mask=ok, other=0.0), mask=ok)


def engram_gate(h: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """New streams [T, n, D] from streams h [T, n, D], the Engram projections kv [T, (n + 1) * D] and
    w = q_weight * k_weight [n, D] (see the module)."""
    t, nhc, d = h.shape
    if tuple(kv.shape) != (t, (nhc + 1) * d) or tuple(w.shape) != (nhc, d):
        raise ValueError(f"engram kv {tuple(kv.shape)} / w {tuple(w.shape)} do not fit streams {tuple(h.shape)}")
    h, kv = h.contiguous(), kv.contiguous()
    out = torch.empty_like(h)
    bd = next_pow2(d) if interpreting() else min(1024, next_pow2(d))
    _engram_gate_kernel[(t, nhc)](h, kv, w.contiguous(), out, d, eps, math.sqrt(d), GATE_FLOOR, NHC=nhc, BD=bd,
                                  num_warps=4)  # fmt: skip
    return out


def reference(h: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The gate in plain torch float32, term by term as the module states it."""
    t, n, d = h.shape
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d :]
    r = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * w * key).sum(-1) * r / math.sqrt(d)
    gate = elementwise(torch.sigmoid, dot.sign() * dot.abs().clamp_min(GATE_FLOOR).sqrt())
    return h + gate[..., None] * value[:, None, :]


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """The gate of a decode token and of a prefill chunk."""
    a, dev, gen = shape.args, shape.device, shape.generator()  # V4's fields of the same meaning
    w = torch.randn(a.hc_mult, a.dim, device=dev, generator=gen)
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        kv = torch.randn(t, (a.hc_mult + 1) * a.dim, device=dev, generator=gen)
        run = functools.partial(engram_gate, h, kv, w, a.norm_eps)
        cases.append(BenchCase("engram_gate", f"V4.1 {what} {t} tokens", run, 4 * (3 * h.numel() + kv.numel())))
    return cases
