"""V4.1's lagged ("single-pass") mHC (V4.1's reference `Block.hc_mixes`).

A sublayer's post weights and combination come from its own input streams, as in V4, but it collapses
its input with the pre weights computed one sublayer earlier: the first sublayer with the one-hot
(1, 0, ..., 0) (`first_pre`), each later one with the previous sublayer's pre, and the output with the
last FFN's pre; there is no learned head collapse (`hc_head`). Per token, with H [n, D] the streams:

    (pre, post, comb) = mix(H; fn, scale, base)       V4's split and Sinkhorn (`ops.hc_mix`)
    o = sublayer(collapse(H, pre_previous))          collapse(H, p) = sum_k p_k H_k
    H = post_k * o + sum_j comb[j, k] H_j            (`ops.hc_post`);  pre_previous = pre

`run_lagged` runs a stack of sublayers in this order (the oracle of the V4.1 forward's ordering).
Everything is float32; norm eps 1e-20 and hc eps 1e-6 in V4.1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from dwarfstar.backends.reference import ops


class HcWeights(NamedTuple):
    """One sublayer's mix weights: fn [(2 + n) * n, n * D], scale [3], base [(2 + n) * n]."""

    fn: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor


class HcConfig(NamedTuple):
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float


def first_pre(tokens: int, n: int) -> torch.Tensor:
    """The pre the first sublayer collapses with: (1, 0, ..., 0) for each token, [T, n]."""
    pre = torch.zeros(tokens, n)
    pre[:, 0] = 1.0
    return pre


def mix(h: torch.Tensor, weights: HcWeights, config: HcConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) of the streams h [T, n, D]."""
    t, n, d = h.shape
    mixes = (2 + n) * n
    if tuple(weights.fn.shape) != (mixes, n * d) or weights.scale.shape != (3,) or weights.base.shape != (mixes,):
        shapes = f"fn {tuple(weights.fn.shape)}, scale {tuple(weights.scale.shape)}, base {tuple(weights.base.shape)}"
        raise ValueError(f"mHC weights {shapes} do not fit {n} streams of {d}")
    return ops.hc_mix(h, *weights, config.sinkhorn_iters, config.hc_eps, config.norm_eps)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k h_k: [T, D] from streams h [T, n, D] and pre [T, n]."""
    if pre.shape != h.shape[:2]:
        raise ValueError(f"collapse weights {tuple(pre.shape)} do not fit streams {tuple(h.shape)}")
    return (pre.unsqueeze(-1) * h).sum(1)


def run_lagged(
    h: torch.Tensor,
    sublayers: Sequence[tuple[HcWeights, Callable[[torch.Tensor], torch.Tensor]]],
    config: HcConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Streams h [T, n, D] through the sublayers in order (attention, FFN, attention, ...), each its
    mix weights and its function of the collapsed input [T, D] (its norm included) -> output [T, D].
    Returns the output collapse [T, D] (with the last sublayer's pre, before the output norm) and the
    final streams."""
    pre = first_pre(h.shape[0], h.shape[1])
    for weights, sublayer in sublayers:
        next_pre, post, comb = mix(h, weights, config)
        h = ops.hc_post(sublayer(collapse(h, pre)), h, post, comb)
        pre = next_pre
    return collapse(h, pre), h
