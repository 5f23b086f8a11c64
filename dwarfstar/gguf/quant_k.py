"""Q4_K and Q2_K encoders, with and without importance weights.

Without weights they follow ggml's reference quantizers (`quantize_row_q4_K_ref`, `quantize_row_q2_K_ref`),
so a file we write has the error llama.cpp's `llama-quantize` would give it. With weights they run ggml's
imatrix paths (`quantize_row_q4_K_impl`, `quantize_row_q2_K_impl`) and the reference one, and keep for
each super-block whichever has the lower importance-weighted error. Each function takes a batch of
super-blocks x (n, 256) and, optionally, the importance of each element qw (n, 256), and returns the
block bytes (n, block_size) as uint8.

A super-block holds sub-blocks (8 of 32 for Q4_K, 16 of 16 for Q2_K), each with its own scale and min;
those are quantized in turn against one fp16 d and dmin per super-block (6 bits for Q4_K, 4 for Q2_K).
After that, every element is re-rounded against the scales as they will be decoded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.quant_search import fit_scale, fit_scale_min

Encoder = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _f16_bytes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v rounded to fp16 as float32 column, its two little-endian bytes)."""
    h = v.half()
    return h.float().unsqueeze(-1), h.unsqueeze(-1).view(torch.uint8)


def _requantize(x: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, nmax: int) -> torch.Tensor:
    """Levels l in [0, nmax] for x ≈ d·l − dmin, with the per-sub-block d and dmin actually stored.

    x (n, subs, size); d, dmin (n, subs). A sub-block whose scale is zero decodes to −dmin whatever l is.
    """
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((x + dmin.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, nmax)
    return torch.where((d == 0).unsqueeze(-1), torch.zeros_like(q), q).to(torch.uint8)


def _quantize_super(values: torch.Tensor, top: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's reference rule for the sub-block scales: round values·nmax/top; d = top/nmax."""
    inv = torch.where(top > 0, nmax / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    levels = (values * inv.unsqueeze(-1)).round_().clamp_(0, nmax)
    return levels, top / nmax


def quantize_q4_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    return _q4_k(x, None) if qw is None else _lower_weighted_error(x, qw, _q4_k, GGMLType.Q4_K)


def quantize_q2_k(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    return _q2_k(x, None) if qw is None else _lower_weighted_error(x, qw, _q2_k, GGMLType.Q2_K)


def _lower_weighted_error(x: torch.Tensor, qw: torch.Tensor, encode: Encoder, ggml_type: GGMLType) -> torch.Tensor:
    """ggml's imatrix encoding of each super-block, or its reference one where that has the lower
    importance-weighted error. ggml's imatrix search weighs by qw·sqrt(σ² + x²), a proxy: with a flat or
    weak imatrix the reference search fits better (Q4_K on N(0, 1): 0.071 vs 0.076 relative RMS)."""
    candidates = (encode(x, qw), encode(x, None))
    errors = [((dequantize(c, ggml_type, x.numel()).view_as(x) - x).square_() * qw).sum(-1) for c in candidates]
    return torch.where((errors[0] <= errors[1]).unsqueeze(-1), *candidates)


def _fit_super_block(
    x: torch.Tensor,
    qw: torch.Tensor | None,
    subs: int,
    nmax: int,
    scale_max: int,
    sigma_weight: float,
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, ...]:
    """One K-quant super-block fit, shared by Q4_K and Q2_K: each of the `subs` sub-blocks' scale and
    min, by ggml's `reference` search (qw None) or its imatrix one (weights qw·sqrt(sigma_weight·σ² + x²)),
    quantized to levels 0..scale_max against one fp16 d and dmin; then every element re-rounded to a
    level 0..nmax against them as decoded. Returns (scale levels, min levels, d bytes, dmin bytes, levels)."""
    n = x.shape[0]
    sub = x.reshape(n * subs, -1)
    if qw is None:
        scales, mins = reference(sub)
        scales, mins = scales.reshape(n, subs), mins.reshape(n, subs)
        ls, d = _quantize_super(scales, scales.amax(-1), scale_max)
        lm, dmin = _quantize_super(mins, mins.amax(-1), scale_max)
    else:
        sigma2 = sigma_weight * x.square().mean(-1, keepdim=True)
        weights = (qw * (sigma2 + x.square()).sqrt()).reshape(n * subs, -1)
        scales, mins = fit_scale_min(sub, weights, nmax, -0.9, 0.05, 36, mad=False)
        sw = weights.sum(-1).reshape(n, subs)
        d, ls = fit_scale(scales.reshape(n, subs), sw, scale_max)
        dmin, lm = fit_scale(mins.reshape(n, subs), sw, scale_max)
    d, d_bytes = _f16_bytes(d)
    dmin, dmin_bytes = _f16_bytes(dmin)
    q = _requantize(x.reshape(n, subs, -1), d * ls, dmin * lm, nmax)
    return ls, lm, d_bytes, dmin_bytes, q


def _q4_k_reference(sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # weights favour large elements over the sub-block's RMS, as in quantize_row_q4_K_ref
    weights = sub.square().mean(-1, keepdim=True).sqrt() + sub.abs()
    return fit_scale_min(sub, weights, 15, -1.0, 0.1, 20, mad=False)


def _q2_k_reference(sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # ggml's reference minimises the |x|-weighted absolute error here, not the squared one
    return fit_scale_min(sub, sub.abs(), 3, -0.5, 0.1, 15, mad=True)


def _q4_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    ls, lm, d_bytes, dmin_bytes, q = _fit_super_block(x, qw, 8, 15, 63, 2.0, _q4_k_reference)
    ls, lm = ls.to(torch.uint8), lm.to(torch.uint8)
    # 12 scale bytes: 6-bit scales 0-3 and mins 0-3 in bytes 0-7, whose top 2 bits carry the high bits of
    # scales/mins 4-7; bytes 8-11 hold the low nibbles of scales 4-7 (low) and mins 4-7 (high)
    packed_scales = torch.cat(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        dim=1,
    )
    # sub-blocks 2p and 2p+1 share 32 bytes: low nibble, then high nibble
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return torch.cat([d_bytes, dmin_bytes, packed_scales, qs], dim=1)


def _q2_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    ls, lm, d_bytes, dmin_bytes, q = _fit_super_block(x, qw, 16, 3, 15, 1.0, _q2_k_reference)
    packed_scales = ls.to(torch.uint8) | (lm.to(torch.uint8) << 4)
    # each half of 128 elements packs 4 runs of 32 into one byte each, at bit shifts 0, 2, 4, 6
    runs = q.reshape(n, 2, 4, 32)
    qs = runs[:, :, 0] | (runs[:, :, 1] << 2) | (runs[:, :, 2] << 4) | (runs[:, :, 3] << 6)
    return torch.cat([packed_scales, qs.reshape(n, 64), d_bytes, dmin_bytes], dim=1)
