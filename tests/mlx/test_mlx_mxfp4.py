"""MXFP4 experts on the MLX backend: the exact affine repack and MLX's own mxfp4 form decode to the
reference's values, and a tiny ds4-mxfp4 model's logits match the reference's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from dwarfstar.backends.mlx import repack
from dwarfstar.backends.mlx.parity import packing_kl
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import MXFP4ScaleError, dequantize
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model

MX = GGMLType.MXFP4
ROWS, COLS = 6, 128


@pytest.fixture
def blocks(quant_blocks) -> np.ndarray:
    raw = quant_blocks(MX, ROWS * COLS // 32, seed=39)
    raw[:4, 0] = [0, 1, 2, 200]  # subnormal half-scales and a large one
    return raw


def test_exact_repack_is_bit_exact(blocks):
    want = dequantize(blocks, MX, ROWS * COLS).view(ROWS, COLS)
    p = repack.repack_exact(blocks, MX, ROWS, COLS)
    got = mx.dequantize(p.codes, p.scales, p.biases, group_size=repack.GROUP, bits=p.bits)
    assert torch.equal(torch.from_numpy(np.array(got)), want)


def test_native_form_is_bit_exact(blocks):
    want = dequantize(blocks, MX, ROWS * COLS).view(ROWS, COLS)
    p = repack.mxfp4_native(blocks, ROWS, COLS)
    got = mx.dequantize(p.codes, p.scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert torch.equal(torch.from_numpy(np.array(got)), want)


def test_nan_exponent_is_refused_in_both_forms(blocks):
    blocks[7, 0] = 0xFF
    with pytest.raises(MXFP4ScaleError):
        repack.repack_exact(blocks, MX, ROWS, COLS)
    with pytest.raises(MXFP4ScaleError):
        repack.mxfp4_native(blocks, ROWS, COLS)


def test_mxfp4_model_matches_reference(tmp_path):
    path = tmp_path / "tiny-mxfp4.gguf"
    args = TINY.with_(n_layers=2, compress_ratios=TINY.compress_ratios[:2], n_hash_layers=1)
    write_synthetic_model(path, args, "ds4-mxfp4")
    tokens = torch.randint(3, 120000, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    report = packing_kl(open_model(path), tokens, packings=("exact", "affine4"), qat=False)
    for packing, diff in report.items():  # affine4 takes MLX's mxfp4 products for the experts
        assert diff.max_rel < 1e-4 and diff.mean_kl < 1e-9 and diff.top1_agreement == 1.0, (packing, diff)
