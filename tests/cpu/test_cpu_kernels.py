"""The CPU kernels (dwarfstar/backends/cpu/kernels.c) against gguf-py's dequantization and a float64 product.

Each product is checked on the activations the kernel multiplies (the int8 values times their scale),
so what is compared is the weight decoding and the sums, to float32 rounding; the activation
quantization is checked on its own against its definition. Both builds run: the SIMD form (AVX2,
where the machine has it) and the portable C form. Shapes have ragged tails: row counts that are no
multiple of the 16-row blocks the threads share, token counts that are no multiple of the 4 tokens a
chunk is decoded for, nor of the 64-token tiles, and products large enough to run on two threads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from dwarfstar.backends.cpu import matrix, native
from dwarfstar.backends.cpu.matrix import Activations, QMatrix
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import MXFP4ScaleError
from dwarfstar.gguf.quantize import quantize

BLOCK_TYPES = (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.MXFP4)
# (rows, K, tokens): ragged rows and tokens; the last two run on two threads (over 256 KB of weights)
SHAPES = ((1, 256, 1), (17, 512, 3), (37, 768, 6), (5, 256, 70), (300, 1024, 2), (520, 512, 9))


def builds() -> list:
    out = [pytest.param(True, id="portable")]
    simd = native.kernels().ds_simd() > 0
    out.append(pytest.param(False, id="simd", marks=[] if simd else [pytest.mark.skip(reason="no AVX2 here")]))
    return out


@pytest.fixture(params=builds())
def lib(request, monkeypatch):
    """The kernels of one build, as `matrix` calls them."""
    built = native.kernels(request.param)
    monkeypatch.setattr(matrix, "kernels", lambda: built)
    return built


def weights(ggml_type: GGMLType, rows: int, k: int, seed: int) -> tuple[QMatrix, np.ndarray]:
    """A quantized random matrix and its float64 reading by gguf-py."""
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 2
    raw = quantize(w, ggml_type).reshape(-1).view(np.uint8)
    values = gguf_dequantize(raw.reshape(rows, -1), GGMLQuantizationType(int(ggml_type)))
    return QMatrix(raw, ggml_type, rows, k), values.astype(np.float64).reshape(rows, k)


def inputs(t: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    x[:, :32] *= 40  # one block of large values: the per-block scales must not mix
    return x


def quantized_values(a: Activations, ggml_type: GGMLType) -> np.ndarray:
    """The activations the product multiplies: per block of 32 for Q8_0 and MXFP4, of 256 for the rest."""
    block = 32 if ggml_type in (GGMLType.Q8_0, GGMLType.MXFP4) else 256
    q, d, _ = a.quantized(block)
    t, k = q.shape
    return (q.double().reshape(t, -1, block) * d.double()[..., None]).reshape(t, k).numpy()


def relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.abs(got.double().numpy() - want).max() / np.abs(want).max())


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "k", "t"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_block_products(lib, ggml_type, rows, k, t, threads) -> None:
    w, values = weights(ggml_type, rows, k, seed=rows + k)
    a = Activations(inputs(t, k, seed=t))
    got = matrix.matmul(a, w, threads)
    assert got.shape == (t, rows)
    assert relative_error(got, quantized_values(a, ggml_type) @ values.T) < 2e-6


@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.F16], ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "k", "t"), [(3, 40, 1), (33, 264, 5), (300, 1024, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_float_products(lib, ggml_type, rows, k, t, threads) -> None:
    """F32 and F16 weights multiply the float input itself (K needs no block multiple: 40, 264)."""
    w, values = weights(ggml_type, rows, k, seed=k)
    x = inputs(t, k, seed=1)
    got = matrix.matmul(Activations(x), w, threads)
    assert relative_error(got, x.double().numpy() @ values.T) < 2e-6


@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantization(lib, block) -> None:
    """int8 per block at scale amax / 127, each value within half a step, and for blocks of 256 the
    sums of each 16."""
    x = inputs(3, 512, seed=5)
    x[1, 256:] = 0  # all-zero blocks: scale 0, values 0
    q, d, s = Activations(x).quantized(block)
    blocks = x.reshape(3, 512 // block, block)
    assert torch.allclose(d, blocks.abs().amax(-1) / 127)
    step = d[..., None].expand(-1, -1, block).reshape(3, 512)
    assert ((q.float() * step - x).abs() <= step / 2 + 1e-6).all()
    assert q.abs().max() == 127 and (q[1, 256:] == 0).all() and (d[1, 256 // block :] == 0).all()
    if block == 32:
        assert s is None
    else:
        assert torch.equal(s.long(), q.long().reshape(3, 32, 16).sum(-1))


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES + (GGMLType.F16,), ids=lambda t: t.name)
def test_a_row_does_not_depend_on_its_company(lib, ggml_type) -> None:
    """Each token's row of a 70-token, two-thread product has the bits of that token alone on one thread."""
    w, _ = weights(ggml_type, 300, 512, seed=3)
    x = inputs(70, 512, seed=2)
    together = matrix.matmul(Activations(x), w, 2)
    for i in (0, 3, 4, 63, 64, 69):
        assert torch.equal(together[i], matrix.matmul(Activations(x[i : i + 1]), w, 1)[0])


