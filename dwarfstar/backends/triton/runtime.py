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
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import SplitRows


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
class PagedRows:
    """Compressed rows as the KV cache keeps them (`model.pages`): a pool of pages `pool` [pages,
    PAGE_ROWS, D] (float32, bf16, or `SplitRows`) and int32 page tables, row r of a sequence in row
    r % PAGE_ROWS of page table[r // PAGE_ROWS]. `table` is one sequence's [n] for a chunk kernel,
    or a cache block's [slots, n] for a batch kernel (a row per slot)."""

    pool: torch.Tensor | SplitRows
    table: torch.Tensor

    @property
    def capacity(self) -> int:
        """Rows one sequence's table reaches."""
        return self.table.shape[-1] * PAGE_ROWS

    @property
    def table_stride(self) -> int:
        """A slot's table row to the next (0 for one sequence's table)."""
        return self.table.stride(0) if self.table.dim() == 2 else 0

    @classmethod
    def scattered(cls, rows: torch.Tensor, seed: int = 0, exact_dims: int = 0) -> PagedRows:
        """Float32 rows [n, D] (one sequence) or [slots, n, D] (a block) laid out in the pages of a
        pool in a shuffled order, as forks and reused pages leave them (for tests and benches of the
        kernels that read pages); n is rounded up to whole pages with zero rows. `exact_dims`: a
        compact pool, the rows' leading dims in bf16 (`SplitRows`)."""
        lead, n_pages, dim = rows.shape[:-2], -(-rows.shape[-2] // PAGE_ROWS), rows.shape[-1]
        rows = torch.nn.functional.pad(rows, (0, 0, 0, n_pages * PAGE_ROWS - rows.shape[-2]))
        total = n_pages * (lead.numel() if lead else 1)
        generator = torch.Generator(device=rows.device).manual_seed(seed)
        order = torch.randperm(total, generator=generator, device=rows.device)
        pool = torch.empty(total, PAGE_ROWS, dim, device=rows.device)
        pool[order] = rows.reshape(total, PAGE_ROWS, dim)
        if exact_dims:
            pool = SplitRows(pool[..., :exact_dims].bfloat16(), pool[..., exact_dims:].contiguous())
        return cls(pool, order.to(torch.int32).view(*lead, n_pages))


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


@dataclass(frozen=True)
class KernelWork:
    """What one launch of a memory-streaming kernel moves, for `dwarfstar bench gpu-plan`'s model.

    A kernel module declares it through `launch_work(kernel_name, args) -> KernelWork | None`, from
    the launch's arguments by name (constexprs included, tensors possibly on the meta device).
    """

    bytes: int  # bytes the launch must read and write at least (weights, activations, outputs)
    weight_bytes: int  # of which weights (or KV rows): what streams from memory once per step
    iterations: int  # passes through the main loop per program
    loop_bytes: int  # bytes one program loads per main-loop iteration (weights and activations)
