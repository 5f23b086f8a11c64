"""`dwarfstar bench kernels` and `dwarfstar bench synthetic`: the Triton backend on a GPU.

`kernels` times every Triton kernel on the shapes of Flash (or PRO) and prints a table with GB/s,
TFLOP/s and the percentage of the device's peak (from a table of known GPUs or `--peak-gbs`), and the
same rows as CSV. `synthetic` builds a full-size random quantized model in device memory (no file)
and measures decode tok/s at the given contexts and prefill tok/s on a prompt. Both need a CUDA or
ROCm GPU: in Triton's interpreter the timings would measure Python. Triton is imported only when a
command runs, so the CLI loads without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.flags import output
from dwarfstar.errors import DwarfStarError


def _require_gpu() -> None:
    from dwarfstar.backends.triton import triton_available

    if not triton_available():
        raise DwarfStarError("the Triton benchmarks need a CUDA or ROCm GPU and the triton package")


@bench_app.command("kernels")
def bench_kernels(
    model: Annotated[str, typer.Option(help="Shapes of: flash or pro.")] = "flash",
    ctx: Annotated[int, typer.Option(help="Context of the decode attention and indexer cases.")] = 32768,
    prefill: Annotated[int, typer.Option(help="Tokens of the prefill cases.")] = 2048,
    only: Annotated[str, typer.Option(help="Comma-separated kernel files to run (default: all).")] = "",
    peak_gbs: Annotated[float | None, typer.Option(help="Device memory bandwidth in GB/s.")] = None,
    csv_out: Annotated[Path | None, output("--csv", help="CSV file (default: printed after the table).")] = None,
) -> None:
    """Time each Triton kernel: microseconds, GB/s, TFLOP/s and % of the device's peak."""
    if model not in ("flash", "pro"):
        raise DwarfStarError(f"--model must be flash or pro, got {model!r}")
    _require_gpu()
    from dwarfstar.backends.triton import gpu_bench
    from dwarfstar.backends.triton.runtime import default_device

    device = default_device()
    peak = gpu_bench.device_peak(device, peak_gbs)
    typer.echo(f"{peak.device}: peak {peak.gbs or '?'} GB/s, {peak.tflops or '?'} bf16 TFLOP/s")
    kernels = [k for k in only.split(",") if k]
    unknown = sorted(set(kernels) - set(gpu_bench.KERNELS))
    if unknown:
        raise DwarfStarError(f"unknown kernel files {unknown}; choose from {', '.join(gpu_bench.KERNELS)}")
    rows = gpu_bench.run_kernels(gpu_bench.bench_shape(model, device, ctx, prefill), peak, kernels)
    typer.echo(gpu_bench.format_table(rows))
    gpu_bench.write_csv(rows, csv_out)


@bench_app.command("synthetic")
def bench_synthetic(
    model: Annotated[str, typer.Argument(help="flash-q2, flash-q4 or pro-q2.")] = "flash-q2",
    layers: Annotated[int | None, typer.Option(help="Build only the first N layers (q4 and PRO need it).")] = None,
    ctx: Annotated[str, typer.Option(help="Comma-separated decode contexts.")] = "2048,32768",
    steps: Annotated[int, typer.Option(min=1, help="Decode steps timed per context.")] = 64,
    prompt: Annotated[int, typer.Option(help="Prefill prompt tokens (0: skip the prefill).")] = 8192,
    chunk: Annotated[int, typer.Option(min=1, help="Prefill chunk.")] = 4096,
    peak_gbs: Annotated[float | None, typer.Option(help="Device memory bandwidth in GB/s.")] = None,
    precision: Annotated[
        str, typer.Option(help="Decode precision: exact, fast, or exact,fast (a pass each).")
    ] = "exact",
    csv_out: Annotated[Path | None, output("--csv", help="CSV file for the decode rows.")] = None,
) -> None:
    """Decode and prefill speed of a full-size synthetic model built in device memory."""
    _require_gpu()
    from dwarfstar.backends.triton import gpu_bench
    from dwarfstar.backends.triton.runtime import FAST, default_device
    from dwarfstar.backends.triton.synthetic import PRESETS, synthetic_weights

    if model not in PRESETS:
        raise DwarfStarError(f"unknown synthetic model {model!r}; choose one of {', '.join(PRESETS)}")
    try:
        contexts = [int(c) for c in ctx.split(",") if c]
    except ValueError as exc:
        raise DwarfStarError(f"--ctx must be comma-separated integers, got {ctx!r}") from exc
    try:
        decode_precisions = gpu_bench.precisions(precision)
    except ValueError as exc:
        raise DwarfStarError(str(exc)) from None
    device = default_device()
    peak = gpu_bench.device_peak(device, peak_gbs)
    weights = synthetic_weights(model, layers, device)
    rows = [
        row
        for p in decode_precisions
        for row in gpu_bench.run_decode(model, layers, contexts, steps, device, peak, weights=weights, precision=p)
    ]
    typer.echo(gpu_bench.format_table(rows))
    if csv_out:
        gpu_bench.write_csv(rows, csv_out)
    if prompt:
        typer.echo(
            gpu_bench.format_table(gpu_bench.run_prefill(model, layers, prompt, chunk, device, FAST, weights=weights))
        )


@bench_app.command("gpu-plan")
def bench_gpu_plan(
    preset: Annotated[
        str, typer.Option(help="flash or pro (V4), or v41 (V4.1 Flash, uncaptured); q2 experts, as ds4's files.")
    ] = "flash",
    experts: Annotated[
        str, typer.Option(help="Routed-expert types: q2 (IQ2_XXS gate/up, Q2_K down) or mxfp4 (flash only).")
    ] = "q2",
    ctx: Annotated[int, typer.Option(min=1, help="Context of the decode step.")] = 2048,
    batch: Annotated[int, typer.Option(min=1, max=64, help="Sequences decoding together.")] = 1,
    target: Annotated[str, typer.Option(help="GPU target: cuda:90 (H100/H200) or hip:gfx942 (MI300X).")] = "cuda:90",
    layers: Annotated[
        int | None, typer.Option(min=1, help="Only the first N layers (v41: Flash's layout scaled to N >= 4).")
    ] = None,
    precision: Annotated[str, typer.Option(help="The matrices' precision: exact (fp32) or fast.")] = "exact",
    no_compile: Annotated[bool, typer.Option("--no-compile", help="Count launches only.")] = False,
    json_out: Annotated[Path | None, output("--json", help="Write the plan as JSON here.")] = None,
) -> None:
    """The decode step as the GPU would run it, without one: launches, compiled code, modelled time."""
    import json
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise DwarfStarError("gpu-plan compiles for a GPU target: run it without TRITON_INTERPRET=1")
    if preset not in ("flash", "pro", "v41"):
        raise DwarfStarError(f"--preset must be flash, pro or v41, got {preset!r}")
    if precision not in ("exact", "fast"):
        raise DwarfStarError(f"--precision must be exact or fast, got {precision!r}")
    if experts not in ("q2", "mxfp4") or (experts == "mxfp4" and preset != "flash"):
        raise DwarfStarError(f"--experts must be q2, or mxfp4 with the flash preset, got {experts!r} for {preset}")
    from dwarfstar.backends.triton.plan.report import build_plan, format_plan, plan_json

    try:
        name = preset if preset == "v41" else f"{preset}-{experts}"
        plan = build_plan(name, batch, ctx, target, not no_compile, layers, precision)
    except ValueError as exc:
        raise DwarfStarError(str(exc)) from exc
    typer.echo(format_plan(plan))
    if json_out is not None:
        json_out.write_text(json.dumps(plan_json(plan), indent=1))
