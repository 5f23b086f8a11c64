"""Encoders from float tensors to raw ggml bytes: F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS and MXFP4.

The output is what `GGUFWriter.write_tensor` takes. The float and Q8_0 encoders are bit-identical to
ggml's reference (as mirrored by gguf-py 0.19.0's `gguf.quants.quantize`), so a file we write holds exactly
the bytes llama.cpp's `convert_hf_to_gguf.py` would have written for the same weights. The K-quants and
IQ2_XXS follow ggml's searches (quant_k.py, quant_iq2.py); MXFP4 the OCP MX spec (quant_mxfp4.py).

`importance` is the optional imatrix: per input column, how much that column's activations weigh
(their mean square over calibration text). The block types then minimise the error where it matters
to the matmul output rather than the plain weight error.
"""

from __future__ import annotations

import numpy as np
import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.quant_iq2 import quantize_iq2_xxs
from dwarfstar.gguf.quant_k import quantize_q2_k, quantize_q4_k
from dwarfstar.gguf.quant_mxfp4 import quantize_mxfp4


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


def _q8_0_weighted(blocks: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Q8_0 that minimises the importance-weighted error: a few scales around amax/127 (including
    ggml's own, so it never does worse), each refitted by weighted least squares and checked after the
    fp16 rounding of d that the decoder will see."""
    amax = blocks.abs().amax(dim=1, keepdim=True)
    safe = torch.where(amax == 0, torch.ones_like(amax), amax)
    best_err = best_d = None
    for levels in (127.0, 126.0, 126.5, 127.25, 127.5):
        q = (blocks * (levels / safe)).round_().clamp_(-127, 127)
        if levels != 127.0:  # least-squares d for these levels
            wq = w * q
            den = (wq * q).sum(1, keepdim=True)
            d = torch.where(den > 0, (wq * blocks).sum(1, keepdim=True) / torch.where(den > 0, den, 1.0), 0.0)
        else:
            d = amax / 127
        d = d.half().float()
        q = (blocks / torch.where(d == 0, torch.ones_like(d), d)).round_().clamp_(-127, 127)
        err = ((blocks - d * q).square_() * w).sum(1, keepdim=True)
        if best_err is None:
            best_err, best_d = err, d
        else:
            better = err < best_err
            best_err, best_d = torch.where(better, err, best_err), torch.where(better, d, best_d)
    q = (blocks / torch.where(best_d == 0, torch.ones_like(best_d), best_d)).round_().clamp_(-127, 127)
    return torch.cat([best_d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)


# Elements per call of a block encoder: large enough that torch's per-op overhead vanishes, small
# enough that the searches' intermediates (up to ~40 floats per element) stay in cache.
_CHUNK = {
    GGMLType.Q8_0: 1 << 20,
    GGMLType.Q4_K: 1 << 18,
    GGMLType.Q2_K: 1 << 18,
    GGMLType.IQ2_XXS: 1 << 17,
    GGMLType.MXFP4: 1 << 18,
}
_BLOCK_ENCODERS = {
    GGMLType.Q8_0: lambda x, w: _q8_0(x) if w is None else _q8_0_weighted(x, w),
    GGMLType.Q4_K: quantize_q4_k,
    GGMLType.Q2_K: quantize_q2_k,
    GGMLType.IQ2_XXS: quantize_iq2_xxs,
    GGMLType.MXFP4: quantize_mxfp4,
}


def _importance_rows(importance: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance as rows (m, row), index of the importance row for each of the tensor's rows).

    The importance broadcasts against the tensor (e.g. (n_expert, 1, in) for experts (n_expert, out, in));
    indexing rows instead of expanding keeps a Flash expert tensor from needing a second 8 GB copy.
    """
    imp = importance.detach().to(device="cpu", dtype=torch.float32)
    if imp.shape[-1] != shape[-1] or not torch.isfinite(imp).all() or (imp < 0).any():
        raise ValueError(f"importance must be finite, non-negative and broadcast to {list(shape)}")
    rows = imp.reshape(-1, shape[-1])
    # a row with no signal at all (an expert no calibration token reached) weighs every column alike
    rows = torch.where(rows.sum(-1, keepdim=True) > 0, rows, torch.ones_like(rows))
    try:
        index = torch.arange(rows.shape[0]).reshape(imp.shape[:-1]).expand(shape[:-1]).reshape(-1)
    except RuntimeError as exc:
        raise ValueError(f"importance of shape {list(imp.shape)} does not broadcast to {list(shape)}") from exc
    return rows, index


def quantize(values: torch.Tensor, ggml_type: GGMLType, importance: torch.Tensor | None = None) -> np.ndarray:
    """Encode `values` as `ggml_type`; returns uint8 of shape (*values.shape[:-1], bytes_per_row).

    Rows (the last axis, ggml's ne0) must be a whole number of blocks. `importance` (per column,
    broadcastable to `values`) steers the block types; float types ignore it. IQ2_XXS cannot work
    without one: it then uses each slab's column energy Σ x² over the rows (ds4's fallback).
    """
    ggml_type = GGMLType(ggml_type)
    if ggml_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *_BLOCK_ENCODERS):
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
        if importance is None and ggml_type == GGMLType.IQ2_XXS:
            importance = x.square().sum(-2, keepdim=True) if x.dim() > 1 else x.square()
        out = _encode_blocks(x, ggml_type, importance)
    return out.reshape(*values.shape[:-1], row // block * size).numpy()


def _encode_blocks(x: torch.Tensor, ggml_type: GGMLType, importance: torch.Tensor | None) -> torch.Tensor:
    """All blocks of x, a chunk of rows at a time; returns (n_blocks, block_bytes)."""
    block, size = BLOCK_GEOMETRY[ggml_type]
    encode = _BLOCK_ENCODERS[ggml_type]
    rows = x.reshape(-1, x.shape[-1])
    if importance is not None:
        imp_rows, imp_index = _importance_rows(importance, x.shape)
    out = torch.empty(rows.numel() // block, size, dtype=torch.uint8)
    step = max(1, _CHUNK[ggml_type] // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        w = None if importance is None else imp_rows[imp_index[start : start + step]].reshape(-1, block)
        first = start * (rows.shape[1] // block)
        out[first : first + chunk.numel() // block] = encode(chunk.reshape(-1, block), w)
    return out
