"""Triton kernel tests: on a CPU-only machine they run in Triton's interpreter.

`TRITON_INTERPRET=1` is read when `@triton.jit` runs, so it is set here, before any test module
imports a kernel. The interpreter patches (a fast dot that handles bf16, no re-patching of
triton.language per helper call) live in tests/triton_interpreter.py, shared with tests/backends.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from triton_interpreter import apply_patches, overflow_checks  # noqa: E402  (tests/ is on sys.path: root conftest)

apply_patches()


@pytest.fixture(autouse=True)
def _overflow_checks(request):
    """The kernel tests run with the interpreter's int32 overflow checks; modules marked `whole_model`
    (and every test outside tests/triton) without them (tests/triton_interpreter.py says why)."""
    overflow_checks(request.node.get_closest_marker("whole_model") is None)
    yield
    overflow_checks(False)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
