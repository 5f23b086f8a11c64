"""Vectorised torch dequantizers for the ggml types DwarfStar reads (spec §4.5).

Each function views the bytes as (n_blocks, bytes_per_block) and decodes all blocks at once.
The results are bit-exact against `gguf.quants.dequantize` (gguf-py 0.19.0, our numerical oracle): every
float op is done in float32 in the same order as gguf-py. The scale products (fp16 d times a small integer
scale) are exact in float32, so the roundings that matter are the last ones: K-quants compute
`(d*sc)*q - (dmin*m)` as a rounded multiply followed by a rounded subtract, never a fused multiply-add
(which rounds once and changes the last bit), and nothing is accumulated in float16.

Block layouts are little-endian; like ggml we assume a little-endian host (x86-64, arm64).
"""

from __future__ import annotations

import warnings
from functools import cache

import numpy as np
import torch

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType

_U8 = torch.uint8


def _byte_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Flat uint8 tensor sharing memory with `raw`.

    Arrays from the reader are views of a read-only mmap. torch warns that it cannot mark such a tensor
    read-only; we only ever read from it (every op below allocates its result), so the warning is silenced
    rather than paying for a copy of a multi-GB expert tensor.
    """
    if isinstance(raw, torch.Tensor):
        flat = raw.reshape(-1).view(_U8)
        # viewing bytes as wider types needs a storage offset that is a multiple of their size
        return flat.clone() if flat.storage_offset() % 4 else flat
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as a float32 column (n_blocks, 1)."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _shifts(*bits: int, dtype: torch.dtype = _U8) -> torch.Tensor:
    return torch.tensor(bits, dtype=dtype)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d, int8 q[32]; x = q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # block: u8 scales[16] (low nibble scale, high nibble min, one per 16 elements), u8 qs[64], f16 d, f16 dmin.
    # qs[32h + l] holds elements 128h + 32s + l at bit shift 2s, so sub-block j = 8h + 2s + (l >= 16).
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(b, 80) * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _q4_k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 bytes hold eight 6-bit scales and eight 6-bit mins.

    bytes 0-3: low 6 bits = scale 0-3, top 2 bits = high bits of scale 4-7
    bytes 4-7: low 6 bits = min 0-3,   top 2 bits = high bits of min 4-7
    bytes 8-11: low nibble = low 4 bits of scale 4-7, high nibble = low 4 bits of min 4-7
    """
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d, f16 dmin, u8 scales[12], u8 qs[128]; sub-blocks 2p and 2p+1 share qs[32p:32p+32]
    # (low nibble, then high nibble); x = (d*sc)*q - (dmin*m)
    n = b.shape[0]
    sc, mn = _q4_k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    ml = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    q = (b[:, 16:].reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0xF
    return (dl * q.reshape(n, 8, 32).float() - ml).reshape(n, 256)


@cache
def _iq2xxs_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(grid (256, 8) float32, ksigns (128,) uint8) for IQ2_XXS.

    The 256-entry grid is ggml's `iq2xxs_grid`; rather than paste 2 KB of magic numbers we take it from the
    pinned gguf package (the oracle we test against), which stores it hex-packed and unpacks it in
    `init_grid()`. The sign table needs no data: entry i is the 7 sign bits of i plus an 8th bit that makes
    the number of set bits even (ggml stores only 7 of the 8 signs and infers the last from parity).
    """
    from gguf.quants import IQ2_XXS  # deferred: gguf is only needed once an IQ2_XXS tensor is decoded

    IQ2_XXS.init_grid()
    grid = torch.from_numpy(np.array(IQ2_XXS.grid, dtype=np.float32).reshape(256, 8))
    i = torch.arange(128)
    parity = sum((i >> k) & 1 for k in range(7)) & 1
    ksigns = (i | (parity << 7)).to(_U8)
    return grid, ksigns


@cache
def _iq2xxs_signed_grid() -> torch.Tensor:
    """Every grid row under every sign pattern, (256 * 128, 8) float32: row 128 g + s is grid row g
    signed by ksigns[s]. A block then decodes with one row gather per 8 elements instead of bit
    arithmetic per element (1.7x faster on a Flash expert); the signs are exact, so the values are too."""
    grid, ksigns = _iq2xxs_tables()
    negative = (ksigns.unsqueeze(-1) >> torch.arange(8, dtype=_U8)) & 1
    return (grid[:, None, :] * (1.0 - 2.0 * negative.float())[None]).reshape(-1, 8)


def iq2_xxs_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_XXS blocks (n, 66) as (db (n, 8, 1, 1), signed grid values (n, 8, 4, 8)): x = db * values.

    A block is f16 d, then 8 groups of 8 bytes covering 32 elements each. Bytes 0-3 of a group index
    the grid (8 elements each); bytes 4-7 are a u32 whose bits 0-27 are four 7-bit ksigns indices and
    bits 28-31 a 4-bit scale s; db = d*(0.5+s)*0.25."""
    n = b.shape[0]
    g = b[:, 2:].reshape(n, 8, 8)
    aux = g[..., 4:].contiguous().view(torch.int32).reshape(n, 8)  # the u32 (little-endian), as int32
    db = (_f16(b, 0) * (0.5 + ((aux >> 28) & 0xF).float()) * 0.25).reshape(n, 8, 1, 1)
    sign_idx = (aux.unsqueeze(-1) >> _shifts(0, 7, 14, 21, dtype=torch.int32)) & 0x7F
    rows = g[..., :4].int() * 128 + sign_idx
    return db, torch.nn.functional.embedding(rows, _iq2xxs_signed_grid())


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    db, values = iq2_xxs_parts(b)
    return (db * values).reshape(b.shape[0], 256)


# FP4 E2M1 values doubled (as ggml and gguf-py store them), indexed by nibble: bit 3 is the sign.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_NAN_EXPONENT = 0xFF  # E8M0 reserves it for NaN


class MXFP4ScaleError(ModelFileError):
    """An MXFP4 block whose E8M0 exponent byte is 0xFF, which E8M0 reserves for NaN."""


def check_mxfp4(blocks: torch.Tensor) -> None:
    """Refuse MXFP4 blocks (n, 17) with a NaN exponent, rather than decode them into silent NaNs."""
    bad = (blocks[:, 0] == MXFP4_NAN_EXPONENT).nonzero()
    if bad.numel():
        raise MXFP4ScaleError(
            f"MXFP4 block {int(bad[0, 0])} (of {blocks.shape[0]}) has exponent byte 0xFF, which is NaN in E8M0 "
            f"({bad.numel()} such blocks): the file is damaged or was not written as MXFP4"
        )


def mxfp4_half_scales(e: torch.Tensor) -> torch.Tensor:
    """2^(e-128) as float32 for E8M0 exponent bytes `e` (ggml's e8m0_to_fp32_half): half the block scale,
    since the value table is doubled. Exponents 0 and 1 give the float32 subnormals 2^-128 and 2^-127."""
    bits = torch.where(e < 2, 0x00200000 << e.int(), (e.int() - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # block: u8 e, u8 qs[16]; element j is qs[j] & 0xF, element j + 16 is qs[j] >> 4; x = 2^(e-128) * 2*fp4
    check_mxfp4(b)
    n = b.shape[0]
    q = (b[:, 1:].reshape(n, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0xF
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[q.long()].reshape(n, 32)
    return mxfp4_half_scales(b[:, :1]) * values


_BLOCK_DECODERS = {
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.IQ2_XXS: _iq2_xxs,
    GGMLType.MXFP4: _mxfp4,
}


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: GGMLType, n_elements: int) -> torch.Tensor:
    """Decode `n_elements` values of `ggml_type` from raw ggml bytes into a new 1-D tensor.

    float32 for float and quant types, int32 for I32 and I8. The result never aliases `raw` (which may be a
    read-only mmap), so callers may modify it in place.
    """
    ggml_type = GGMLType(ggml_type)
    if ggml_type not in BLOCK_GEOMETRY:
        raise ValueError(f"cannot dequantize ggml type {ggml_type.name}")
    block, size = BLOCK_GEOMETRY[ggml_type]
    if n_elements % block:
        raise ValueError(f"{n_elements} elements is not a whole number of {ggml_type.name} blocks of {block}")
    data = _byte_tensor(raw)
    expected = n_elements // block * size
    if data.numel() != expected:
        raise ValueError(f"{ggml_type.name}: {n_elements} elements need {expected} bytes, got {data.numel()}")
    if ggml_type == GGMLType.F32:
        return data.view(torch.float32).clone()
    if ggml_type == GGMLType.I32:
        return data.view(torch.int32).clone()
    if ggml_type == GGMLType.I8:
        return data.view(torch.int8).int()
    if ggml_type == GGMLType.F16:
        # exact for every half except signalling NaNs, which the hardware conversion returns quieted
        return data.view(torch.float16).float()
    if ggml_type == GGMLType.BF16:
        # bf16 is the top half of a float32: shift the bits up, exactly as gguf-py does (keeps NaN payloads)
        return (data.view(torch.int16).int() << 16).view(torch.float32)
    return _BLOCK_DECODERS[ggml_type](data.view(-1, size)).reshape(-1)
