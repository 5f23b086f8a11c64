"""Triton kernels for CUDA and ROCm (DGX Spark, H100/H200, Strix Halo).

`load_backend(model_file)` uploads a model and returns the backend the session layer drives. On a
machine without a GPU the kernels run in Triton's interpreter (slow; for tests), which must be
chosen before the kernel modules are imported, so this module imports them lazily.
"""

from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    """True where the kernels compile: triton importable and a CUDA or ROCm device present."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def load_backend(model_file, device: torch.device | str | None = None, qat: bool = True):
    """A `TritonBackend` over `model_file` (a `ModelFile`), on `device` (default: the GPU, else the
    CPU through Triton's interpreter)."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type == "cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from dwarfstar.backends.triton.backend import TritonBackend

    return TritonBackend.from_model_file(model_file, device=device, qat=qat)
