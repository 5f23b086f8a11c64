"""GGUF quant blocks to MLX affine quantization (`w = scale * q + bias`, group 32), at load.

MLX's affine groups are 32 wide or more. Three ggml types fit exactly:

* Q8_0 (`d * q`, q int8, 32 per block): 8-bit codes `q + 128`, scale `d`, bias `-128 d`.
* Q4_K (`(d sc) q - (dmin m)`, 4-bit q, 32 per sub-block): the same form with scale `d sc` and
  bias `-(dmin m)`, 4-bit codes.
* IQ2_XXS (`db * grid * sign`, grid values {8, 25, 43}, one db per 32): 8-bit codes
  `grid * sign + 43`, scale `db`, bias `-43 db`.

* MXFP4 (`2^(e-128) * v`, v the doubled E2M1 value in -12..12, one e per 32): 8-bit codes `v + 12`,
  scale `2^(e-128)`, bias `-12 * 2^(e-128)`.

All four are bit-exact: every product `scale * code` and the bias are exact in float32 (at most
23 significant bits), so the single rounding of `scale * code + bias`, fused or not, is the one the
reference dequantizer makes. MXFP4 also has MLX's own form (`mxfp4_native`: mode "mxfp4", 4-bit
E2M1 codes and the E8M0 bytes as scales), a reordering of the nibbles at half the exact form's bytes.
Q2_K has 16-wide sub-blocks with their own scale and min, which no 32-wide affine group can hold;
it is dequantized, or requantized with a stated loss (`requantize`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import (
    MXFP4_VALUES,
    _byte_tensor,
    _f16,
    _iq2xxs_tables,
    _q4_k_scale_min,
    _shifts,
    check_mxfp4,
    iq2_xxs_parts,
    mxfp4_half_scales,
)

GROUP = 32
# Elements converted per step: bounds the temporary float32/int copies for Flash-sized tensors.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class AffineParts:
    """Packed codes (uint32 [rows, cols * bits / 32]) with float32 scales and biases [rows, cols / 32];
    in `mode` "mxfp4", E2M1 codes with uint8 E8M0 scales and no biases."""

    codes: mx.array
    scales: mx.array
    biases: mx.array | None
    bits: int
    mode: str = "affine"

    def stacked(self, experts: int) -> AffineParts:
        """The same rows viewed as [experts, rows / experts, ...] for gathered expert products."""
        return self.map(lambda a: a.reshape(experts, a.shape[0] // experts, -1))

    def map(self, f: Callable[[mx.array], mx.array]) -> AffineParts:
        biases = None if self.biases is None else f(self.biases)
        return AffineParts(f(self.codes), f(self.scales), biases, self.bits, self.mode)

    @staticmethod
    def concatenate(parts: list[AffineParts]) -> AffineParts | None:
        """The parts' rows joined in order, or None when their forms differ."""
        if len({(p.bits, p.mode) for p in parts}) > 1:
            return None
        codes, scales = (mx.concatenate([getattr(p, a) for p in parts]) for a in ("codes", "scales"))
        biases = None if parts[0].biases is None else mx.concatenate([p.biases for p in parts])
        return AffineParts(codes, scales, biases, parts[0].bits, parts[0].mode)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes [rows, cols] into uint32 words the way MLX does: least significant bits first."""
    per_word = 32 // bits
    rows, cols = codes.shape
    grouped = codes.astype(np.uint32).reshape(rows, cols // per_word, per_word)
    return (grouped << (bits * np.arange(per_word, dtype=np.uint32))).sum(-1, dtype=np.uint32)


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(b, 0)
    return b[:, 2:].view(torch.int8).int() + 128, d, -128 * d


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # same decoding as dwarfstar.gguf.dequant._q4_k, stopping before the multiply
    n = b.shape[0]
    sc, mn = _q4_k_scale_min(b[:, 4:16])
    q = (b[:, 16:].reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0xF
    return q.reshape(n * 8, 32), (_f16(b, 0) * sc.float()).reshape(-1, 1), -(_f16(b, 2) * mn.float()).reshape(-1, 1)


def _iq2_xxs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the reference decoding (dwarfstar.gguf.dequant), keeping grid * sign as an integer code
    n = b.shape[0]
    offset = int(_iq2xxs_tables()[0].max())  # 43: codes grid * sign + 43 span 0..86
    db, values = iq2_xxs_parts(b)
    db = db.reshape(-1, 1)
    return values.int().reshape(n * 8, 32) + offset, db, -offset * db


def _mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the reference decoding (dwarfstar.gguf.dequant._mxfp4), keeping the doubled value as a code
    check_mxfp4(b)
    n = b.shape[0]
    q = (b[:, 1:].reshape(n, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0xF
    values = torch.tensor(MXFP4_VALUES, dtype=torch.int32)[q.long()].reshape(n, 32)
    half = mxfp4_half_scales(b[:, :1])
    return values + 12, half, -12 * half


# ggml type -> (bits, decoder of (n_blocks, block_bytes) to (codes [groups, 32], scale, bias [groups, 1]))
_EXACT: dict[GGMLType, tuple[int, Callable]] = {
    GGMLType.Q8_0: (8, _q8_0),
    GGMLType.Q4_K: (4, _q4_k),
    GGMLType.IQ2_XXS: (8, _iq2_xxs),
    GGMLType.MXFP4: (8, _mxfp4),
}


def exact_affine(ggml_type: GGMLType) -> bool:
    return GGMLType(ggml_type) in _EXACT


def repack_exact(raw: np.ndarray, ggml_type: GGMLType, rows: int, cols: int) -> AffineParts:
    """Lossless affine form of a [rows, cols] block matrix (Q8_0, Q4_K or IQ2_XXS)."""
    bits, decode = _EXACT[GGMLType(ggml_type)]
    block, size = BLOCK_GEOMETRY[ggml_type]
    data = _byte_tensor(raw).view(rows, cols // block * size)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        chunk = data[start : start + step]
        codes, scale, bias = decode(chunk.reshape(-1, size))
        n = chunk.shape[0]
        parts.append(
            (pack_codes(codes.reshape(n, cols).numpy(), bits), scale.view(n, -1).numpy(), bias.view(n, -1).numpy())
        )
    codes, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    return AffineParts(mx.array(codes), mx.array(scales), mx.array(biases), bits)


def mxfp4_native(raw: np.ndarray, rows: int, cols: int) -> AffineParts:
    """MXFP4 blocks of a [rows, cols] matrix in MLX's mxfp4 form: the same E2M1 nibbles packed 8 a word,
    element i at bits 4 (i % 8) (ggml's byte j holds elements j and j + 16), the exponent bytes as scales."""
    blocks = _byte_tensor(raw).view(-1, 17)
    check_mxfp4(blocks)
    nibbles = (blocks[:, 1:].reshape(-1, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0xF  # [n, 2, 16]
    codes = pack_codes(nibbles.reshape(rows, cols).numpy(), 4)
    return AffineParts(mx.array(codes), mx.array(blocks[:, 0].reshape(rows, -1).numpy()), None, 4, "mxfp4")


def requantize(values: Callable[[int, int], torch.Tensor], rows: int, cols: int, bits: int) -> AffineParts:
    """MLX's own affine quantization of dequantized values (lossy), `values(start, stop)` giving row bands."""
    parts = []
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        band = mx.array(values(start, min(rows, start + step)).numpy())
        parts.append(mx.quantize(band, group_size=GROUP, bits=bits))
    codes, scales, biases = (mx.concatenate(p) for p in zip(*parts, strict=True))
    return AffineParts(codes, scales, biases, bits)
