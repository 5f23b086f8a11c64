"""GGUF blocks to MLX affine groups: the exact repacks are bit-exact, the lossy ones are measured.

The KL numbers of the lossy packings are printed (run with -s) and bounded loosely: on random tiny
models they say little about a real checkpoint, and the point is that the loss is measured and
ordered (more bits, less loss), while the exact packing stays at fp32 noise.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from dwarfstar.backends.mlx import repack
from dwarfstar.backends.mlx.parity import packing_kl
from dwarfstar.backends.mlx.weights import AffineMatrix, DenseMatrix, stack_rows
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model
from dwarfstar.quant.recipes import quantize_model

PROMPT = torch.randint(3, 120000, (64,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.IQ2_XXS])
def test_exact_repack_is_bit_exact(quant_blocks, ggml_type):
    rows, cols = 6, 512
    block, _ = BLOCK_GEOMETRY[ggml_type]
    raw = quant_blocks(ggml_type, rows * cols // block, seed=int(ggml_type))
    want = dequantize(raw, ggml_type, rows * cols).view(rows, cols)
    parts = repack.repack_exact(raw, ggml_type, rows, cols)
    got = mx.dequantize(parts.codes, parts.scales, parts.biases, group_size=repack.GROUP, bits=parts.bits)
    assert torch.equal(torch.from_numpy(np.array(got)), want)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_codes_follows_mlx_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=(3, 64))
    ones = mx.ones((3, 2))
    unpacked = mx.dequantize(mx.array(repack.pack_codes(codes, bits)), ones, 0 * ones, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), codes)


def test_exact_packing_matches_reference_and_lossy_ones_lose_in_order(ds4_model):
    report = packing_kl(ds4_model, PROMPT[:32], qat=False)
    for name, diff in report.items():
        print(f"{name:8s} {diff}")
    assert report["exact"].max_rel < 1e-4 and report["exact"].mean_kl < 1e-9
    assert report["exact"].mean_kl < report["affine4"].mean_kl < report["affine2"].mean_kl


@pytest.mark.slow
def test_repacking_kl_on_a_quantized_model(tmp_path):
    """The q2 recipe applied to realistic N(0, 1/fan_in) weights (real quantizers, about 2 minutes)."""
    src, dst = tmp_path / "f32.gguf", tmp_path / "q2.gguf"
    write_synthetic_model(src, TINY_K, seed=0)
    quantize_model(src, dst, "q2")
    report = packing_kl(open_model(dst), PROMPT, qat=True)
    for name, diff in report.items():
        print(f"{name:8s} {diff}")
    assert report["exact"].mean_kl < 1e-9 and report["exact"].top1_agreement == 1.0
    assert report["affine4"].mean_kl < 0.1 and report["affine4"].mean_kl < report["affine2"].mean_kl < 1.0


def test_stacked_rows_multiply_as_their_parts(quant_blocks):
    """A projection group's matrices stacked row-wise give each part's product in their columns, and
    matrices of different packings are refused (they are then multiplied apart)."""
    cols = 64

    def q8(rows: int) -> AffineMatrix:
        raw = quant_blocks(GGMLType.Q8_0, rows * cols // 32, seed=rows)
        return AffineMatrix(repack.repack_exact(raw, GGMLType.Q8_0, rows, cols))

    x = mx.array(torch.randn(2, cols, generator=torch.Generator().manual_seed(0)).numpy())
    for parts in ([q8(3), q8(5)], [DenseMatrix(mx.array(np.arange(4.0 * cols).reshape(4, cols))), DenseMatrix(-x)]):
        want = np.concatenate([np.array(p.matmul(x)) for p in parts], axis=1)
        assert np.array_equal(np.array(stack_rows(parts).matmul(x)), want)
    assert stack_rows([q8(3), DenseMatrix(mx.ones((4, cols)))]) is None
