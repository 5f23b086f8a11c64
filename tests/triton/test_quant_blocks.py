"""Block decoding inside Triton against the torch dequantizers (bit-exact against gguf-py), and the
aligned layout the weights are repacked into at upload."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import quant_blocks as qb
from dwarfstar.backends.triton.weights import QWeight, random_qweight, repack, unpack
from dwarfstar.gguf.constants import BLOCK_GEOMETRY
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.dequant import MXFP4ScaleError
from dwarfstar.gguf.quantize import quantize

QUANT = [T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS, T.MXFP4]
FLOAT = [T.F32, T.F16, T.BF16]


def gguf_rows(ggml_type, rows, k, quant_blocks, seed) -> torch.Tensor:
    """uint8 [rows, blocks * size] as a GGUF file stores them."""
    if ggml_type in QUANT:
        blocks = quant_blocks(ggml_type, rows * k // BLOCK_GEOMETRY[ggml_type][0], seed=seed)
        return torch.from_numpy(blocks).reshape(rows, -1)
    values = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    return torch.from_numpy(quantize(values, ggml_type)).reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", QUANT + FLOAT)
def test_repacked_rows_decode_bit_exact(ggml_type, quant_blocks, device):
    k = 512
    data = repack(gguf_rows(ggml_type, 6, k, quant_blocks, seed=int(ggml_type)), ggml_type, k).to(device)
    ids = torch.tensor([5, 0, 3, 3], dtype=torch.int32, device=device)
    got = qb.gather_rows(data, ggml_type, k, ids, copies=2)
    want = qb.reference(data, ggml_type, k, ids, copies=2)
    assert got.shape == (4, 2, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("ggml_type", FLOAT + [T.Q8_0, T.MXFP4])
def test_rows_ending_inside_a_tile(ggml_type, device):
    """K = 96 is a partial 256-column tile (three Q8_0 blocks of 32): the tail reads nothing past the row."""
    k = 96
    values = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    data = repack(torch.from_numpy(quantize(values, ggml_type)).reshape(5, -1), ggml_type, k).to(device)
    ids = torch.arange(5, dtype=torch.int32, device=device)
    got = qb.gather_rows(data, ggml_type, k, ids)
    assert torch.equal(got, qb.reference(data, ggml_type, k, ids))


@pytest.mark.parametrize(
    ("ggml_type", "k"),
    [(T.Q8_0, 96), (T.Q8_0, 512), (T.Q2_K, 512), (T.Q4_K, 256), (T.IQ2_XXS, 768), (T.MXFP4, 96)],
)
def test_aligned_layout_is_a_permutation_of_the_blocks(ggml_type, k, quant_blocks):
    """Q8_0 rows of 96 columns are 102 bytes: padded to 112."""
    raw = gguf_rows(ggml_type, 3, k, quant_blocks, seed=7)
    w = QWeight.from_bytes(raw, ggml_type, (3, k), "cpu")
    assert w.row_bytes % 16 == 0 and w.row_bytes >= raw.shape[1]
    assert torch.equal(w.gguf_blocks(), raw)
    assert torch.equal(unpack(repack(raw, ggml_type, k), ggml_type, k), raw)
    # the payload comes first: the first 16 bytes of a row are quant bytes of its first block
    first = raw[:, : BLOCK_GEOMETRY[ggml_type][1]]
    payload_start = {T.Q8_0: 2, T.Q2_K: 16, T.Q4_K: 16, T.IQ2_XXS: 2, T.MXFP4: 1}[ggml_type]
    assert torch.equal(w.data[:, :16], first[:, payload_start : payload_start + 16])
    assert torch.equal(w.data[:, raw.shape[1] :], torch.zeros_like(w.data[:, raw.shape[1] :]))


def test_mxfp4_nan_exponent_refused_at_upload(quant_blocks):
    raw = torch.from_numpy(quant_blocks(T.MXFP4, 8, seed=3)).reshape(2, -1)
    raw[1, 17 * 2] = 0xFF  # the exponent of row 1's third block
    with pytest.raises(MXFP4ScaleError, match="block 6 "):
        QWeight.from_bytes(raw, T.MXFP4, (2, 128), "cpu")


def test_random_mxfp4_weights_are_finite_and_sized_like_the_float_ones():
    w = random_qweight(T.MXFP4, (64, 512), "cpu", torch.Generator().manual_seed(0))
    values = w.dequantize()
    assert torch.isfinite(values).all() and 0.5 < values.std().item() * 512**0.5 < 2