def test_both_builds_quantize_alike() -> None:
    """The SIMD quantization gives the portable loop's bits (scales, values, sums), a huge value and an
    all-zero block among them."""
    if native.kernels().ds_simd() == 0:
        pytest.skip("no SIMD form here")
    x = inputs(9, 1024, seed=4)
    x[3, :256] = 0
    x[5, 7] = 1e6
    got = {}
    for scalar in (False, True):
        built = native.kernels(scalar)
        original, matrix.kernels = matrix.kernels, lambda lib=built: lib
        try:
            got[scalar] = [Activations(x).quantized(block) for block in (32, 256)]
        finally:
            matrix.kernels = original
    for simd, portable in zip(got[False], got[True], strict=True):
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(simd, portable, strict=True))


def test_builds_agree() -> None:
    """The SIMD and portable forms compute the same integer sums: their results differ only by the
    float32 order of the sums."""
    if native.kernels().ds_simd() == 0:
        pytest.skip("no SIMD form here")
    w, _ = weights(GGMLType.IQ2_XXS, 64, 1024, seed=9)
    a = Activations(inputs(5, 1024, seed=9))
    got = {}
    for scalar in (False, True):
        matrix_kernels = native.kernels(scalar)
        original, matrix.kernels = matrix.kernels, lambda lib=matrix_kernels: lib
        try:
            got[scalar] = matrix.matmul(a, w, 1)
        finally:
            matrix.kernels = original
    assert torch.allclose(got[False], got[True], rtol=1e-5, atol=1e-5 * got[True].abs().max().item())


def test_mxfp4_nan_exponent_is_refused() -> None:
    w, _ = weights(GGMLType.MXFP4, 4, 64, seed=1)
    raw = w.raw.copy()
    raw[17 * 5] = 0xFF  # block 5's exponent byte
    with pytest.raises(MXFP4ScaleError, match="block 5"):
        QMatrix(raw, GGMLType.MXFP4, 4, 64).checked()


def test_bad_shapes_are_refused() -> None:
    w, _ = weights(GGMLType.Q8_0, 4, 64, seed=1)
    with pytest.raises(DwarfStarError, match="96-wide input"):
        matrix.matmul(Activations(torch.zeros(1, 96)), w, 1)
    with pytest.raises(DwarfStarError, match="needs"):
        QMatrix(w.raw[:-1], GGMLType.Q8_0, 4, 64)
    with pytest.raises(DwarfStarError, match="no Q6_K product"):
        QMatrix(w.raw, GGMLType.Q6_K, 4, 64)


def test_bench_cpu_reports_every_format() -> None:
    """`dwarfstar bench cpu` measures each format (tiny streamed matrices here: a smoke run, no speed)."""
    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app

    _register_commands()
    done = CliRunner().invoke(app, ["bench", "cpu", "--threads", "1", "--stream-mib", "2", "--json"])
    assert done.exit_code == 0, done.output
    rows = json.loads(done.output)
    assert [r["format"] for r in rows] == ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4", "F16"]
    figures = ("cache_decode_gbs", "cache_prefill_gmacs", "stream_decode_gbs", "read_gbs")
    assert all(r["threads"] == 1 and all(0 < r[f] < 1e4 for f in figures) for r in rows)
