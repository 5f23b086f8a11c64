"""The Metal production path: GGUF blocks read in place by custom kernels (`kernels/`).

A `BlockMatrix` keeps a quantized matrix (or a stack of experts) as the file's uint8 blocks on the
device. Its products pick a kernel by size: the fused dequant-GEMV for up to 8 tokens (decode), the
tiled dequant-GEMM beyond (prefill), and for routed experts the gathered GEMV or, for many pairs,
the gathered GEMM over pairs sorted by expert.

Attention, the compressors and the indexer need no kernel of their own: MLX's fused attention
takes the per-head sinks, a batch of per-query keys (the raw window plus the rows the indexer
chose, gathered by `mx.take`) and a row mask; the indexer's scores are one matmul and an
argpartition; the long elementwise chains (Sinkhorn, rope, the FP8/FP4 roundings) are fused by
`mx.compile` (`ops.Fused`).

Every call is first described as a `Launch` (kernel, inputs, template, grid, outputs) and then run,
so the launch geometry itself is tested where Metal is missing: tests/mlx runs the same launches
through a CPU emulation of the kernels (their sources are also valid C++).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx.kernels import moe_gemm, moe_gemv, qgemm, qgemv, quant_blocks, tiles
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType

KERNEL_TYPES = (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS)
GEMV_MAX_TOKENS = 8  # up to here a token costs a few more FMAs per decoded slice; beyond, tile
MOE_GEMV_MAX_PAIRS = 64
THREADGROUP = (256, 1, 1)
TILE = 32  # rows and tokens of a tiled kernel's output tile (kernels/tiles.py)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    tiled: bool  # needs the tile helpers in its header


SPECS = {
    "qgemv": KernelSpec("dwarfstar_qgemv", ("w", "x", "dims"), ("y",), qgemv.SOURCE, False),
    "qgemm": KernelSpec("dwarfstar_qgemm", ("w", "x", "dims"), ("y",), qgemm.SOURCE, True),
    "moe_gemv": KernelSpec("dwarfstar_moe_gemv", ("w", "x", "ids", "dims"), ("y",), moe_gemv.SOURCE, False),
    "moe_gemm": KernelSpec("dwarfstar_moe_gemm", ("w", "x", "order", "offsets", "dims"), ("y",), moe_gemm.SOURCE, True),
}


def header(spec: KernelSpec) -> str:
    text = "#include <metal_stdlib>\n#include <metal_simdgroup>\n" + quant_blocks.header()
    return text + tiles.SOURCE if spec.tiled else text


@functools.cache
def kernel(name: str):
    """The `mx.fast.metal_kernel` object (built anywhere; compiled by Metal at its first call)."""
    spec = SPECS[name]
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=spec.source,
        header=header(spec),
    )


@dataclass
class Launch:
    kernel: str
    inputs: list[mx.array]
    template: list[tuple[str, int]]
    grid: tuple[int, int, int]
    output_shape: tuple[int, ...]

    def run(self) -> mx.array:
        return kernel(self.kernel)(
            inputs=self.inputs,
            template=self.template,
            grid=self.grid,
            threadgroup=THREADGROUP,
            output_shapes=[self.output_shape],
            output_dtypes=[mx.float32],
        )[0]


def _dims(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.uint32)


def _tiles(n: int) -> int:
    return -(-n // TILE)


@dataclass
class BlockMatrix:
    """A [rows, cols] matrix, or `experts` stacked [rows, cols] matrices, as GGUF blocks on the device."""

    blocks: mx.array  # uint8 [experts * rows, bytes per row]
    ggml_type: GGMLType
    rows: int
    cols: int
    experts: int = 1

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> BlockMatrix:
        ggml_type = GGMLType(ggml_type)
        if ggml_type not in KERNEL_TYPES:
            raise DwarfStarError(f"no Metal kernel reads {ggml_type.name} blocks")
        block, size = BLOCK_GEOMETRY[ggml_type]
        cols, rows = shape[-1], shape[-2]
        experts = shape[0] if len(shape) == 3 else 1
        blocks = mx.array(np.ascontiguousarray(raw).reshape(experts * rows, cols // block * size))
        return cls(blocks, ggml_type, rows, cols, experts)

    @staticmethod
    def stack_rows(matrices: Sequence[BlockMatrix]) -> BlockMatrix | None:
        """The matrices' rows as one matrix (weights.stack_rows), when they share a type and width."""
        first = matrices[0]
        if any((m.ggml_type, m.cols, m.experts) != (first.ggml_type, first.cols, 1) for m in matrices):
            return None
        blocks = mx.concatenate([m.blocks for m in matrices])
        return BlockMatrix(blocks, first.ggml_type, sum(m.rows for m in matrices), first.cols)

    def _template(self) -> list[tuple[str, int]]:
        return [("QTYPE", int(self.ggml_type)), ("COLS", self.cols)]

    def matmul_launch(self, x: mx.array) -> Launch:
        """x [T, cols] -> [T, rows]."""
        n = x.shape[0]
        if n <= GEMV_MAX_TOKENS:
            grid = (32 * self.rows, 1, 1)
            return Launch(
                "qgemv", [self.blocks, x, _dims(self.rows)], self._template() + [("NTOK", n)], grid, (n, self.rows)
            )
        grid = (THREADGROUP[0] * _tiles(self.rows), _tiles(n), 1)
        return Launch("qgemm", [self.blocks, x, _dims(self.rows, n)], self._template(), grid, (n, self.rows))

    def gather_launch(self, x: mx.array, ids: mx.array, per_x: int) -> Launch:
        """Rows x [n, cols], ids [pairs] (pair p reads x row p // per_x) -> [pairs, rows]."""
        pairs = ids.shape[0]
        dims = _dims(self.rows, per_x)
        if pairs <= MOE_GEMV_MAX_PAIRS:
            grid = (32 * self.rows, pairs, 1)
            return Launch("moe_gemv", [self.blocks, x, ids, dims], self._template(), grid, (pairs, self.rows))
        order = mx.argsort(ids).astype(mx.uint32)
        counts = mx.zeros((self.experts,), dtype=mx.uint32).at[ids].add(mx.ones_like(ids))
        offsets = mx.concatenate((mx.zeros((1,), dtype=mx.uint32), mx.cumsum(counts)))
        grid = (THREADGROUP[0] * _tiles(self.rows), self.experts, 1)
        inputs = [self.blocks, x, order, offsets, dims]
        return Launch("moe_gemm", inputs, self._template(), grid, (pairs, self.rows))

    def matmul(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.cols).astype(mx.float32)
        return self.matmul_launch(flat).run().reshape(*lead, self.rows)

    def gather(self, x: mx.array, ids: mx.array) -> mx.array:
        """x [T, 1 or k, 1, cols], ids [T, k] -> [T, k, 1, rows] (the Matrix protocol of weights.py)."""
        T, k = ids.shape
        per_x = k if x.shape[1] == 1 else 1
        flat = x.reshape(-1, self.cols).astype(mx.float32)
        out = self.gather_launch(flat, ids.reshape(-1).astype(mx.uint32), per_x).run()
        return out.reshape(T, k, 1, self.rows)
