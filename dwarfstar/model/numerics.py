"""Numerics every backend shares: the QAT rounding grids, the RoPE angles, the Hadamard rotation, MoE routing.

What more than one backend computes with, so that each takes it from here rather than from another
backend: the FP8 KV and FP4 indexer rounding constants (spec §9) that the reference, MLX and Triton
code round with, the RoPE angles the reference and Triton's prefill rotate by, and the Hadamard
matrix the reference and Triton's kernels rotate the indexer rows by; and the MoE routing maths (the
reference's router and the Triton router kernel's oracle).

Batch invariance (the reference's, issue 37): `elementwise` computes every element of a tensor by the
same code whatever the tensor's size, which the angles need to be the same bits at a position in a
decode step and in a prefill chunk.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP8_BLOCK = 64  # the KV "FP8" rounding uses one power-of-two scale per 64 nope dims
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_BLOCK = 32
# e2m1 magnitudes and the midpoints between neighbours; a tie goes to the even code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_GRID[:-1], E2M1_GRID[1:], strict=True))


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x), each element computed by the same code wherever it sits in x. A vectorised torch loop
    leaves a tensor's last few elements (and, threaded, each thread's last few) to its scalar code,
    whose sigmoid, silu, softplus... round otherwise than the vector code: which elements those are
    depends on the tensor's size, so a row's values would depend on the rows beside it. Laid two
    apart, the elements go through the scalar loop, every one of them."""
    spread = x.new_empty(*x.shape, 2)
    spread[..., 0] = x
    return fn(spread[..., 0])


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of p * freq per interleaved pair, shape [T, rope_dim / 2].

    Angles are formed in float64: at million-token positions a float32 product loses whole radians.
    """
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return elementwise(torch.cos, angles).float(), elementwise(torch.sin, angles).float()


@functools.cache
def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester (natural order) Walsh-Hadamard matrix scaled to be orthonormal."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def route(
    logits: torch.Tensor,
    k: int,
    route_scale: float,
    bias: torch.Tensor | None,
    fixed: torch.Tensor | None,
    image: torch.Tensor | None = None,
    image_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts and their weights: (ids [T, k], weights [T, k]).

    Scores are sqrt(softplus(logit)). The bias only steers selection; hash layers take the ids from
    the token table (`fixed`) instead. Rows where `image` [T] (bool) is set (image positions) select
    by score + `image_bias` in either kind of layer. Weights are the un-biased scores of the chosen
    experts, renormalised and multiplied by the routed scale.
    """
    scores = elementwise(F.softplus, logits).sqrt()
    ids = fixed if fixed is not None else (scores + bias).topk(k, dim=-1).indices
    if image is not None:
        ids = torch.where(image[:, None], (scores + image_bias).topk(k, dim=-1).indices, ids)
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * route_scale
