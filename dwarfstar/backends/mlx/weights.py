"""Model weights as MLX arrays, in one of four packings chosen at load.

* `exact` (the default without Metal): float tensors become float32; Q8_0, Q4_K, IQ2_XXS and MXFP4 are
  repacked losslessly into MLX affine groups (`repack.py`); Q2_K is dequantized to float32. The
  logits equal the reference's up to float32 summation order. Memory is that of the repacked or
  dequantized weights, so this is for small models (tests, CI, the CPU bench).
* `affine4` / `affine2`: as `exact`, but Q2_K and IQ2_XXS (the routed experts of the q2 files) are
  requantized by MLX into 4- or 2-bit affine groups of 32: the built-in-op path for an Apple
  machine that keeps the weights small without the Metal kernels. Lossy; `parity.packing_kl` measures it.
* `blocks` (the default with Metal): quantized matrices stay GGUF blocks, read in place by the
  Metal kernels (`metal.py`).

MXFP4 (the routed experts of ds4's files that keep the official FP4 experts) takes MLX's own mxfp4
form in every packing but `exact` (`repack.mxfp4_native`): the same nibbles, MLX's built-in products.

Every matrix answers `matmul(x)` (x [..., in] -> [..., out]) and, when stacked [E, out, in],
`gather(x, ids)` (x [T, 1 or k, 1, in], ids [T, k] -> [T, k, 1, out]). Matrices of one packing that
read the same input stack row-wise into one (`stack_rows`): a fused projection group is one product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.backends.mlx import repack
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt

PACKINGS = ("exact", "affine4", "affine2", "blocks")
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
REQUANTIZED = (GGMLType.Q2_K, GGMLType.IQ2_XXS)  # the routed-expert types of the q2 files


class Matrix(Protocol):
    def matmul(self, x: mx.array) -> mx.array: ...

    def gather(self, x: mx.array, ids: mx.array) -> mx.array: ...

    @staticmethod
    def stack_rows(matrices: Sequence[Matrix]) -> Matrix | None: ...


@dataclass
class DenseMatrix:
    """float32 [out, in], or stacked [E, in, out] (transposed once at load, as gather_mm wants it)."""

    w: mx.array

    @classmethod
    def stacked(cls, w: mx.array) -> DenseMatrix:
        return cls(mx.contiguous(w.swapaxes(-1, -2)))

    def matmul(self, x: mx.array) -> mx.array:
        return x @ self.w.T

    def gather(self, x: mx.array, ids: mx.array) -> mx.array:
        return mx.gather_mm(x, self.w, rhs_indices=ids)

    @staticmethod
    def stack_rows(matrices: Sequence[DenseMatrix]) -> DenseMatrix:
        return DenseMatrix(mx.concatenate([m.w for m in matrices]))


@dataclass
class AffineMatrix:
    """MLX affine quantization, group 32: [out, in * bits / 32] codes, or stacked [E, out, ...]."""

    parts: repack.AffineParts

    def matmul(self, x: mx.array) -> mx.array:
        p = self.parts
        return mx.quantized_matmul(
            x, p.codes, p.scales, p.biases, transpose=True, group_size=repack.GROUP, bits=p.bits, mode=p.mode
        )

    def gather(self, x: mx.array, ids: mx.array) -> mx.array:
        p = self.parts
        return mx.gather_qmm(
            x, p.codes, p.scales, p.biases, rhs_indices=ids, transpose=True, group_size=repack.GROUP, bits=p.bits,
            mode=p.mode,
        )  # fmt: skip

    @staticmethod
    def stack_rows(matrices: Sequence[AffineMatrix]) -> AffineMatrix | None:
        parts = repack.AffineParts.concatenate([m.parts for m in matrices])
        return None if parts is None else AffineMatrix(parts)


def stack_rows(matrices: Sequence[Matrix]) -> Matrix | None:
    """One [sum out_i, in] matrix holding the rows of the [out_i, in] matrices in order, or None when
    their packings differ. Rows of a product are independent, so its column ranges are each matrix's
    own product exactly."""
    kind = type(matrices[0])
    return kind.stack_rows(matrices) if all(type(m) is kind for m in matrices) else None


class Weights:
    """Reads tensors from a GGUF file into the chosen packing."""

    def __init__(self, gguf: GGUFFile, packing: str) -> None:
        if packing not in PACKINGS:
            raise DwarfStarError(f"unknown MLX weight packing {packing!r}; choose one of {', '.join(PACKINGS)}")
        self.gguf, self.packing = gguf, packing

    def dense(self, name: str) -> mx.array:
        """A small tensor (norms, biases, HC parameters, embeddings, the hash table) in float32 or int32."""
        return mx.array(self.gguf.tensor(name).numpy())

    def matrix(self, name: str, groups: int = 1) -> Matrix:
        """A [out, in] projection; `groups` > 1 splits its rows into a stack of [groups, out / groups, in]."""
        info = self.gguf.tensors[name]
        shape = info.shape if groups == 1 else (groups, info.shape[0] // groups, info.shape[1])
        return self._load(name, shape)

    def experts(self, name: str) -> Matrix:
        return self._load(name, self.gguf.tensors[name].shape)

    def stacked_rows(self, names: Sequence[str]) -> list[tuple[Matrix, list[int]]]:
        """Projections that read one input as few products as their packings allow: runs of
        consecutive matrices stacked row-wise (`stack_rows`), each with its matrices' row counts."""
        runs: list[tuple[list[Matrix], list[int]]] = []
        for name in names:
            m, rows = self.matrix(name), self.gguf.tensors[name].shape[0]
            if runs and stack_rows([runs[-1][0][0], m]) is not None:
                runs[-1][0].append(m)
                runs[-1][1].append(rows)
            else:
                runs.append(([m], [rows]))
        return [(ms[0] if len(ms) == 1 else stack_rows(ms), rows) for ms, rows in runs]

    def _load(self, name: str, shape: tuple[int, ...]) -> Matrix:
        return pack_matrix(self.gguf.raw(name), self.gguf.tensors[name].ggml_type, shape, self.packing)


