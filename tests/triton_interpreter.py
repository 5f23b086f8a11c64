"""Patches that make Triton's interpreter (TRITON_INTERPRET=1, the CPU runs of the kernels) usable.

Shared by tests/triton and tests/backends, and importable by a test's child process (put tests/ on
sys.path), so every process that runs the kernels in the interpreter computes the same numbers:

* a float `tl.dot` through torch.matmul with bf16 operands decoded exactly, and fp32 -> bf16 casts
  rounded to nearest even (the interpreter stores bf16 as raw uint16, so its bf16 dot returns
  garbage and its cast truncates, TOOLCHAIN.md §2). The kernels upcast to fp32 right after loading;
  only the `fast` precision path feeds bf16 to `tl.dot`. The interpreter's np.matmul also goes
  through OpenBLAS threads that spin for tens of milliseconds per product on shared cores;
* no re-patching of triton.language at every call of a @triton.jit helper;
* the xor reduction (`tl.sort`'s compare-and-swap steps) through numpy, which the interpreter runs
  element by element in Python otherwise (40 s for one sort of 1,024 keys);
* int32 overflow checks only where they are kept: `overflow_checks(True)` (the kernel tests of
  tests/triton, through their conftest) turns on the interpreter's `debug` with them, which makes a
  wrapped add, sub or mul stop the test. Elsewhere both are off. Triton's interpreter otherwise built
  the check for every integer op (a third of a whole model's run: a 4-token V4.1 forward on the tiny
  file took 23.6 s with it, 14.9 s without) and then dropped it, since its asserts act only in debug.

`apply_patches()` is idempotent and does nothing unless TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

_applied = False


def apply_patches() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET") != "1":
        return
    _patch_interpreter_dot()
    _patch_interpreter_device_calls()
    _patch_interpreter_xor_reduce()
    overflow_checks(False)
    _applied = True


def overflow_checks(on: bool) -> None:
    """Whether the interpreter stops at an int32 overflow of an integer add, sub or mul from now on."""
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=on, debug=on)


def _patch_interpreter_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
        return (u16.astype(np.uint32) << 16).view(np.float32)

    def f32_to_bf16_rne(f: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(f), np.uint16(0x7FC0), r)

    def as_f32(h) -> torch.Tensor:
        data = bf16_to_f32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(data))

    dot, cast = interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.cast_impl
    floats = (tl.float32, tl.float16, tl.bfloat16)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype == np.float32 and a.dtype.scalar in floats and b.dtype.scalar in floats:
            return interp.TensorHandle(torch.matmul(as_f32(a), as_f32(b)).numpy() + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(f32_to_bf16_rne(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    interp.InterpreterBuilder.create_dot = create_dot
    interp.InterpreterBuilder.cast_impl = cast_impl


def _patch_interpreter_device_calls() -> None:
    """Skip re-patching triton.language on every call of a @triton.jit helper.

    The interpreter re-runs `_patch_lang` (an `inspect.getmembers` sweep of triton.language) at each
    device-function call, including tl.sum, tl.max and tl.sigmoid, which are jit functions too; the
    patches of such a nested call are never undone, so repeating them for the same function only
    costs time (half of a Sinkhorn kernel's run time). Only the first call of each function patches.
    """
    from triton.runtime import interpreter as interp

    patched: set = set()
    call = interp.InterpretedFunction.__call__

    def call_once_patched(self, *args, **kwargs):
        if self.fn not in patched:
            patched.add(self.fn)
            return call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.InterpretedFunction.__call__ = call_once_patched


def _patch_interpreter_xor_reduce() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    apply_impl = interp.ReduceOps.apply_impl

    def fast_apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
        return apply_impl(self, input)

    interp.ReduceOps.apply_impl = fast_apply_impl
