"""The CPU backend's products: the reference forward with its weight products on the CPU kernels.

`KernelProducts` is a `backends.reference.weights.Products`: product weights stay in their file blocks
(`QMatrix`, memory-mapped), routed experts are views of their expert's bytes, the embedding is read by
rows, and inputs are quantized once for all the products they feed (`matrix.Activations`). Weights of a
type the kernels lack, and the small float tensors the reference keeps (norms, mHC mixes, the router),
stay float32 through the reference's own `ops.linear`. Where the kernels cannot be built here
(`native.available`), the CPU backend loads with the reference's float32 products instead.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from dwarfstar.backends.cpu.matrix import KERNEL_TYPES, Activations, QMatrix, matmul
from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.weights import Products, WeightSource
from dwarfstar.experts.store import ExpertBytes
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.reader import GGUFFile


class RowTable:
    """A [rows, dim] tensor of the file read by rows: `table[ids]` dequantizes just those rows."""

    def __init__(self, matrix: QMatrix) -> None:
        self.matrix = matrix
        self.blocks = matrix.raw.reshape(matrix.rows, matrix.row_bytes)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.blocks[np.asarray(ids, dtype=np.int64).reshape(-1)]
        return dequantize(picked, self.matrix.ggml_type, picked.shape[0] * self.matrix.cols).view(-1, self.matrix.cols)


class KernelProducts(Products):
    """The weight products of the cpu backend (and of `--cpu-moe`'s host layers) on `threads` threads
    (None: every core)."""

    def __init__(self, gguf: GGUFFile, threads: int | None) -> None:
        self.gguf, self.threads = gguf, threads or os.cpu_count() or 1
        self._checked: set[tuple[str, int]] = set()  # MXFP4 experts whose exponents were looked at

    def _blocks(self, name: str) -> QMatrix | None:
        info = self.gguf.tensors[name]
        if info.ggml_type not in KERNEL_TYPES or len(info.shape) != 2:
            return None
        return QMatrix(self.gguf.raw(name), info.ggml_type, *info.shape)

    def matrix(self, weights: WeightSource, name: str) -> Any:
        blocks = self._blocks(name)
        return weights.dense(name) if blocks is None else blocks

    def table(self, weights: WeightSource, name: str) -> Any:
        blocks = self._blocks(name)
        return weights.dense(name) if blocks is None else RowTable(blocks)

    def expert(self, weights: WeightSource, name: str, e: int) -> Any:
        if self.gguf.tensors[name].ggml_type not in KERNEL_TYPES:
            return weights.expert(name, e)
        return self.file_expert(name, e)

    def file_expert(self, name: str, e: int) -> QMatrix:
        """Expert e's matrix of the routed-expert tensor `name`, a view of its blocks in the file."""
        info = self.gguf.tensors[name]
        n_expert, rows, cols = info.shape
        matrix = QMatrix(self.gguf.raw(name), info.ggml_type, n_expert * rows, cols)[e * rows : (e + 1) * rows]
        if (name, e) not in self._checked:
            matrix.checked()
            self._checked.add((name, e))
        return matrix

    def input(self, x: torch.Tensor) -> Activations:
        return Activations(x)

    def linear(self, x: Any, w: Any) -> torch.Tensor:
        if isinstance(w, QMatrix):
            return matmul(x if isinstance(x, Activations) else Activations(x), w, self.threads)
        return ops.linear(x.x.reshape(*x.lead, -1) if isinstance(x, Activations) else x, w)


def kernel_expert(expert: ExpertBytes) -> tuple[QMatrix, ...]:
    """A streamed expert as the kernels read it: each part's blocks, copied (the store's bytes are only
    valid during the call; a copy of the blocks costs a fraction of the reference's float32 decode)."""
    return tuple(
        QMatrix(np.array(data), part.ggml_type, *part.shape).checked()
        for part, data in zip(expert.parts, expert.data, strict=True)
    )
