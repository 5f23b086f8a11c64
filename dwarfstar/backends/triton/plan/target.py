"""Compiling for a GPU that is not here: a driver that only names the target, launches intercepted,
and what the compiled code says (registers, spills, wide loads).

Triton compiles for any target it ships a backend for. `TargetOnlyDriver` is just enough of a driver
for that; `intercepted(launch, tune)` replaces every kernel launch (and every autotuner's timing) with
a callback while the real launch code runs around it, so a model's step can be driven on tensors that
hold no data (the meta device) and each launch recorded or compiled instead of run.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import torch
import triton
import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; fusion on, as on 3.6
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUOBJDUMP = os.path.join(BIN, "cuobjdump")


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
    """`cuda:90` or `hip:gfx942` -> the Triton target (warp 32 on NVIDIA, wave64 on CDNA)."""
    try:
        backend, arch = text.split(":")
        if backend not in ("cuda", "hip"):
            raise ValueError
        return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
    except ValueError:
        raise ValueError(f"a target is cuda:ARCH or hip:GFX (e.g. cuda:90, hip:gfx942), got {text!r}") from None


def activate(target: GPUTarget) -> None:
    """Compile for `target` from now on in this process (Triton caches the target per kernel, so a
    process compiles for one target)."""
    driver.set_active(TargetOnlyDriver(target))


Launch = Callable[..., object]  # (jit_function, args, grid, kwargs) -> anything
Tune = Callable[..., object]  # (autotuner, args, kwargs) -> anything


@contextlib.contextmanager
def intercepted(launch: Launch, tune: Tune | None = None) -> Iterator[Callable]:
    """Within the block, `kernel[grid](*args, **kw)` calls `launch(fn, args, grid, kw)` instead of
    launching, and an autotuned kernel calls `tune(autotuner, args, kw)` instead of timing configs
    (default: its first pruned config goes to `launch`). Yields the real `JITFunction.run`, which
    compiles without launching when called with `warmup=True`."""
    run, tune_run = jit.JITFunction.run, Autotuner.run

    def on_run(self, *args, grid, warmup, **kwargs):
        return launch(self, args, grid, kwargs)

    def first_config(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        config = self.prune_configs(kwargs)[0]
        self.nargs = None
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    def on_tune(self, *args, **kwargs):
        return tune(self, args, kwargs) if tune is not None else first_config(self, *args, **kwargs)

    jit.JITFunction.run, Autotuner.run = on_run, on_tune
    try:
        yield run
    finally:
        jit.JITFunction.run, Autotuner.run = run, tune_run


def cuda_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of a cubin; stack above zero means spills."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def cuda_sass(cubin: bytes) -> str:
    """The SASS of a cubin, as cuobjdump prints it."""
    return _cuobjdump(cubin, "-sass")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True).stdout


def hip_usage(amdgcn: str) -> tuple[int, int]:
    """(vector registers, scratch bytes) from the AMDGCN metadata; scratch above zero means spills."""
    vgpr = re.search(r"\.vgpr_count:\s+(\d+)", amdgcn)
    scratch = re.search(r"\.private_segment_fixed_size:\s+(\d+)", amdgcn)
    return (int(vgpr.group(1)) if vgpr else -1, int(scratch.group(1)) if scratch else -1)


def usage(kernel, backend: str) -> tuple[int, int]:
    """(registers, spilled bytes) of a compiled kernel."""
    return cuda_usage(kernel.asm["cubin"]) if backend == "cuda" else hip_usage(kernel.asm["amdgcn"])


# 128-bit global loads: PTX vector loads of four 32-bit or two 64-bit lanes; AMDGCN dwordx4 / b128
WIDE_LOAD = {
    "cuda": re.compile(r"ld\.global(?:\.[a-z0-9]+)*\.v(?:4\.[bsuf]32|2\.[bsuf]64)\b"),
    "hip": re.compile(r"\b(?:global|buffer)_load_(?:dwordx4|b128)\b"),
}


def wide_loads(kernel, backend: str) -> int:
    """How many 128-bit global loads the compiled kernel's assembly holds."""
    return len(WIDE_LOAD[backend].findall(kernel.asm["ptx" if backend == "cuda" else "amdgcn"]))
