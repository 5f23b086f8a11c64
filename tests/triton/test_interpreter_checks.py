"""The kernel tests run Triton's interpreter with its int32 overflow checks (tests/triton/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _square_kernel(x_ptr, y_ptr):
    x = tl.load(x_ptr)
    tl.store(y_ptr, x * x)


def test_an_int32_overflow_stops_a_kernel_test(device):
    if device.type == "cuda":
        pytest.skip("a compiled kernel checks overflow only in a debug build")
    x = torch.tensor([1 << 16], dtype=torch.int32)
    with pytest.raises(Exception, match="overflow"):
        _square_kernel[(1,)](x, torch.empty_like(x))
