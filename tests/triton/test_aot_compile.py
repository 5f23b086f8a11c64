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


@pytest.mark.slow  # about a minute per target on two cores
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_gemv_kernels_read_weights_with_128_bit_loads(target):
    """The decode GEMVs of every weight format compile to 128-bit global loads (PTX ld.global.v4 /
    v2.b64, AMDGCN global_load_dwordx4): the aligned layout of `weights.repack` at work."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = ["-m", "dwarfstar.backends.triton.aot_check", "--only", "qmatmul,moe_experts", "--targets", target]
    result = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    gemv = [line.split() for line in result.stdout.splitlines() if "USE_DOT=False" in line]
    formats = {field for line in gemv for field in line if field.startswith("WTYPE=")}
    assert formats >= {"WTYPE=1", "WTYPE=8", "WTYPE=10", "WTYPE=16"}  # F16, Q8_0, Q2_K, IQ2_XXS
    assert all(int(dict(f.split("=") for f in line[1:] if "=" in f)["wide_loads"]) > 0 for line in gemv)
