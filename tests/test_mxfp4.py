"""MXFP4 (ggml type 39) blocks: decoding bit-exact against gguf-py 0.19.0, and NaN exponents refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import MXFP4ScaleError, dequantize

MX = GGMLType.MXFP4


def random_blocks(n_blocks: int, seed: int, exponents: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(0, 255, size=n_blocks) if exponents is None else exponents
    return raw


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    assert np.array_equal(ours.numpy().view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32))


def test_geometry_matches_gguf():
    assert int(MX) == int(GGMLQuantizationType.MXFP4)
    assert BLOCK_GEOMETRY[MX] == quants.GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4]


def test_every_exponent_bit_exact():
    # all 255 finite exponents (subnormal half-scales at 0 and 1, 2^126 at 254), each with random nibbles
    raw = random_blocks(255, seed=1, exponents=np.arange(255))
    ours = dequantize(raw, MX, 255 * 32).reshape(255, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow note for those infinities
        ref = quants.dequantize(raw, GGMLQuantizationType.MXFP4)
    assert_bits_equal(ours, ref.reshape(255, 32))
    assert torch.isfinite(ours[:253]).all()  # 6 * 2^(e-127) overflows float32 from e = 253, as in gguf-py


@pytest.mark.parametrize("blocks_per_row", [1, 3, 5])
def test_multi_block_rows_bit_exact(blocks_per_row):
    rows = 7
    raw = random_blocks(rows * blocks_per_row, seed=blocks_per_row).reshape(rows, blocks_per_row * 17)
    ours = dequantize(raw, MX, rows * blocks_per_row * 32).reshape(rows, -1)
    assert_bits_equal(ours, quants.dequantize(raw, GGMLQuantizationType.MXFP4))


def test_nibble_order_low_then_high():
    # byte j holds element j (low nibble) and element j + 16 (high nibble); exponent 127 -> value = fp4 / 1
    raw = np.zeros((1, 17), dtype=np.uint8)
    raw[0, 0] = 127
    raw[0, 1] = 0x72  # element 0: nibble 2 -> 1.0; element 16: nibble 7 -> 6.0
    raw[0, 16] = 0x9F  # element 15: nibble 0xF -> -6.0; element 31: nibble 9 -> -0.5
    x = dequantize(raw, MX, 32)
    assert (x[0], x[16], x[15], x[31]) == (1.0, 6.0, -6.0, -0.5)
    assert x.abs().sum() == 13.5


def test_nan_exponent_is_a_named_error():
    raw = random_blocks(6, seed=9)
    raw[4, 0] = 0xFF
    with pytest.raises(MXFP4ScaleError, match="block 4 .*0xFF.*NaN"):
        dequantize(raw, MX, 6 * 32)
    assert issubclass(MXFP4ScaleError, DwarfStarError)
