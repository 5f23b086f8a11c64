"""MXFP4 encoder (OCP microscaling FP4): per 32 values one power-of-two scale and 32 E2M1 nibbles.

The shared exponent follows the OCP MX spec: scale = 2^(floor(log2 amax) - 2), so amax / scale lies in
[4, 8) and only values above 6 (E2M1's largest) clip. Each element then takes the nearest of the 16
values, ties to the smaller magnitude (the first in the table, as gguf-py's argmin does).

Equal to gguf-py 0.19.0's `quantize` byte for byte except in two corners, where ours is the exact
reading of the spec: gguf-py takes floor(np.log2(amax)) in float32, which rounds up to the next integer
for an amax within a few ulps below a power of two (it then picks a scale twice as large, which there
happens to avoid the spec's clipping of that amax to 6/8 of itself); and it casts
the exponent to uint8 unchecked, which wraps to a huge scale for amax below 2^-125. We take the exponent
exactly (frexp) and clamp it at 0 (those blocks flush to zero). A finite float32 amax gives at most 252,
so we never write 0xFF, E8M0's NaN.
"""

from __future__ import annotations

import torch

from dwarfstar.gguf.dequant import MXFP4_VALUES, mxfp4_half_scales


def quantize_mxfp4(blocks: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks (n, 32) float32 -> MXFP4 bytes (n, 17). The importance is unused: with the scale fixed by
    amax, the nearest value is the best one for any positive weight."""
    del importance
    if not torch.isfinite(blocks).all():
        raise ValueError("MXFP4 cannot encode NaN or infinite values")
    amax = blocks.abs().amax(dim=1, keepdim=True)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    e = torch.where(amax > 0, exp - 1 - 2 + 127, 0).clamp(min=0).to(torch.uint8)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    err = (mxfp4_half_scales(e).unsqueeze(-1) * values - blocks.unsqueeze(-1)).abs()
    q = err.argmin(dim=-1).to(torch.uint8)  # first minimum on ties
    return torch.cat([e, q[:, :16] | (q[:, 16:] << 4)], dim=1)
