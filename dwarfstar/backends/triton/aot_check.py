"""Compile every Triton kernel for GPU targets on a machine without a GPU, and check its resources.

    python -m dwarfstar.backends.triton.aot_check --targets cuda:90,hip:gfx942

A CPU-only session cannot run the kernels compiled, but Triton compiles for any target it ships a
backend for. This swaps in a driver that only names the target and turns every launch into a
compile-only warmup, then drives the real launch code: every kernel's bench cases at Flash shapes
(fewer experts and a smaller vocabulary, which change no kernel specialisation) and a prefill chunk
and a decode step of a tiny model (`--only qmatmul,moe_experts` compiles just those modules' bench
cases), and a batched decode step of three sequences. Autotuned kernels compile every config their
launch could pick. It reports warps, stages,
registers, spills, shared memory and 128-bit global loads (PTX `ld.global.v4`,
AMDGCN `global_load_dwordx4`) per specialisation and fails on a compile error, a register spill
of a CUDA kernel (its stack, read with the cuobjdump Triton ships; an AMD kernel's scratch is
only warned about), more shared memory than the smallest GPUs of the backend give a block, or a
weight-streaming GEMV without 128-bit loads.
Each target compiles in its own process (Triton caches the target per kernel).

The kernels run nowhere, so nothing is checked numerically: the interpreter tests do that.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_check compiles for real GPUs: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

# shared memory a block may use: 99 KB on the smallest NVIDIA parts (sm_86/89/120/121), 64 KB of LDS on AMD
SHARED_LIMIT = {"cuda": 101376, "hip": 65536}
# SMs / CUs the decode attention splits its rows for: an H100/H200 SXM and an MI300X
MULTIPROCESSORS = {"cuda": 132, "hip": 304}
SPILL_LIMIT = 64  # bytes of stack tolerated (a few registers' worth, in kernels that are not hot)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


class TargetOnlyDriver:
    """Just enough of a Triton driver to compile for `target`: no device, no launches."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def parse_target(text: str) -> GPUTarget:
    backend, arch = text.split(":")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


def cuda_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of a cubin; stack above zero means spills."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


# 128-bit global loads: PTX vector loads of four 32-bit or two 64-bit lanes; AMDGCN dwordx4 / b128
WIDE_LOAD = {
    "cuda": re.compile(r"ld\.global(?:\.[a-z0-9]+)*\.v(?:4\.[bsuf]32|2\.[bsuf]64)\b"),
    "hip": re.compile(r"\b(?:global|buffer)_load_(?:dwordx4|b128)\b"),
}


# the weight-streaming kernels: their GEMV form (decode) must read the weights with 128-bit loads
GEMV_KERNELS = ("_qmatmul_kernel", "_gate_up_kernel", "_down_kernel")


def wide_loads(kernel, backend: str) -> int:
    """How many 128-bit global loads the compiled kernel's assembly holds."""
    return len(WIDE_LOAD[backend].findall(kernel.asm["ptx" if backend == "cuda" else "amdgcn"]))


def hip_usage(amdgcn: str) -> tuple[int, int]:
    """(vector registers, scratch bytes) from the AMDGCN metadata; scratch above zero means spills."""
    vgpr = re.search(r"\.vgpr_count:\s+(\d+)", amdgcn)
    scratch = re.search(r"\.private_segment_fixed_size:\s+(\d+)", amdgcn)
    return (int(vgpr.group(1)) if vgpr else -1, int(scratch.group(1)) if scratch else -1)


