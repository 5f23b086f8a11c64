"""V4.1's window rows (V4.1's reference `Attention._window_kv`).

Every layer (and every DSpark stage): kv_t = RMSNorm_kv(W_kv x_t) (the caller's projection), its last
rope dims rotated at position t with the layer's RoPE (`config.yarn_inv_freq`: rope_theta without
YaRN at ratio 0, compress_rope_theta with YaRN otherwise), then FP8 e4m3 fake-quant over the whole
row, the RoPE tail included, with a power-of-two scale per 32 values (V4 rounds only the nope dims,
per 64: `ops.fp8_round_nope`). Float32 otherwise.

`window_keys` gives each query of a call its window: the rows of positions p - window + 1 .. p, from
the last window - 1 rows kept since the previous call and the call's own.
"""

from __future__ import annotations

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.model.numerics import rope_angles

WINDOW_FP8_BLOCK = 32


def window_rows(
    kv: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
) -> torch.Tensor:
    """Window rows [T, D] of the tokens' projections kv [T, D] at positions [T]; norm [D]."""
    if kv.dim() != 2 or norm.shape != kv.shape[1:] or positions.shape != kv.shape[:1]:
        raise ValueError(
            f"window rows: kv {tuple(kv.shape)}, norm {tuple(norm.shape)}, positions {tuple(positions.shape)}"
        )
    if 2 * inv_freq.shape[0] > kv.shape[1]:
        raise ValueError(f"RoPE of {2 * inv_freq.shape[0]} dims on rows of {kv.shape[1]}")
    rotated = ops.apply_rope(ops.rms_norm(kv, norm, eps), *rope_angles(positions, inv_freq))
    return ops.fp8_round(rotated, WINDOW_FP8_BLOCK)


def window_keys(
    kept: torch.Tensor,
    new: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    at: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Each query's window keys [T, window, D] (positions p - window + 1 .. p, oldest first) and their
    mask [T, window] (positions before the sequence's start masked), from the rows `kept` [<= window - 1,
    D] of the positions before the call and its rows `new` [T, D] at positions [T]; and the last
    window - 1 rows, to keep. `at`: `window_index`'s (index, mask) for these positions and kept rows,
    where the caller has them (built otherwise)."""
    rows = torch.cat((kept, new))
    index, mask = window_index(positions, int(positions[0]) - kept.shape[0], window) if at is None else at
    keep = rows[rows.shape[0] - min(rows.shape[0], window - 1) :]
    if new.shape[0] == 1 and kept.shape[0] == window - 1:  # a decode step past the first window: its rows, in order
        return (rows[None], mask), keep
    return (rows[index], mask), keep


def window_index(positions: torch.Tensor, first: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `window_keys` reads each query's window: indices [T, window] into the rows of positions
    first.. (kept, then new) and the mask [T, window] of the positions before the sequence's start.
    It depends on the positions and the kept rows' count only, so a backend builds it once per call."""
    at = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)[None, :]
    return (at - first).clamp(min=0), at >= 0
