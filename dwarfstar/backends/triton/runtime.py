"""Where the Triton kernels run and how their launches are sized.

On a GPU (CUDA or ROCm) the kernels compile; on a CPU-only machine they run in Triton's interpreter
(`TRITON_INTERPRET=1`, read when `@triton.jit` runs, so it must be set before kernel modules are
imported). The interpreter executes program instances one after another in numpy, so launch sizes
differ: on a GPU we want many programs to fill the multiprocessors, in the interpreter as few and as
large as possible. Every kernel wrapper asks this module instead of testing the environment itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from dwarfstar.model.config import ModelArgs


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_device() -> torch.device:
    """The GPU (ROCm builds of torch answer through torch.cuda too), or the CPU for the interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() and not interpreting() else torch.device("cpu")


def per_sequence(*vectors: torch.Tensor) -> None:
    """Batch kernels read pos[i] and slot[i] by plain offsets: refuse a strided view."""
    if any(v.dim() != 1 or not v.is_contiguous() for v in vectors):
        raise ValueError("per-sequence positions and slots must be contiguous 1-D tensors")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@dataclass(frozen=True)
class Precision:
    """How matrix products feed the tensor cores.

    `fast=False` keeps every product in IEEE fp32 (what the parity tests need: the reference is fp32).
    `fast=True` lets the prefill GEMM and attention tiles use bf16 operands with fp32 accumulation,
    as the official model does between its ops; decode GEMVs stay fp32 either way (they are bound by
    memory, not arithmetic).
    """

    fast: bool = False


EXACT = Precision(fast=False)
FAST = Precision(fast=True)
PRECISIONS = {"exact": EXACT, "fast": FAST}  # the names `--precision` takes


@dataclass(frozen=True)
class BenchShape:
    """The model shapes a kernel bench case uses: decode at context `ctx`, prefill chunks of `prefill`."""

    args: ModelArgs
    device: torch.device
    ctx: int
    prefill: int

    def generator(self, seed: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


@dataclass(frozen=True)
class BenchCase:
    """One timed launch sequence: `bytes` is what it must move at least (for GB/s), `flops` its math."""

    kernel: str
    name: str
    run: Callable[[], object]
    bytes: int
    flops: int = 0
