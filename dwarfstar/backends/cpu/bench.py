"""Per-format speed of the CPU kernels: `dwarfstar bench cpu`.

For each weight format, one [rows, 4096] matrix of random blocks (sane scales) is multiplied:
- in cache: a 1 MiB matrix over and over, so the figure is the kernel's own rate (its instructions),
  as GB/s of weight blocks and as multiply-adds per second, for one token (decode's GEMV) and for
  64 (a prefill chunk's GEMM);
- streamed: a matrix of `stream_mib` MiB (well past the caches) read once per product, as decode
  reads the weights from memory; beside the machine's read rate measured in the same run (a sum
  over a buffer as large, in the same threads).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch

from dwarfstar.backends.cpu.matrix import Activations, QMatrix, matmul
from dwarfstar.bench.bandwidth import read_bandwidth
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType

FORMATS = (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.MXFP4, GGMLType.F16)
K = 4096
# byte offsets of each block's float16 scales, set to 1.0 so no block decodes to inf or NaN
SCALES = {GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2), GGMLType.IQ2_XXS: (0,)}


@dataclass(frozen=True)
class KernelRow:
    format: str
    threads: int
    cache_decode_gbs: float  # GB/s of weight blocks, 1 token, matrix in cache
    cache_prefill_gmacs: float  # multiply-adds per second (G), 64 tokens, matrix in cache
    stream_decode_gbs: float  # GB/s of weight blocks, 1 token, matrix read from memory
    read_gbs: float  # the machine's read rate in the same threads


def random_blocks(ggml_type: GGMLType, rows: int, seed: int = 0) -> QMatrix:
    rng = np.random.default_rng(seed)
    if ggml_type == GGMLType.F16:
        raw = rng.standard_normal(rows * K, dtype=np.float32).astype(np.float16).view(np.uint8)
        return QMatrix(raw, ggml_type, rows, K)
    block, size = BLOCK_GEOMETRY[ggml_type]
    blocks = rng.integers(0, 256, (rows * K // block, size), dtype=np.uint8)
    for at in SCALES.get(ggml_type, ()):
        blocks[:, at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if ggml_type == GGMLType.MXFP4:
        blocks[:, 0] = 127  # 2^-1: no NaN exponent
    return QMatrix(blocks.reshape(-1), ggml_type, rows, K)


def _rate(run, n: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - start) / n


def measure(threads: list[int], stream_mib: int = 1024, formats=FORMATS) -> list[KernelRow]:
    return [row for ggml_type in formats for row in _format_rows(ggml_type, threads, stream_mib)]


def _format_rows(ggml_type: GGMLType, threads: list[int], stream_mib: int) -> list[KernelRow]:
    row_bytes = random_blocks(ggml_type, 1).row_bytes
    small = random_blocks(ggml_type, max(1, (1 << 20) // row_bytes))
    big = random_blocks(ggml_type, max(1, (stream_mib << 20) // row_bytes), seed=1)
    one, chunk = Activations(torch.randn(1, K)), Activations(torch.randn(64, K))
    rows = []
    for n in threads:
        cache = _rate(partial(matmul, one, small, n), 200)
        prefill = _rate(partial(matmul, chunk, small, n), 5)
        stream = _rate(partial(matmul, one, big, n), 3)
        rows.append(
            KernelRow(
                format=ggml_type.name,
                threads=n,
                cache_decode_gbs=small.raw.nbytes / cache / 1e9,
                cache_prefill_gmacs=64 * small.rows * K / prefill / 1e9,
                stream_decode_gbs=big.raw.nbytes / stream / 1e9,
                read_gbs=max(read_bandwidth(big.raw.view(np.int64), n)),
            )
        )
    return rows


def table(rows: list[KernelRow]) -> str:
    head = f"{'format':8} {'threads':>7} {'GEMV in cache':>14} {'GEMM in cache':>14} {'GEMV streamed':>14} {'read':>10}"
    lines = [head, f"{'':8} {'':>7} {'GB/s':>14} {'GMAC/s':>14} {'GB/s':>14} {'GB/s':>10}"]
    for r in rows:
        lines.append(
            f"{r.format:8} {r.threads:7d} {r.cache_decode_gbs:14.1f} {r.cache_prefill_gmacs:14.1f} "
            f"{r.stream_decode_gbs:14.1f} {r.read_gbs:10.1f}"
        )
    return "\n".join(lines)


def as_dicts(rows: list[KernelRow]) -> list[dict]:
    return [asdict(r) for r in rows]
