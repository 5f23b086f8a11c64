"""Dequantize the official checkpoint's block-scaled FP8 and FP4 weights to float32 (spec §2.9).

* FP8: `float8_e4m3fn` weight [out, in] with one scale per BxB block, scale shape
  [ceil(out/B), ceil(in/B)]; edge blocks are partial. V4's checkpoints use B = 128, V4.1's B = 32
  (its config's `quantization_config.weight_block_size`); the scale's shape says which (`fp8_block`).
* FP4 (routed experts): e2m1 codes packed two per byte, low nibble = even column, stored as int8
  [out, in/2] (or torch's `float4_e2m1fn_x2`), with one scale per 32 input columns: [out, in/32].

Scales are UE8M0 (`float8_e8m0fnu`, a bare power-of-two exponent); a float32 scale tensor (the
DeepSeek V3 `weight_scale_inv` convention, which despite its name multiplies) is used the same way.
"""

from __future__ import annotations

import torch

from dwarfstar.errors import ModelFileError

FP8_BLOCK = 128  # V4's FP8 block; row bands are cut on multiples of it, which every block size divides
FP8_BLOCKS = (FP8_BLOCK, 32)  # V4's, V4.1's
FP4_BLOCK = 32
FP4_PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)

# e2m1 code -> value: bit 3 sign, bits 2-1 exponent, bit 0 mantissa (codes 0/1 are 0 and the subnormal 0.5).
_E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, name: str, block: int | None = None) -> torch.Tensor:
    """Float32 values of a checkpoint weight stored with a block-scale sibling; `name` is for errors,
    `block` the FP8 block size (`dequantize_fp8`)."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale, name, block)
    if weight.dtype in FP4_PACKED_DTYPES:
        return dequantize_fp4(weight, scale, name)
    raise ModelFileError(f"{name} has a block scale but dtype {weight.dtype}; expected FP8 e4m3 or packed FP4")


def fp8_block(shape: tuple[int, ...], scale_shape: tuple[int, ...], name: str) -> int:
    """The block size B of an FP8 weight [out, in] whose scale is [ceil(out/B), ceil(in/B)]; where two
    sizes fit (a weight of at most 32x32: one block either way) they dequantize alike."""
    rows, cols = shape
    for block in FP8_BLOCKS:
        if tuple(scale_shape) == (-(-rows // block), -(-cols // block)):
            return block
    sizes = " or ".join(f"{b}x{b}" for b in FP8_BLOCKS)
    raise ModelFileError(
        f"{name}: FP8 weight {list(shape)} has a {list(scale_shape)} scale, which is no block scale of {sizes}"
    )


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, name: str, block: int | None = None) -> torch.Tensor:
    """`block`: the weight's block size (None: read from the scale's shape); a band of rows [a, b) of a
    weight comes with the scale rows of its blocks and its block size."""
    rows, cols = weight.shape
    block = block or fp8_block(tuple(weight.shape), tuple(scale.shape), name)
    blocks = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != blocks:
        raise ModelFileError(
            f"{name}: FP8 weight {list(weight.shape)} needs a {list(blocks)} block scale, got {list(scale.shape)}"
        )
    # One scale row per band of `block` rows, widened to the columns; banded so the only full-size buffer is the output.
    col_scale = scale.float().repeat_interleave(block, dim=1)[:, :cols]
    out = torch.empty(rows, cols, dtype=torch.float32)
    for band in range(blocks[0]):
        rows_in_band = slice(band * block, (band + 1) * block)
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
