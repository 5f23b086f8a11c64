"""Block decoding inside Triton against the torch dequantizers (bit-exact against gguf-py)."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import quant_blocks as qb
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize

QUANT = [T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS]


@pytest.mark.parametrize("ggml_type", QUANT)
def test_quant_rows_decode_bit_exact(ggml_type, quant_blocks, device):
    k = 512
    blocks = quant_blocks(ggml_type, 6 * k // (32 if ggml_type == T.Q8_0 else 256), seed=int(ggml_type))
    data = torch.from_numpy(blocks).reshape(6, -1).to(device)
    ids = torch.tensor([5, 0, 3, 3], dtype=torch.int32, device=device)
    got = qb.gather_rows(data, ggml_type, k, ids, copies=2)
    want = qb.reference(data, ggml_type, k, ids, copies=2)
    assert got.shape == (4, 2, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0])
def test_rows_ending_inside_a_tile(ggml_type, device):
    """K = 96 is a partial 256-column tile (three Q8_0 blocks of 32): the tail reads nothing past the row."""
    k = 96
    values = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    data = torch.from_numpy(quantize(values, ggml_type)).reshape(5, -1).to(device)
    ids = torch.arange(5, dtype=torch.int32, device=device)
    got = qb.gather_rows(data, ggml_type, k, ids)
    assert torch.equal(got, qb.reference(data, ggml_type, k, ids))
