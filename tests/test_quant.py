"""The block encoders: error bounds, bytes every reader decodes alike, imatrix benefit, ggml parity."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.quantize import quantize

BLOCK_TYPES = (GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ2_XXS)
# Relative RMS error bounds on N(0, 1) rows, a little above what ggml's own quantizers reach
# (Q8_0 0.0053, Q4_K 0.071, Q2_K 0.296, IQ2_XXS 0.38 with a flat imatrix).
RMSE_BOUND = {GGMLType.Q8_0: 0.006, GGMLType.Q4_K: 0.075, GGMLType.Q2_K: 0.31, GGMLType.IQ2_XXS: 0.37}


def _decode(raw: np.ndarray, ggml_type: GGMLType, shape: torch.Size) -> torch.Tensor:
    return dequantize(raw, ggml_type, int(np.prod(shape))).reshape(shape)


def _rel_rmse(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> float:
    w = torch.ones_like(x) if weight is None else weight.expand_as(x)
    return float(((y - x).square() * w).sum() / (x.square() * w).sum()) ** 0.5


def _skewed(cols: int, seed: int) -> torch.Tensor:
    """Importance with a few heavy columns, like the mean square activations of a real layer."""
    return torch.randn(cols, generator=torch.Generator().manual_seed(seed)).mul(1.5).exp()


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_round_trip_error_bound(ggml_type: GGMLType, weighted: bool) -> None:
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    importance = torch.ones(512) if weighted else None
    raw = quantize(x, ggml_type, importance)
    assert raw.dtype == np.uint8 and raw.shape == (
        64,
        512 // BLOCK_GEOMETRY[ggml_type][0] * BLOCK_GEOMETRY[ggml_type][1],
    )
    assert _rel_rmse(x, _decode(raw, ggml_type, x.shape)) < RMSE_BOUND[ggml_type]


def _awkward_rows() -> torch.Tensor:
    """Rows that stress the edge cases of the searches: zeros, constants, one sign, outliers, tiny and
    huge magnitudes, and values that land exactly on rounding boundaries."""
    gen = torch.Generator().manual_seed(3)
    rows = [
        torch.zeros(256),
        torch.full((256,), 0.75),
        torch.full((256,), -2.0),
        torch.rand(256, generator=gen) + 0.5,  # all positive: the min clamps to zero
        -(torch.rand(256, generator=gen) + 0.5),  # all negative
        torch.randn(256, generator=gen) * 1e-6,
        torch.randn(256, generator=gen) * 1e4,
        torch.arange(256.0).remainder(4) - 1.5,  # exact halves
        torch.where(torch.arange(256) == 7, 50.0, 0.01),  # one outlier
        torch.where(torch.arange(256) < 128, 0.0, torch.randn(256, generator=gen)),  # half the block empty
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_gguf_py_decodes_our_bytes_like_we_do(ggml_type: GGMLType, weighted: bool) -> None:
    x = torch.cat([_awkward_rows(), torch.randn(6, 256, generator=torch.Generator().manual_seed(4))])
    raw = quantize(x, ggml_type, _skewed(256, 5) if weighted else None)
    ours = _decode(raw, ggml_type, x.shape).numpy()
    theirs = quants.dequantize(raw, GGMLQuantizationType(int(ggml_type)))
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, theirs)
    assert (ours[0] == 0).all()  # an all-zero block stays exactly zero
    if ggml_type != GGMLType.IQ2_XXS:  # IQ2's scale search assumes spread-out values, as ggml's does
        assert np.abs(ours[1:3] - x[1:3].numpy()).max() < 0.01 * 2.0


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_imatrix_lowers_the_weighted_error(ggml_type: GGMLType) -> None:
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(1))
    importance = _skewed(512, 2)
    plain = _rel_rmse(x, _decode(quantize(x, ggml_type), ggml_type, x.shape), importance)
    weighted = _rel_rmse(x, _decode(quantize(x, ggml_type, importance), ggml_type, x.shape), importance)
    # measured gains: Q8_0 18%, Q4_K 20%, Q2_K 31%, IQ2_XXS 30%
    assert weighted < 0.9 * plain


def test_importance_broadcasts_per_expert() -> None:
    """(n_expert, 1, cols) importance steers each expert with its own vector, exactly as if each expert
    had been quantized alone."""
    gen = torch.Generator().manual_seed(6)
    experts = torch.randn(3, 8, 256, generator=gen)
    importance = torch.randn(3, 1, 256, generator=gen).exp()
    whole = quantize(experts, GGMLType.Q2_K, importance)
    for e in range(3):
        np.testing.assert_array_equal(whole[e], quantize(experts[e], GGMLType.Q2_K, importance[e, 0]))


def test_iq2_without_imatrix_uses_column_energy() -> None:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(7))
    np.testing.assert_array_equal(
        quantize(x, GGMLType.IQ2_XXS), quantize(x, GGMLType.IQ2_XXS, x.square().sum(0, keepdim=True))
    )


def test_bad_importance_is_rejected() -> None:
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="broadcast"):
        quantize(x, GGMLType.Q4_K, torch.ones(3, 256))
    with pytest.raises(ValueError, match="non-negative"):
        quantize(x, GGMLType.Q4_K, -torch.ones(256))
    with pytest.raises(ValueError, match="finite"):
        quantize(x, GGMLType.Q4_K, torch.full((256,), float("nan")))


# --- parity with ggml, through the library llama-cpp-python ships (the same function
# llama_model_quantize runs per tensor; tools/quant_compare.py does the whole-file comparison)


def _ggml() -> ctypes.CDLL:
    import llama_cpp  # only in the `quant_compare` nox session: these tests carry the llama_cpp marker

    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))


def _ggml_quantize(x: torch.Tensor, ggml_type: GGMLType, importance: torch.Tensor | None) -> np.ndarray:
    lib = _ggml()
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    # (type, src, dst, start, nrows, n_per_row, imatrix)
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 3, ctypes.c_void_p]
    lib.ggml_quantize_init(int(ggml_type))
    src = np.ascontiguousarray(x.numpy(), dtype=np.float32)
    block, size = BLOCK_GEOMETRY[ggml_type]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=np.float32)
    imp_ptr = None if imp is None else imp.ctypes.data
    lib.ggml_quantize_chunk(int(ggml_type), src.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], imp_ptr)
    return out


@pytest.mark.parametrize(
    ("ggml_type", "weighted"),
    [(t, w) for t in BLOCK_TYPES for w in (False, True) if t != GGMLType.IQ2_XXS or w],
    ids=lambda v: v.name if isinstance(v, GGMLType) else ("imatrix" if v else "plain"),
)
@pytest.mark.parametrize("dist", ["normal", "student-t"])
@pytest.mark.llama_cpp
def test_error_no_worse_than_ggml(ggml_type: GGMLType, weighted: bool, dist: str) -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(128, 1024, generator=gen)
    if dist == "student-t":  # heavy tails, like trained weights
        x = x / torch.rand(128, 1024, generator=gen).add(0.05).sqrt()
    importance = _skewed(1024, 9) if weighted else None
    theirs = _decode(_ggml_quantize(x, ggml_type, importance), ggml_type, x.shape)
    ours = _decode(quantize(x, ggml_type, importance), ggml_type, x.shape)
    for weight in (None, importance):
        assert _rel_rmse(x, ours, weight) <= 1.05 * _rel_rmse(x, theirs, weight)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.llama_cpp
def test_llama_cpp_decodes_our_bytes_like_we_do(ggml_type: GGMLType) -> None:
    lib = _ggml()
    decode = getattr(lib, f"dequantize_row_{ggml_type.name.lower().replace('_k', '_K')}")
    decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    x = torch.cat([_awkward_rows(), torch.randn(22, 256, generator=torch.Generator().manual_seed(10))])
    for importance in (None, _skewed(256, 11)):
        raw = np.ascontiguousarray(quantize(x, ggml_type, importance))
        theirs = np.zeros(x.numel(), dtype=np.float32)
        decode(raw.ctypes.data, theirs.ctypes.data, x.numel())
        np.testing.assert_array_equal(_decode(raw, ggml_type, x.shape).numpy().reshape(-1), theirs)
