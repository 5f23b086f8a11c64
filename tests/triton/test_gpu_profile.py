"""gpu_profile's reading of a profiler trace: kernel records grouped by name and launch shape, per step."""

from __future__ import annotations

from dwarfstar.backends.triton.gpu_profile import kernel_rows


def _kernel(name: str, dur: float, grid: list[int], **args) -> dict:
    return {"cat": "kernel", "name": name, "dur": dur, "args": {"grid": grid, "block": [128, 1, 1], **args}}


def test_kernels_grouped_by_name_and_grid_per_step():
    # two steps: a GEMV of two weights (grids 2048 and 512), an expert kernel, and records that are not kernels
    events = [
        _kernel("_qmatmul_kernel", 10.0, [2048, 1, 1], **{"registers per thread": 72}),
        _kernel("_qmatmul_kernel", 4.0, [512, 1, 1]),
        _kernel("_decode_gate_up_kernel", 30.0, [64, 7, 1], **{"est. achieved occupancy %": 13}),
        _kernel("_qmatmul_kernel", 12.0, [2048, 1, 1]),
        _kernel("_qmatmul_kernel", 4.0, [512, 1, 1]),
        _kernel("_decode_gate_up_kernel", 40.0, [64, 7, 1]),
        {"cat": "cpu_op", "name": "aten::copy_", "dur": 500.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 8.0},
    ]
    rows, device_us = kernel_rows(events, steps=2, batch=1, ctx=2048, precision="exact")
    assert device_us == (10 + 4 + 30 + 12 + 4 + 40) / 2
    assert [(r["kernel"], r["grid"]) for r in rows] == [
        ("_decode_gate_up_kernel", "[64,7,1]"), ("_qmatmul_kernel", "[2048,1,1]"), ("_qmatmul_kernel", "[512,1,1]"),
    ]  # fmt: skip
    gate_up, gemv, small = rows
    assert (gate_up["launches/step"], gate_up["us/step"], gate_up["us/launch"]) == (1.0, 35.0, 35.0)
    assert gate_up["occupancy%"] == 13 and gemv["registers"] == 72 and small["registers"] == ""
    assert (gemv["us/step"], gemv["us/launch"], small["us/step"]) == (11.0, 11.0, 4.0)
    assert abs(sum(r["%device"] for r in rows) - 100) < 0.05
    assert {r["precision"] for r in rows} == {"exact"} and {r["ctx"] for r in rows} == {2048}


def test_a_trace_without_kernel_records_gives_no_rows():
    rows, device_us = kernel_rows([{"cat": "cpu_op", "name": "aten::mm", "dur": 3.0}], 4, 1, 2048, "fast")
    assert rows == [] and device_us == 0
