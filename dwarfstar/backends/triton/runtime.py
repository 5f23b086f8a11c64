"""Where the Triton kernels run and how their launches are sized.

On a GPU (CUDA or ROCm) the kernels compile; on a CPU-only machine they run in Triton's interpreter
(`TRITON_INTERPRET=1`, read when `@triton.jit` runs, so it must be set before kernel modules are
imported). The interpreter executes program instances one after another in numpy, so launch sizes
differ: on a GPU we want many programs to fill the multiprocessors, in the interpreter as few and as
large as possible. Every kernel wrapper asks this module instead of testing the environment itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


INTERPRETER_MULTIPROCESSORS = 4  # the interpreter runs programs one after another: a few splits suffice
_assumed_multiprocessors: int | None = None


def assume_multiprocessors(n: int | None) -> None:
    """Size launches for a GPU of `n` multiprocessors that is not here (compiling or recording for a
    target: `plan`, `aot_check`, `warm`); None goes back to the device's own count."""
    global _assumed_multiprocessors
    _assumed_multiprocessors = n


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD, through torch.cuda too) the kernels' grids are sized for."""
    if _assumed_multiprocessors is not None:
        return _assumed_multiprocessors
    if device.type == "cuda":
        return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_MULTIPROCESSORS


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced counters, kept: a captured graph may still point at them


