"""A model of a decode step's time on a GPU, from the compiled code and stated hardware figures.

It is a model, not a measurement. Each launch costs a graph node (the gap a replay leaves between
two kernels) plus the longest of four times:
* memory: a round trip of latency, then its bytes at the bandwidth its loads in flight sustain
  (Little's law: bytes in flight / latency, at most the measured copy bandwidth);
* issue: its warp-instructions over the schedulers it occupies, each issuing one instruction per
  cycle only when it holds enough warps to cover the cycles a warp waits between two of its own
  instructions (`stall`): with w resident warps a scheduler issues min(1, w / stall) a cycle;
* gathers: the cache lines its table lookups touch (`gather_lines`), one a cycle per multiprocessor
  it occupies: a warp-wide load whose lanes read scattered entries of a small table (IQ2_XXS's
  lattice) is served line by line, so its cost is the lines, not the bytes;
* nothing else: a launch with neither bytes nor a main loop costs its node and one latency.
Bytes in flight: each resident program keeps one main-loop pass of loads outstanding (the loads of a
pass are issued before their results are used); residency follows registers, warps and shared
memory per multiprocessor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUFigures:
    """Stated figures of a GPU, the model's only inputs besides the code."""

    name: str
    bandwidth: float  # bytes/s a device-to-device copy moves (read + written)
    datasheet_bandwidth: float  # bytes/s the vendor states
    multiprocessors: int  # SMs / CUs
    schedulers: int  # warp schedulers (SIMDs) per multiprocessor, one instruction per cycle each
    clock: float  # Hz under load
    lanes: int  # threads per warp / wavefront
    stall: float  # cycles a warp waits, on average, between two of its instructions in these kernels
    latency: float  # s: a load's round trip to HBM under load
    node: float  # s: a graph node's cost between two kernels
    max_warps: int  # resident warps per multiprocessor
    max_programs: int  # resident blocks per multiprocessor
    registers: int  # 32-bit registers per multiprocessor (per SIMD lane x lanes on AMD)
    shared: int  # bytes of shared memory (LDS) per multiprocessor
    line: int = 128  # bytes of an L1 cache line: a gather costs a cycle per line its lanes touch


# H200: 4.3 TB/s measured by a device-to-device copy on the lent machine (KINDS.md), 4.8 TB/s
# datasheet, 132 SMs at 1.98 GHz under load; ~0.8 us loaded HBM latency (3.4 MB in flight saturate
# 4.3 TB/s); ~1.2 us per graph node between dependent kernels. Stall: 16 cycles, the median of what
# the first measured decode step asks of each kernel (H200, triton 3.6, 2026-12-04: gpu_profile's
# microseconds per launch of the flash-q2 exact step at 2k, batch 1 and 4, against this model's issue
# time at the kernel's resident warps); the kernels' own figures range over 5 to 30
H200 = GPUFigures("H200", 4.3e12, 4.8e12, 132, 4, 1.98e9, 32, 16.0, 0.8e-6, 1.2e-6, 64, 32, 65536, 232448)
# MI300X: 5.3 TB/s datasheet (about 4.3 measured by others' copies), 304 CUs of 4 SIMDs at 2.1 GHz;
# never measured here: the H200's stall
MI300X = GPUFigures("MI300X", 4.3e12, 5.3e12, 304, 4, 2.1e9, 64, 16.0, 1.0e-6, 1.5e-6, 32, 32, 131072, 65536)
FIGURES = {"cuda": H200, "hip": MI300X}


def resident(gpu: GPUFigures, warps: int, registers: int, shared: int) -> int:
    """Programs of `warps` warps using `registers` per thread and `shared` bytes one multiprocessor
    holds at once (registers allocated per warp in units of 256)."""
    per_warp = max(1, math.ceil(max(registers, 1) * gpu.lanes / 256) * 256)
    limits = [gpu.max_programs, gpu.max_warps // max(1, warps), gpu.registers // (per_warp * max(1, warps))]
    if shared:
        limits.append(gpu.shared // (shared + 1024))
    return max(1, min(limits))


def gather_lines(gpu: GPUFigures, lookups: float, table_bytes: int) -> float:
    """Cache lines `lookups` reads of one entry each (at most 16 bytes: one load a lane) touch when
    they pick entries of a `table_bytes` table at random, a warp's lanes at a time: each warp-wide
    gather touches L (1 - (1 - 1/L)^lanes) of the table's L lines on average (32 lanes over a 4 KB
    table: 20.4 of 32)."""
    n = max(1, table_bytes // gpu.line)
    return lookups / gpu.lanes * n * (1 - (1 - 1 / n) ** gpu.lanes)


@dataclass
class Timing:
    """A launch's modelled time and the figures it came from."""

    seconds: float  # node + max(memory, issue, gathers)
    memory: float
    issue: float
    in_flight: int  # bytes
    gathers: float = 0.0


def launch_time(
    gpu: GPUFigures,
    programs: int,
    warps: int,
    registers: int,
    shared: int,
    moved: int,
    loop_load_bytes: int,
    instructions: int,
    lines: float = 0.0,
) -> Timing:
    """`moved`: bytes the launch reads and writes; `loop_load_bytes`: what one program loads per pass
    of its main loop (0: no loop); `instructions`: warp-instructions the whole launch issues; `lines`:
    the cache lines all its gathers touch (`gather_lines`)."""
    per_sm = resident(gpu, warps, registers, shared)
    live = min(programs, per_sm * gpu.multiprocessors)
    in_flight = live * loop_load_bytes
    rate = min(gpu.bandwidth, in_flight / gpu.latency) if in_flight else gpu.bandwidth
    memory = gpu.latency + (moved / rate if moved else 0.0)
    schedulers = min(programs * warps, min(programs, gpu.multiprocessors) * gpu.schedulers)
    warps_per_scheduler = min(per_sm, math.ceil(programs / gpu.multiprocessors)) * warps / gpu.schedulers
    issue_rate = min(1.0, max(1.0, warps_per_scheduler) / gpu.stall)  # instructions a cycle per scheduler
    issue = instructions / (schedulers * gpu.clock * issue_rate)
    gathers = lines / (min(programs, gpu.multiprocessors) * gpu.clock)
    return Timing(gpu.node + max(memory, issue, gathers), memory, issue, in_flight, gathers)