def check_target(target: GPUTarget, only: Sequence[str] = ()) -> list[str]:
    """Compile everything (or the bench cases of the kernel modules `only`) for one target; returns
    the problems found."""
    driver.set_active(TargetOnlyDriver(target))
    problems: list[str] = []
    seen: set[str] = set()
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        consts = " ".join(f"{k}={v}" for k, v in kwargs.items() if k[:1].isupper())
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # a compile error names the kernel and the constants
            problems.append(f"{target.arch} {name} {consts}: {str(exc).strip().splitlines()[-1]}")
            return None
        wide = wide_loads(kernel, target.backend)
        meta = kernel.metadata
        line = f"{name} warps={meta.num_warps} stages={meta.num_stages} shared={meta.shared} wide_loads={wide}"
        regs, stack = cuda_usage(kernel.asm["cubin"]) if target.backend == "cuda" else hip_usage(kernel.asm["amdgcn"])
        line += f" regs={regs} stack={stack}"
        if line + consts in seen:
            return None
        seen.add(line + consts)
        print(f"  {line} {consts}", flush=True)
        if name in GEMV_KERNELS and not kwargs.get("USE_DOT") and wide == 0:
            problems.append(f"{target.arch} {name} {consts}: no 128-bit loads in the GEMV")
        if meta.shared > SHARED_LIMIT[target.backend]:
            problems.append(f"{target.arch} {name} {consts}: {meta.shared} B of shared memory")
        if stack > SPILL_LIMIT and target.backend == "cuda":
            problems.append(f"{target.arch} {name} {consts}: spills ({stack} B of stack)")
        elif stack > SPILL_LIMIT:  # reported, not failed: the exact decode attention spills on gfx942 today
            print(f"WARNING {target.arch} {name} {consts}: spills ({stack} B of scratch)", flush=True)
        return None

    def compile_every_config(self, *args, **kwargs):
        # instead of timing the configs on a device, compile each one the launch could pick
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        for config in self.prune_configs(kwargs):
            self.fn.run(*args, **kwargs, **config.all_kwargs())
        self.nargs = None

    tune = Autotuner.run
    jit.JITFunction.run, Autotuner.run = compile_only, compile_every_config
    try:
        _drive_launches(only, target.backend)
    finally:
        jit.JITFunction.run, Autotuner.run = run, tune
    return problems


def _drive_launches(only: Sequence[str], backend: str) -> None:
    from dwarfstar.backends.triton import bench
    from dwarfstar.backends.triton.kernels import attention
    from dwarfstar.backends.triton.model import TritonModel
    from dwarfstar.backends.triton.runtime import EXACT, FAST, BenchShape
    from dwarfstar.backends.triton.synthetic import PRESETS, synthetic_state, synthetic_weights
    from dwarfstar.model.config import ModelArgs
    from dwarfstar.model.synthetic import Q2, TINY_K

    cpu = torch.device("cpu")
    attention.multiprocessors = lambda device: MULTIPROCESSORS[backend]  # the tensors are on the CPU
    for args in (ModelArgs.flash(), ModelArgs.pro()):
        shape = BenchShape(args.with_(n_routed_experts=16, vocab_size=4096), cpu, ctx=32768, prefill=256)
        for case in bench.kernel_cases(shape, only):
            case.run()
    if only:
        return
    PRESETS.setdefault("tiny-k", (TINY_K, Q2))  # rows of whole 256-column super-blocks for the q2 experts
    weights = synthetic_weights("tiny-k", device=cpu)
    for precision in (EXACT, FAST):
        model = TritonModel(weights, precision=precision)
        model.forward(list(range(3, 40)), model.new_state(), all_logits=False)
        model.forward([5], synthetic_state(model, ctx=300))
        states = [synthetic_state(model, ctx=n) for n in (40, 300, 301)]  # one cache block: the batch kernels
        model.forward_batch([[5], [6], [7]], states)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="cuda:90,hip:gfx942", help="backend:arch, comma-separated")
    parser.add_argument("--only", default="", help="kernel modules to compile the bench cases of, comma-separated")
    opts = parser.parse_args(argv)
    targets = opts.targets.split(",")
    if len(targets) > 1:
        command = [sys.executable, "-m", __spec__.name, "--only", opts.only, "--targets"]
        return max(subprocess.run([*command, t]).returncode for t in targets)
    print(f"== {targets[0]}", flush=True)
    problems = check_target(parse_target(targets[0]), [m for m in opts.only.split(",") if m])
    for problem in problems:
        print("PROBLEM", problem)
    print(f"{targets[0]}: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
