"""V4.1's CSA2 compressor (V4.1's reference `Compressor`, and what `Attention` does with its latent).

Only the kv-source layers compress (2, 8, 14 at ratio 2; 20 at ratio 1). From the tokens' projections
kv_t = W_kv x_t and, at ratio 2, s_t = W_gate x_t (float32, the caller's `project`):

- ratio 1: latent_t = RMSNorm(kv_t), one per token;
- ratio 2: group g = tokens {2g, 2g + 1}: latent_g[c] = sum_t softmax_t(s_t[c]) kv_t[c] (a softmax per
  channel over the group's 2 slots), then RMSNorm. No overlap with the previous group, no position
  bias (V4's ratio 4 had both): V4's pooling (`ops.compress`) with a zero bias and no overlap. A group
  is pooled when its last token arrives; the tokens of an unfinished group wait in the frontier,
  2 slots x (kv, score), score -inf where empty (`new_frontier`), carried by the caller between calls.

Each latent then gives, rotated at its group's first position g * r with the layer's RoPE
(compress_rope_theta with YaRN: `config.yarn_inv_freq`):
- its index key: RMSNorm_k(W_k latent) (before the latent is rotated), RoPE on its last rope dims, then
  FP4 e2m1 with a power-of-two scale per 32 (`ops.fp4_round`); no Hadamard rotation (V4 had one);
- its main row: the latent with RoPE on its last rope dims, then FP4 e2m1 over every dim (RoPE tail
  included) per 16 with an e4m3 scale e4m3(amax / 6) (`ops.fp4_round(..., 16, e4m3_scale=True)`).
Everything is float32; the FP4 fake-quants are the only roundings.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.weights import FLOAT32
from dwarfstar.model.numerics import FP4_BLOCK, rope_angles
from dwarfstar.model.state import CompressorSpec

POOLED_RATIO = 2  # the ratio that pools; ratio 1 keeps one row per token
ROW_FP4_BLOCK = 16  # main rows: e2m1 per 16 with an e4m3 scale (index keys: per 32, power of two)


class Frontier(NamedTuple):
    """The ratio-2 group in progress: kv [2, width], score [2, width] (-inf in an empty slot)."""

    kv: torch.Tensor
    score: torch.Tensor


class Compressed(NamedTuple):
    """One call's finished groups (from group `first` on) and the frontier after it."""

    rows: torch.Tensor  # [G, width] main rows, rotated and FP4-rounded
    index_keys: torch.Tensor  # [G, index_dim] rotated and FP4-rounded
    first: int  # group index of rows[0]: start // ratio
    frontier: Frontier | None  # None at ratio 1


def new_frontier(width: int) -> Frontier:
    return Frontier(torch.zeros(POOLED_RATIO, width), torch.full((POOLED_RATIO, width), float("-inf")))


def latents(
    kv: torch.Tensor,
    score: torch.Tensor | None,
    frontier: Frontier | None,
    norm: torch.Tensor,
    start: int,
    eps: float,
) -> tuple[torch.Tensor, Frontier | None]:
    """The RMS-normed latents [G, width] of the groups that tokens start .. start + T - 1 finish, and
    the frontier after them. kv [T, width] the tokens' W_kv projections; ratio 2 also takes their
    score projections [T, width] and the frontier before them, ratio 1 neither (both None)."""
    width = norm.shape[0]
    if kv.dim() != 2 or kv.shape[1] != width:
        raise ValueError(f"compressor kv {tuple(kv.shape)} is not [tokens, {width}]")
    if score is None:
        if frontier is not None:
            raise ValueError("a ratio-1 compressor has no frontier")
        return ops.rms_norm(kv, norm, eps), None
    if frontier is None or score.shape != kv.shape:
        raise ValueError(f"a ratio-2 compressor needs scores {tuple(kv.shape)} and a frontier")
    for part in frontier:
        if tuple(part.shape) != (POOLED_RATIO, width):
            raise ValueError(f"compressor frontier part {tuple(part.shape)} is not [{POOLED_RATIO}, {width}]")
    spec = CompressorSpec("attn", POOLED_RATIO, width)
    no_bias = kv.new_zeros(POOLED_RATIO, width)
    pooled, front_kv, front_score = ops.compress(spec, *frontier, kv, score, no_bias, norm, start, eps)
    return pooled, Frontier(front_kv, front_score)


def _rotate(x: torch.Tensor, groups: torch.Tensor, ratio: int, inv_freq: torch.Tensor) -> torch.Tensor:
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(f"RoPE of {2 * inv_freq.shape[0]} dims on rows of {x.shape[-1]}")
    return ops.apply_rope(x, *rope_angles(groups * ratio, inv_freq))


def index_keys(
    latent: torch.Tensor,
    groups: torch.Tensor,
    ratio: int,
    w_k: Any,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    products: ops.Multiplies = FLOAT32,
) -> torch.Tensor:
    """Index keys [G, index_dim] of latents [G, width] (groups [G] their indices): RMSNorm_k(W_k latent),
    rotated at g * ratio, FP4 (e2m1, power-of-two scale per 32). w_k [index_dim, width] as `products`
    hold it (float32 by default; the cpu backend's file blocks), k_norm [index_dim]."""
    if len(w_k.shape) != 2 or w_k.shape[1] != latent.shape[-1] or tuple(k_norm.shape) != (w_k.shape[0],):
        shapes = f"{tuple(w_k.shape)} / k_norm {tuple(k_norm.shape)}"
        raise ValueError(f"index W_k {shapes} do not fit latents of {latent.shape[-1]}")
    keys = ops.rms_norm(products.linear(latent, w_k), k_norm, eps)
    return ops.fp4_round(_rotate(keys, groups, ratio, inv_freq), FP4_BLOCK)


def main_rows(latent: torch.Tensor, groups: torch.Tensor, ratio: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Compressed rows [G, width] of latents [G, width]: rotated at g * ratio, then FP4 over every dim
    (e2m1 per 16 with an e4m3 scale)."""
    return ops.fp4_round(_rotate(latent, groups, ratio, inv_freq), ROW_FP4_BLOCK, e4m3_scale=True)


def compress(
    kv: torch.Tensor,
    score: torch.Tensor | None,
    frontier: Frontier | None,
    norm: torch.Tensor,
    w_k: Any,
    k_norm: torch.Tensor,
    inv_freq: torch.Tensor,
    start: int,
    eps: float,
    products: ops.Multiplies = FLOAT32,
) -> Compressed:
    """A kv-source layer's compressor over tokens start .. start + T - 1 of one sequence (ratio 2 when
    `score` is given, else 1): the main rows and index keys of the groups they finish, and the
    frontier; W_k multiplies through `products` (`index_keys`). Any split of a sequence into calls
    gives the same rows as one call."""
    ratio = 1 if score is None else POOLED_RATIO
    latent, frontier = latents(kv, score, frontier, norm, start, eps)
    first = start // ratio
    if not latent.shape[0]:  # a call inside one group (the block view of the FP4 rounding needs rows)
        return Compressed(latent, latent.new_zeros(0, w_k.shape[0]), first, frontier)
    groups = torch.arange(first, first + latent.shape[0])
    rows = main_rows(latent, groups, ratio, inv_freq)
    return Compressed(rows, index_keys(latent, groups, ratio, w_k, k_norm, eps, inv_freq, products), first, frontier)
