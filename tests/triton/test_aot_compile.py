"""Every kernel compiles for an NVIDIA (sm_90) and an AMD (gfx942) target without a GPU, with no
register spills and shared memory within the smallest parts' limits (`aot_check`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # about two minutes of compilation on two cores; the GPU check compiles for real
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_kernels_compile_for_gpu_targets(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "dwarfstar.backends.triton.aot_check", "--targets", target],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{target}: 0 problems" in result.stdout
