"""`dwarfstar bench gpu-plan`: the launches of a Flash-shaped captured decode step, counted without a
GPU, stay within the launch budget; the machine-code reader finds a GEMV's main loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dwarfstar.backends.triton.plan.disasm import parse_amdgcn, parse_sass
from dwarfstar.backends.triton.plan.report import LoopRow, _launch_ipb

# launches of one captured Flash decode step (43 layers, batch 1 and 4, 2k context, sampling in the
# step); issue 30 asked for at most 700, stretch 450
LAUNCH_BUDGET = 560


def _plan(tmp_path, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "dwarfstar.backends.triton.plan", "--no-compile", "--json", str(out), *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_flash_decode_step_launches_within_budget(tmp_path):
    # the fast form's int8 experts take x quantized by the routing launch: no launch of their own
    for batch, precision in (("1", "exact"), ("4", "exact"), ("1", "fast"), ("4", "fast")):
        plan = _plan(tmp_path, "--preset", "flash", "--ctx", "2048", "--batch", batch, "--precision", precision)
        totals = plan["totals"]
        assert plan["layers"] == 43
        assert totals["launches"] == totals["triton_launches"] + totals["torch_launches"]
        assert totals["launches"] <= LAUNCH_BUDGET, totals
        assert totals["torch_launches"] == 0, totals  # all the step's work is in its kernels
        kernels = [row["kernel"] for row in plan["rows"] if row["kind"] == "triton"]
        assert any(name.startswith("_sample") for name in kernels)  # the step ran to its end, sampling included
        assert "MODEL" in plan["note"]


SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0120*/                   LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0130*/                   FFMA R9, R4, R5, R9 ;
        /*0140*/                   SHFL.BFLY PT, R10, R9, 0x10, 0x1f ;
        /*0150*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0160*/              @!P0 BRA 0x110 ;
        /*0170*/                   EXIT ;
        /*0180*/                   BRA 0x180;
"""

AMDGCN = """
_kernel:
	s_load_dwordx2 s[0:1], s[4:5], 0x0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[0:3], v4, s[0:1]
	global_load_ushort v5, v4, s[0:1]
	v_fmac_f32_e32 v6, v0, v1
	s_cbranch_scc1 .LBB0_1
; %bb.2:
	s_endpgm
"""


def test_main_loop_of_sass_and_amdgcn():
    code = parse_sass(SASS)
    assert code.total.instructions == 9
    loop = code.loop
    assert (loop.instructions, loop.global_loads, loop.load_bytes) == (6, 2, 18)
    assert (loop.shuffles, loop.barriers) == (1, 1)
    code = parse_amdgcn(AMDGCN)
    assert code.total.instructions == 6
    assert (code.loop.instructions, code.loop.load_bytes, dict(code.loop.widths)) == (4, 18, {16: 1, 2: 1})


TWO_LOOPS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   LDG.E.64 R4, desc[UR4][R2.64] ;
        /*0120*/                   FFMA R9, R4, R5, R9 ;
        /*0130*/              @!P0 BRA 0x110 ;
        /*0140*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0150*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0160*/                   FFMA R9, R4, R5, R9 ;
        /*0170*/                   FFMA R9, R4, R5, R9 ;
        /*0180*/              @!P0 BRA 0x140 ;
        /*0190*/                   EXIT ;
"""


def test_kernel_with_two_loops():
    # programs that take different branches: both loops, the one loading more bytes per pass first
    code = parse_sass(TWO_LOOPS)
    assert [(b.instructions, b.load_bytes) for b in code.loops] == [(5, 32), (3, 8)]
    assert code.loop is code.loops[0]
    # the launch's figure: all programs' passes through their loops over the weight bytes they stream
    loops = [
        LoopRow("a", programs=3, instructions=10, loads={}, unroll=1, passes=2, instructions_per_weight_byte=None,
                weight_bytes=40, program_bytes=0),
        LoopRow("b", programs=1, instructions=5, loads={}, unroll=1, passes=4, instructions_per_weight_byte=None,
                weight_bytes=10, program_bytes=0),
    ]  # fmt: skip
    warp_instructions = 2 * (3 * 2 * 10 + 1 * 4 * 5)
    assert _launch_ipb(loops, warps=2) == round(warp_instructions / (3 * 2 * 40 + 1 * 4 * 10), 3)


def test_mxfp4_experts_plan_same_launches_and_their_bytes(tmp_path):
    # ds4's files that keep the official FP4 experts: the same launches, and per layer 6 experts each reading
    # 3 matrices of 2048 x 4096 in 17-byte blocks of 32 instead of IQ2_XXS (66 B / 256) and Q2_K (84 B / 256)
    flags = ("--ctx", "2048", "--batch", "1", "--precision", "fast", "--layers", "2")
    q2, mx = (_plan(tmp_path, "--preset", preset, *flags)["totals"] for preset in ("flash", "flash-mxfp4"))
    assert mx["launches"] == q2["launches"]
    g = 2048 * 4096
    extra = 2 * 6 * (3 * g * 17 / 32 - (2 * g * 66 / 256 + g * 84 / 256))
    assert abs((mx["weight_GB_per_step"] - q2["weight_GB_per_step"]) - extra / 1e9) < 2e-3


def test_decode_expert_loops_are_declared_as_compiled():
    """The fp32 and tensor-core decode forms run the gate's loop, then the up's (`moe_experts._rows_dot`),
    so each declared loop streams one matrix's rows a pass; the int8 form runs one loop over both. The
    fp32 IQ2_XXS loop loads a row's activations in every row's threads: 16 rows of 256 floats a pass."""
    from dwarfstar.backends.triton.kernels.moe_experts import _decode_loops
    from dwarfstar.gguf.constants import GGMLType

    rows, block = 16, 66  # IQ2_XXS: 66 bytes per 256 columns
    shape = dict(programs=10, matrices=2, wtype=GGMLType.IQ2_XXS, bn=rows, row_bytes=16 * block, k_in=4096, bk=256,
                 t=1, x_bytes=4)  # fmt: skip
    for fast in (False, True):
        gate, up = _decode_loops("routed", fast=fast, **shape)
        assert (gate.name, up.name) == ("routed IQ2_XXS gate", "routed IQ2_XXS up")
        assert gate.weight_bytes == up.weight_bytes == rows * block
        assert gate.passes == 4096 // 256
    exact = _decode_loops("routed", fast=False, **shape)[0]
    assert exact.loads >= rows * block + rows * 256 * 4
    (both,) = _decode_loops("routed", fast=False, q8=True, **shape)
    assert both.name == "routed IQ2_XXS gate/up" and both.weight_bytes == 2 * rows * block
