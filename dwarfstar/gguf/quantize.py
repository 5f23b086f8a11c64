"""Encoders from float tensors to raw ggml bytes: F32, F16, BF16 and Q8_0.

The output is what `GGUFWriter.write_tensor` takes. Every encoder is bit-identical to ggml's reference
(as mirrored by gguf-py 0.19.0's `gguf.quants.quantize`), so a file we write holds exactly the bytes
llama.cpp's `convert_hf_to_gguf.py` would have written for the same weights.
"""

from __future__ import annotations

import numpy as np
import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16: round to nearest even, NaN kept NaN (quieted, sign and payload top bits kept).

    torch's own float->bfloat16 cast replaces every NaN with one canonical NaN, so we do it on the bits.
    """
    n = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n + 0x7FFF + ((n >> 16) & 1)) >> 16
    quiet_nan = (n >> 16) | 0x40
    return torch.where(nan, quiet_nan, rounded).to(torch.int32).to(torch.int16)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """ggml quantize_row_q8_0_ref: d = amax/127, q = round(x/d) half away from zero, d stored as fp16.

    Like ggml, q uses the float32 reciprocal of the unrounded d, and rounding is half *away from zero*
    (torch.round rounds half to even, so it is spelled out the way gguf-py's np_roundf does it).
    """
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    scaled = blocks * inv
    a = scaled.abs()
    whole = a.floor()
    q = scaled.sign() * (whole + (2 * (a - whole)).floor())
    d_bytes = d.half().view(torch.uint8)  # (n, 2), little-endian fp16
    q_bytes = q.to(torch.int8).view(torch.uint8)  # (n, 32)
    return torch.cat([d_bytes, q_bytes], dim=1)


def quantize(values: torch.Tensor, ggml_type: GGMLType) -> np.ndarray:
    """Encode `values` as `ggml_type`; returns uint8 of shape (*values.shape[:-1], bytes_per_row).

    Rows (the last axis, ggml's ne0) must be a whole number of blocks. K-quants and IQ types are not here.
    """
    ggml_type = GGMLType(ggml_type)
    if ggml_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0):
        raise NotImplementedError(f"quantizing to {ggml_type.name} is not implemented")
    if values.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor; give it at least one axis")
    block, size = BLOCK_GEOMETRY[ggml_type]
    row = values.shape[-1]
    if row % block:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block} elements, got {row}")
    x = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if ggml_type == GGMLType.F32:
        out = x.clone().view(torch.uint8)  # a copy: never alias the caller's tensor
    elif ggml_type == GGMLType.F16:
        out = x.half().view(torch.uint8)
    elif ggml_type == GGMLType.BF16:
        out = _bf16_bits(x).view(torch.uint8)
    else:
        out = _q8_0(x.reshape(-1, block))
    return out.reshape(*values.shape[:-1], row // block * size).numpy()
