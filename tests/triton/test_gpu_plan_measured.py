"""gpu-plan's time model against the first decode step measured on an H200 (tests/data/h200): the
kernels' modelled times, from the inputs the compiled code gave the planner, against the times the
profiler measured for the same kernels and launch shapes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dwarfstar.backends.triton.plan import predict

MEASURED = json.loads((Path(__file__).parents[1] / "data" / "h200" / "decode-exact-2026-12-04.json").read_text())


def _modelled(kernel: dict, gpu: predict.GPUFigures = predict.H200) -> float:
    timing = predict.launch_time(
        gpu, kernel["programs"], kernel["warps"] or 4, kernel["registers"], kernel["shared"], kernel["bytes"],
        kernel["program_loads"], kernel["total_instructions"],
    )  # fmt: skip
    return timing.seconds * 1e6


def _step(batch: int) -> list[dict]:
    step = next(s for s in MEASURED["steps"] if s["batch"] == batch)
    return [k for k in step["kernels"] if k["measured_us_per_launch"] is not None]


def test_the_modelled_step_is_within_a_sixth_of_the_measured_one():
    for batch in (1, 4):
        kernels = _step(batch)
        modelled = sum(k["launches"] * _modelled(k) for k in kernels)
        measured = sum(k["launches"] * k["measured_us_per_launch"] for k in kernels)
        assert abs(modelled / measured - 1) < 1 / 6, (batch, modelled, measured)


def test_without_the_stall_the_model_was_three_times_too_fast():
    """The figure the stall was fitted for: a scheduler issuing every cycle whatever its warps (the
    model before the measurement) puts the same kernels at under a third of their measured time."""
    eager = replace(predict.H200, stall=1.0)
    for batch in (1, 4):
        kernels = _step(batch)
        modelled = sum(k["launches"] * _modelled(k, eager) for k in kernels)
        measured = sum(k["launches"] * k["measured_us_per_launch"] for k in kernels)
        assert modelled < measured / 3, (batch, modelled, measured)


def test_the_expert_kernels_are_within_a_factor_of_two():
    # the routed experts' two launches are most of the step (55% at batch 1, 70% at batch 4)
    for batch in (1, 4):
        for kernel in _step(batch):
            if kernel["kernel"] in ("_decode_gate_up_kernel", "_decode_down_kernel"):
                ratio = _modelled(kernel) / kernel["measured_us_per_launch"]
                assert 0.5 < ratio < 2, (batch, kernel["kernel"], ratio)
