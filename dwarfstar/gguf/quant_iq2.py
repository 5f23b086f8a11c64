"""IQ2_XXS encoder: 2.06 bits per weight from a 256-point grid of 8-element patterns.

The search follows ggml's `quantize_row_iq2_xxs_impl`: each group of 32 elements gets signs from the
data (an even number of minus signs per 8, since only 7 sign bits are stored: when the count is odd,
the least important element is flipped), then a scale search over candidate scales picks, for every
8 elements, a grid pattern, and keeps the scale whose least-squares refit fits best. The 8 group scales
are finally stored as 4-bit multiples of one fp16 d per super-block.

It differs from ggml where ggml approximates, so its error is lower at the same bits:
* the grid levels are the decoded ones, 1 : 3.125 : 5.375 (grid bytes 8, 25, 43), not 1 : 3 : 5;
* the pattern for 8 elements is the exact nearest of all 256 (one small matmul scores them all), not
  the best of the grid points next to the rounded pattern; like ggml it weighs the distance with the
  square root of the weights (measured: lower error than the full weights, plain and weighted alike);
* after the group scales are rounded to 4 bits, every pattern is chosen again for the scale that
  will actually be decoded.
Like ggml it needs importance weights; `quantize` supplies a fallback when there are none.
"""

from __future__ import annotations

from functools import cache

import torch

from dwarfstar.gguf.dequant import _iq2xxs_tables
from dwarfstar.gguf.quant_search import GROUP_MAX_EPS, fit_scale

_SCORE_ROWS = 4096
# Candidate scales eff_max / c. ggml tries c = 5 + 0.1·k for k in −6..6; with exact patterns every
# other one gives the same error (measured), at half the cost.
_CANDIDATES = [5 + 0.2 * k for k in range(-3, 4)]


@cache
def _grid_terms(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels (256, 8): each pattern's decoded values over 2·d·(0.5+s); rhs (16, 256) for scoring)."""
    grid, _ = _iq2xxs_tables()
    levels = (grid / 8).to(device)
    return levels, torch.cat([levels.square(), levels], dim=1).T.contiguous()


def _nearest(xval: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Index of the pattern minimising Σ w (scale·level − xval)² for each row of 8; scale is per row.

    The score expands to scale²·Σ w·level² − 2·scale·Σ w·xval·level (the Σ w·xval² term is common to all
    patterns), which is one (rows, 16) × (16, 256) matmul.
    """
    _, rhs = _grid_terms(xval.device)
    s = scale.unsqueeze(-1)
    lhs = torch.cat([w * (s * s), w * xval * (-2 * s)], dim=-1)
    # in slices, so the (rows, 256) scores stay in cache between the matmul and the argmin
    return torch.cat([(part @ rhs).argmin(-1) for part in lhs.split(_SCORE_ROWS)])


def _fit(xval: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·x·q, Σ w·q²) per group of 32 for the patterns idx: xval, w (G, 4, 8), idx (G, 4)."""
    levels, _ = _grid_terms(xval.device)
    q = levels[idx]
    wq = w * q
    return (wq * xval).sum((-2, -1)), (wq * q).sum((-2, -1))


def _patterns(xval: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Best pattern for each 8 elements at the group scale `scale` (G,): returns (G, 4)."""
    g = xval.shape[0]
    return _nearest(xval.reshape(g * 4, 8), w.reshape(g * 4, 8), scale.repeat_interleave(4)).reshape(g, 4)


def quantize_iq2_xxs(x: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """Encode super-blocks x (n, 256) with importance qw (n, 256); returns (n, 66) uint8."""
    n = x.shape[0]
    g = n * 8
    sigma2 = x.square().mean(-1, keepdim=True)
    w = (qw * (sigma2 + x.square()).sqrt()).reshape(g, 4, 8)
    w_search = w.sqrt()
    xs = x.reshape(g, 4, 8)
    neg = xs < 0
    xval = xs.abs()
    # an odd count of minus signs cannot be stored: give the least important element the wrong sign
    odd = neg.sum(-1) % 2 == 1
    least = (w * xs.square()).argmin(-1, keepdim=True)
    flip = torch.zeros_like(neg).scatter_(-1, least, True) & odd.unsqueeze(-1)
    xval = torch.where(flip, -xval, xval)
    neg ^= flip

    empty = xval.reshape(g, 32).amax(-1) < GROUP_MAX_EPS
    # only a starting point for the scale search: the nudging sweeps ggml runs here cost a third of the
    # time and, measured, do not lower the final error
    scale0, _ = fit_scale(xval.reshape(g, 32), w.reshape(g, 32), 4, sweeps=0)
    eff_max = 3 * scale0  # ggml: the largest of the 3 levels, from a 5-level fit
    empty |= eff_max <= 0
    eff_max = torch.where(empty, torch.ones_like(eff_max), eff_max)

    # scale search: keep the candidate with the best least-squares fit (Σwxq)²/Σwq², first one on ties
    best = torch.zeros_like(scale0)
    scale = scale0.clone()
    for c in _CANDIDATES:
        sxq, sqq = _fit(xval, w, _patterns(xval, w_search, eff_max / c))
        fit = torch.where(sqq > 0, sxq * sxq / torch.where(sqq > 0, sqq, torch.ones_like(sqq)), torch.zeros_like(sqq))
        better = fit > best
        best = torch.where(better, fit, best)
        scale = torch.where(better, sxq / torch.where(sqq > 0, sqq, torch.ones_like(sqq)), scale)
    # refit once more with the patterns at the chosen scale
    positive = (scale > 0) & ~empty
    sxq, sqq = _fit(xval, w, _patterns(xval, w_search, torch.where(positive, scale, torch.ones_like(scale))))
    refit = positive & (sqq > 0)
    scale = torch.where(refit, sxq / torch.where(sqq > 0, sqq, torch.ones_like(sqq)), scale)
    # a negative scale is a positive one with every sign flipped (parity stays even: 8 flips)
    negative = scale < 0
    scale = torch.where(empty, torch.zeros_like(scale), scale.abs())
    neg ^= negative[:, None, None]
    xval = torch.where(negative[:, None, None], -xval, xval)

    # the 8 group scales become d·(2l+1), l in 0..15, with d = max/31 stored as fp16
    scale = scale.reshape(n, 8)
    top = scale.amax(-1, keepdim=True)
    d = top / 31
    inv = torch.where(top > 0, 1 / torch.where(top > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    ls = (0.5 * (inv * scale - 1)).round_().clamp_(0, 15)
    d16 = d.half()
    decoded = d16.float() * (2 * ls + 1)  # the group scale the decoder will use
    idx = _patterns(xval, w_search, decoded.reshape(g))

    signs = (neg[..., :7].long() << torch.arange(7, device=x.device)).sum(-1)  # (g, 4): 7 bits each
    aux = (signs << (7 * torch.arange(4, device=x.device))).sum(-1) | (ls.reshape(g).long() << 28)
    aux_bytes = (aux.unsqueeze(-1) >> (8 * torch.arange(4, device=x.device))) & 0xFF
    groups = torch.cat([idx, aux_bytes], dim=-1).to(torch.uint8).reshape(n, 64)
    # an all-zero super-block is stored as zeros: d = 0 decodes to 0 whatever the patterns are
    groups = torch.where(top > 0, groups, torch.zeros_like(groups))
    return torch.cat([d16.view(torch.uint8), groups], dim=1)
