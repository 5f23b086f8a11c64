"""Triton kernel tests: on a CPU-only machine they run in Triton's interpreter.

`TRITON_INTERPRET=1` is read when `@triton.jit` runs, so it is set here, before any test module
imports a kernel. The interpreter stores bf16 as raw uint16, which breaks `tl.dot` and casts on
bf16 (TOOLCHAIN.md §2); the kernels upcast to fp32 right after loading, and the `fast` precision
path (bf16 tensor-core operands) is checked with the patch below, which fixes dot and rounding.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton.language as tl  # noqa: E402


def _patch_interpreter_bf16() -> None:
    from triton.runtime import interpreter as interp

    def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
        return (u16.astype(np.uint32) << 16).view(np.float32)

    def f32_to_bf16_rne(f: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(f), np.uint16(0x7FC0), r)

    dot, cast = interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):

            def as_f32(h):
                return bf16_to_f32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)

            out = np.matmul(as_f32(a), as_f32(b), dtype=d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(f32_to_bf16_rne(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    interp.InterpreterBuilder.create_dot = create_dot
    interp.InterpreterBuilder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
