"""Dequantize the official checkpoint's block-scaled FP8 and FP4 weights to float32 (spec §2.9).

* FP8: `float8_e4m3fn` weight [out, in] with one scale per 128x128 block, scale shape
  [ceil(out/128), ceil(in/128)]; edge blocks are partial.
* FP4 (routed experts): e2m1 codes packed two per byte, low nibble = even column, stored as int8
  [out, in/2] (or torch's `float4_e2m1fn_x2`), with one scale per 32 input columns: [out, in/32].

Scales are UE8M0 (`float8_e8m0fnu`, a bare power-of-two exponent); a float32 scale tensor (the
DeepSeek V3 `weight_scale_inv` convention, which despite its name multiplies) is used the same way.
"""

from __future__ import annotations

import torch

from dwarfstar.errors import ModelFileError

FP8_BLOCK = 128
FP4_BLOCK = 32
FP4_PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)

# e2m1 code -> value: bit 3 sign, bits 2-1 exponent, bit 0 mantissa (codes 0/1 are 0 and the subnormal 0.5).
_E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """Float32 values of a checkpoint weight stored with a block-scale sibling; `name` is for errors."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale, name)
    if weight.dtype in FP4_PACKED_DTYPES:
        return dequantize_fp4(weight, scale, name)
    raise ModelFileError(f"{name} has a block scale but dtype {weight.dtype}; expected FP8 e4m3 or packed FP4")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    rows, cols = weight.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale.shape) != blocks:
        raise ModelFileError(
            f"{name}: FP8 weight {list(weight.shape)} needs a {list(blocks)} block scale, got {list(scale.shape)}"
        )
    # One scale row per 128-row band, widened to the columns; banded so the only full-size buffer is the output.
    col_scale = scale.float().repeat_interleave(FP8_BLOCK, dim=1)[:, :cols]
    out = torch.empty(rows, cols, dtype=torch.float32)
    for band in range(blocks[0]):
        rows_in_band = slice(band * FP8_BLOCK, (band + 1) * FP8_BLOCK)
        torch.mul(weight[rows_in_band].float(), col_scale[band], out=out[rows_in_band])
    return out


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 values of a packed [out, in/2] tensor as float32 [out, in] (low nibble first)."""
    codes = packed.view(torch.uint8).to(torch.int64)
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1)
    return _E2M1_VALUES[pairs].flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % FP4_BLOCK or tuple(scale.shape) != (rows, cols // FP4_BLOCK):
        raise ModelFileError(
            f"{name}: packed FP4 weight {list(packed.shape)} (= {rows}x{cols} values) needs a "
            f"[{rows}, {cols // FP4_BLOCK}] scale, got {list(scale.shape)}"
        )
    values = unpack_fp4(packed)
    return values.mul_(scale.float().repeat_interleave(FP4_BLOCK, dim=1))