def ticket_counters(device: torch.device, purpose: str, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for a kernel's "last program finishes" tickets, one buffer per
    device and purpose, allocated once (outside a graph capture: a step runs eagerly before it is
    captured). A kernel's last program of each group resets its counter, so the counters are zero
    again after every launch and graph replay."""
    key = (str(device), purpose)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        if have is not None:
            _OUTGROWN.append(have)
        _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return _COUNTERS[key]


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

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The kernels' view of the pool: (leading part, rest, leading width), width 0 for float32 rows,
        else the bf16 width of a compact pool (a `SplitRows`' exact part, or all of a bf16 pool's)."""
        if isinstance(self.pool, SplitRows):
            return self.pool.exact, self.pool.rest, self.pool.exact.shape[-1]
        return self.pool, self.pool, self.pool.shape[-1] if self.pool.dtype == torch.bfloat16 else 0

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
    as the official model does between its ops; decode GEMVs stay fp32 (they are bound by memory,
    not arithmetic), except the experts' decode loops, which take fp16 activations into the tensor
    cores (`kernels.expert_blocks`), or for 2-bit experts (IQ2_XXS gate/up, Q2_K down) int8
    activations into integer dot products (`kernels.expert_int8`), to cut their instructions per
    weight byte.
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
class LoopWork:
    """One loop of a kernel whose programs run different loops (e.g. the shared expert in column 0,
    routed entries elsewhere), per source iteration of one program."""

    name: str
    programs: int  # programs of the launch that run it
    passes: int  # iterations per program
    weight_bytes: int  # weight bytes an iteration streams
    streamed: int  # bytes an iteration streams from memory (weights and activations)
    loads: int = 0  # bytes its load instructions fetch, cached lookups included (0: `streamed`)
    # table lookups an iteration makes, as (lookups, table bytes): a lane reads one entry of at most
    # 16 bytes each (`plan.predict.gather_lines` turns them into the cache lines they touch)
    gathers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class KernelWork:
    """What one launch of a memory-streaming kernel moves, for `dwarfstar bench gpu-plan`'s model.

    A kernel module declares it through `launch_work(kernel_name, args) -> KernelWork | None`, from
    the launch's arguments by name (constexprs included, tensors possibly on the meta device). One
    main loop (`iterations`, `loop_bytes`), or `loops`: the plan pairs them with the compiled code's
    innermost loops in order of the bytes they load per pass (`LoopWork.loads`, most first).
    """

    bytes: int  # bytes the launch must read and write at least (weights, activations, outputs)
    weight_bytes: int  # of which weights (or KV rows): what streams from memory once per step
    iterations: int = 0  # passes through the main loop per program
    loop_bytes: int = 0  # bytes one program loads per main-loop iteration (weights and activations)
    loops: tuple[LoopWork, ...] = ()


# -- "the last program finishes": one launch where a reduction over programs used to take two ---------------
TICKET_SLOTS = 256  # the most token blocks a decode step finishes in one launch (`TritonStep.fused`)


@triton.jit
def rsqrt_rn(x):
    """1 / sqrt(x), each step rounded as IEEE says (the reference's torch.rsqrt on the CPU): tl.rsqrt
    compiles to the approximate rsqrt.approx.ftz.f32 on NVIDIA, and `/` on float32 to the approximate
    div.full.f32, while Triton's interpreter computes both exactly, so only a GPU would see them."""
    return tl.div_rn(1.0, tl.sqrt_rn(x))


@triton.jit
def last_program(counter_ptr, n):
    """Whether this program is the last of the `n` sharing the counter to get here, once its partial
    results are stored: the one that then reads all of them (with `cache_modifier=".cg"`) and finishes.

    The barrier orders every thread's stores before the one acquire-release atomic that draws the
    ticket; the last resets the counter, so the next launch (a graph replay) starts from 0. The
    interpreter runs programs one after another, so there too the last sees every partial.
    """
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


_dependent_launches = True  # `set_dependent_launches`: off where a device failed `gpu_bench`'s probe


def set_dependent_launches(on: bool) -> None:
    """Launch the kernels that take it as programmatic dependents (`dependent_launch`) or not."""
    global _dependent_launches
    _dependent_launches = on


def dependent_launch() -> dict:
    """The launch keywords of a kernel that starts with `wait_for_inputs`: on NVIDIA sm_90 and later
    (Hopper's programmatic dependent launch, compiling for the active target: a target-only driver
    too), `PDL` and Triton's `launch_pdl`; elsewhere, in the interpreter and with DWARFSTAR_PDL=off
    in the environment (`tools/gpu_check.sh` passes it to every step), PDL off.

    A dependent kernel's programs are placed on the multiprocessors as soon as every program of the
    kernel before it has got past its own wait, and wait there (`griddepcontrol.wait`) until that
    kernel has finished and its writes are visible: the launch, the programs' start and what they do
    before the wait (the GEMV's L2 prefetch of its weights) overlap the kernel before."""
    on = _dependent_launches and not interpreting() and os.environ.get("DWARFSTAR_PDL", "on") != "off"
    if on:
        target = triton.runtime.driver.active.get_current_target()
        on = target.backend == "cuda" and int(target.arch) >= 90
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Ahead of a kernel's first read of anything a kernel writes, with `dependent_launch`'s PDL: wait
    until the kernel before has finished, so that nothing is read before it is written, then let the
    next kernel launch once all of this one's programs have got here. So one kernel at most waits
    ahead of the one running (two ahead would both prefetch their weights, and overflow L2). A
    kernel before that never signals (a torch kernel, a copy) is waited for as without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def program_values(part_ptr, t, offsets, mask, n, width, NP: tl.constexpr):
    """The `n` programs' partial results of one token [T, n, width] at `offsets` [A, B] (where `mask`),
    as [NP, A, B] (zero past n), read past L1: load several before summing any, and their round trips
    to L2 overlap."""
    q = tl.arange(0, NP)
    row = (t.to(tl.int64) * n + q) * width
    ok = (q < n)[:, None, None] & mask[None, :, :]
    return tl.load(part_ptr + row[:, None, None] + offsets[None, :, :], mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def program_sums(part_ptr, t, offsets, mask, n, width, NP: tl.constexpr):
    """Sum over the `n` programs of one token's partial results [T, n, width] at `offsets` [A, B]
    (where `mask`), in a fixed order: the same inputs give the same bits every run."""
    return tl.sum(program_values(part_ptr, t, offsets, mask, n, width, NP), axis=0)
