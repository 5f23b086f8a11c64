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
from dwarfstar.gguf.quantize import quantize

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


def test_quantize_equals_gguf_py():
    rng = np.random.default_rng(4)
    # rows at scales from 2^-100 to 2^100, one with a zero block and one with an exact power of two
    x = rng.standard_normal((9, 4 * 32)).astype(np.float32) * np.float32(2.0) ** np.arange(-100, 101, 25)[:, None]
    x[1, 32:64] = 0
    x[2, 5] = 8.0
    ours = quantize(torch.from_numpy(x), MX)
    assert ours.shape == (9, 4 * 17)
    assert np.array_equal(ours, quants.quantize(x, GGMLQuantizationType.MXFP4))


def test_quantize_round_trip_is_nearest():
    x = torch.randn(6, 64)
    raw = quantize(x, MX)
    y = dequantize(raw, MX, x.numel()).reshape(x.shape)
    # with scale s = 2^(floor(log2 amax) - 2), the gaps between E2M1 values are at most 2s (below 6s), so
    # each element is within s of its code, and amax (< 8s) clips to 6s at worst
    s = 2.0 ** (torch.floor(torch.log2(x.reshape(-1, 32).abs().amax(1, keepdim=True))) - 2)
    assert ((y - x).reshape(-1, 32).abs() <= 2 * s).all()
    assert (raw.reshape(-1, 17)[:, 0] != 0xFF).all()


def test_quantize_exponent_range():
    # the largest float32 amax needs exponent 127 - 2 + 127 = 252 (never 0xFF); below 2^-125 it clamps at 0
    extremes = torch.stack([torch.full((32,), 3.4e38), torch.full((32,), 1e-40)])
    raw = quantize(extremes, MX)
    assert (raw[0, 0], raw[1, 0]) == (252, 0)
    assert dequantize(raw, MX, 64)[32:].abs().max() < 1e-38
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(torch.full((1, 32), float("inf")), MX)


def test_quantize_exact_exponent_where_gguf_py_log2_rounds_up():
    # amax one ulp below 2^20: float32 log2 rounds to 20.0, so gguf-py picks exponent 20 - 2; the spec's
    # floor(log2 amax) is 19, whose scale 2^17 clips amax (~8 * 2^17) to 6 * 2^17, as the spec does
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, 0] = np.nextafter(np.float32(2**20), np.float32(0))
    ours, theirs = quantize(torch.from_numpy(x), MX), quants.quantize(x, GGMLQuantizationType.MXFP4)
    assert (ours[0, 0], theirs[0, 0]) == (127 + 19 - 2, 127 + 20 - 2)
    assert dequantize(ours, MX, 32)[0] == 6 * 2.0**17


@pytest.mark.parametrize("largest", [6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5])
def test_fp4_values_reencode_without_loss(largest):
    # values already on an E2M1 grid times 2^(e-127) (the official FP4 experts): whatever the block's
    # largest code, the encoder's exponent reproduces every value exactly
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = grid[grid <= largest]
    gen = torch.Generator().manual_seed(int(largest * 2))
    x = codes[torch.randint(0, len(codes), (8, 32), generator=gen)] * (
        1 - 2 * torch.randint(0, 2, (8, 32), generator=gen)
    )
    x[:, 0] = largest
    x = x * 2.0 ** torch.randint(-20, 20, (8, 1), generator=gen).float()
    assert torch.equal(dequantize(quantize(x, MX), MX, x.numel()).view(8, 32), x)
