"""Weight matrices in their file blocks, and their products with float activations on the CPU kernels.

A `QMatrix` is a [rows, cols] view of a GGUF tensor's bytes (the memory map: nothing is read or copied
until a product runs). `Activations` quantize a [T, K] input once per block size, as int8 with a float
scale per block (kernels.c; 32 for Q8_0 and MXFP4 weights, 256 with the sums of each 16 for the
K-quants and IQ2_XXS, as ggml's Q8_0 and Q8_K), for every block-format product it feeds: the query
and KV projections share one, as do an expert's gate and up. F32 and F16 weights multiply the float
input itself.

Numerics: the int8 activations are the only rounding beyond the file's own (a relative error of at
most 1/254 of a block's largest value per element); the integer dot of each 32 is exact, and the
float sums run in a fixed order, so a row's result is the same bits however many rows share the
call. tests/cpu/test_cpu_backend.py reports the effect on the tiny models' logits (KL, top-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.backends.cpu.native import kernels
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import MXFP4_NAN_EXPONENT, MXFP4ScaleError, dequantize

KERNEL_TYPES = frozenset(
    {GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.MXFP4}
)
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16})
CHUNK = 32  # activation block of Q8_0 and MXFP4 products (kernels.c CHUNK)
SUPER_BLOCK = 256  # activation block of the K-quant and IQ2_XXS products, as their weight blocks
PER_CHUNK_TYPES = frozenset({GGMLType.Q8_0, GGMLType.MXFP4})


@dataclass(frozen=True)
class QMatrix:
    """Rows of a GGUF tensor, in the file's blocks: `raw` holds rows * row_bytes bytes."""

    raw: np.ndarray
    ggml_type: GGMLType
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.ggml_type not in KERNEL_TYPES:
            raise DwarfStarError(f"the CPU kernels have no {self.ggml_type.name} product")
        if self.raw.nbytes != self.rows * self.row_bytes:
            what = f"{self.rows} x {self.cols} {self.ggml_type.name}"
            raise DwarfStarError(f"{what} needs {self.rows * self.row_bytes} B, got {self.raw.nbytes}")

    @property
    def row_bytes(self) -> int:
        block, size = BLOCK_GEOMETRY[self.ggml_type]
        return self.cols // block * size

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def __getitem__(self, rows: slice) -> QMatrix:
        """Rows `start:stop` (a view)."""
        start, stop, step = rows.indices(self.rows)
        assert step == 1, "row slices only"
        part = self.raw[start * self.row_bytes : stop * self.row_bytes]
        return QMatrix(part, self.ggml_type, stop - start, self.cols)

    def checked(self) -> QMatrix:
        """Itself, after refusing an MXFP4 block whose exponent is E8M0's NaN (as the dequantizer does)."""
        if self.ggml_type == GGMLType.MXFP4:
            bad = np.flatnonzero(self.raw.reshape(-1, BLOCK_GEOMETRY[GGMLType.MXFP4][1])[:, 0] == MXFP4_NAN_EXPONENT)
            if bad.size:
                raise MXFP4ScaleError(f"MXFP4 block {int(bad[0])} has exponent byte 0xFF, which is NaN in E8M0")
        return self

    def dense(self) -> torch.Tensor:
        """The float32 matrix (the reference's reading of the same bytes)."""
        return dequantize(self.raw, self.ggml_type, self.rows * self.cols).reshape(self.rows, self.cols)


class Activations:
    """A [T, K] float input, quantized at most once per block size for all the products it feeds."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x.detach().reshape(-1, x.shape[-1]).float().contiguous()
        self.lead = x.shape[:-1]
        self._quantized: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    def quantized(self, block: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 values [T, K], float scales [T, K/block], and for blocks of 256 the int16 sums of each 16
        [T, K/16]): ggml's Q8_0 (block 32) and Q8_K (block 256)."""
        if block not in self._quantized:
            t, k = self.x.shape
            if k % block:
                raise DwarfStarError(f"this product needs inputs of a multiple of {block}, got {k}")
            q = torch.empty(t, k, dtype=torch.int8)
            d = torch.empty(t, k // block, dtype=torch.float32)
            s = torch.empty(t, k // 16, dtype=torch.int16) if block == SUPER_BLOCK else None
            sums = None if s is None else s.data_ptr()
            kernels().ds_quantize(self.x.data_ptr(), t, k, block, q.data_ptr(), d.data_ptr(), sums)
            self._quantized[block] = q, d, s
        return self._quantized[block]


def matmul(x: Activations, w: QMatrix, threads: int) -> torch.Tensor:
    """x [T, K] @ w.T -> [*lead, rows] float32, on `threads` threads."""
    if x.x.shape[1] != w.cols:
        raise DwarfStarError(f"product of a {x.x.shape[1]}-wide input with {w.rows} x {w.cols} weights")
    t = x.tokens
    out = torch.empty(t, w.rows, dtype=torch.float32)
    if w.ggml_type in FLOAT_TYPES:
        q = d = s = None
    else:
        parts = x.quantized(CHUNK if w.ggml_type in PER_CHUNK_TYPES else SUPER_BLOCK)
        q, d, s = (None if a is None else a.data_ptr() for a in parts)
    kernels().ds_matmul(
        int(w.ggml_type),
        w.raw.ctypes.data,
        w.row_bytes,
        w.rows,
        w.cols,
        q,
        d,
        s,
        x.x.data_ptr(),
        t,
        out.data_ptr(),
        out.stride(0),
        threads,
    )
    return out.reshape(*x.lead, w.rows)