def pack_matrix(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...], packing: str) -> Matrix:
    """GGUF bytes of a [out, in] matrix, or a stack [E, out, in], in the packing."""
    cols = shape[-1]
    rows = int(np.prod(shape[:-1]))
    if packing != "exact" and ggml_type == GGMLType.MXFP4:  # MLX's own MXFP4 products, no Metal kernel needed
        parts = repack.mxfp4_native(raw, rows, cols)
    elif packing == "blocks" and ggml_type not in FLOAT_TYPES:
        from dwarfstar.backends.mlx.metal import BlockMatrix

        return BlockMatrix.from_gguf(raw, ggml_type, shape)
    elif packing != "exact" and ggml_type in REQUANTIZED:
        bits = 4 if packing == "affine4" else 2
        parts = repack.requantize(_row_band(raw, ggml_type, rows, cols), rows, cols, bits)
    elif repack.exact_affine(ggml_type):
        parts = repack.repack_exact(raw, ggml_type, rows, cols)
    else:  # float tensors, and Q2_K in the exact packing
        w = mx.array(dequantize(raw, ggml_type, rows * cols).numpy()).reshape(shape)
        return DenseMatrix.stacked(w) if len(shape) == 3 else DenseMatrix(w)
    return AffineMatrix(parts.stacked(shape[0]) if len(shape) == 3 else parts)


def _row_band(raw: np.ndarray, ggml_type: GGMLType, rows: int, cols: int) -> Callable[[int, int], torch.Tensor]:
    """Dequantize rows [start, stop) of a block matrix straight from its bytes (the memory map)."""
    row_bytes = len(raw) // rows

    def band(start: int, stop: int) -> torch.Tensor:
        n = stop - start
        return dequantize(raw[start * row_bytes : stop * row_bytes], ggml_type, n * cols).view(n, cols)

    return band


def concat_experts(stacks: Sequence[Matrix]) -> Matrix:
    """Stacks [E_i, out, in] of one packing as one [sum E_i, out, in] stack, in order."""
    first = stacks[0]
    if isinstance(first, DenseMatrix):
        return DenseMatrix(mx.concatenate([m.w for m in stacks]))
    if isinstance(first, AffineMatrix):
        parts = repack.AffineParts.concatenate([m.parts for m in stacks])
        if parts is not None:
            return AffineMatrix(parts)
    from dwarfstar.backends.mlx.metal import BlockMatrix

    if isinstance(first, BlockMatrix):  # the blocks of expert e are rows [e * rows, (e + 1) * rows)
        blocks = mx.concatenate([m.blocks for m in stacks])
        return BlockMatrix(blocks, first.ggml_type, first.rows, first.cols, sum(m.experts for m in stacks))
    raise DwarfStarError(f"streamed experts cannot be stacked in the {type(first).__name__} packing yet")


class LayerWeights:
    """The tensors of block `il`, named by their role in the tensor table (`dwarfstar.model.tensors`)."""

    def __init__(self, weights: Weights, il: int) -> None:
        self.weights, self.il = weights, il

    def dense(self, name: str) -> mx.array:
        return self.weights.dense(tt.layer_tensor(self.il, name))

    def matrix(self, name: str, groups: int = 1) -> Matrix:
        return self.weights.matrix(tt.layer_tensor(self.il, name), groups)

    def experts(self, name: str) -> Matrix:
        return self.weights.experts(tt.layer_tensor(self.il, name))

    def stacked_rows(self, names: Sequence[str]) -> list[tuple[Matrix, list[int]]]:
        return self.weights.stacked_rows([tt.layer_tensor(self.il, name) for name in names])
