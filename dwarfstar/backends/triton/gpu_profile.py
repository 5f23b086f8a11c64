"""Where a decode step's time goes on the GPU: each kernel's measured share of a synthetic model's step.

    python -m dwarfstar.backends.triton.gpu_profile --synthetic flash-q2 --ctx 2048 --batch 1,4 --csv profile.csv

For each precision (`--decode-precision`, both by default) and batch size it times `--steps` decode
steps (graph replays, as `gpu_bench decode` runs them), then records as many more under torch's
profiler (CUPTI: the kernels inside a graph replay too) and reads the kernel records of its trace:
their device time per step against the step's wall time (where the device waits on the host, the
two differ), and per kernel (name, grid and block, so the GEMV of each weight is its own row) the
launches, microseconds per step and per launch, share of the device time, registers per thread and
the occupancy CUPTI estimates. These are measurements, unlike `dwarfstar bench gpu-plan`'s model of
the same step; the two side by side say where the model is wrong.

The rows go to `--csv` as each batch finishes. Runs with torch and triton alone (the GPU check's image).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from dwarfstar.backends.triton import gpu_bench

PROFILE_COLUMNS = (
    "batch", "ctx", "precision", "kernel", "grid", "block", "registers", "occupancy%", "launches/step", "us/step",
    "us/launch", "%device",
)  # fmt: skip


def kernel_rows(events: Iterable[dict], steps: int, batch: int, ctx: int, precision: str) -> tuple[list[dict], float]:
    """The kernel records of a Chrome trace (`cat` "kernel") over `steps` steps, grouped by (name, grid,
    block): one row each, longest first, and the device's kernel microseconds per step."""
    groups: dict[tuple, list[dict]] = {}
    for event in events:
        if event.get("cat") == "kernel":
            args = event.get("args", {})
            key = (event["name"], str(args.get("grid", "")), str(args.get("block", "")))
            groups.setdefault(key, []).append(event)
    device_us = sum(float(e["dur"]) for group in groups.values() for e in group) / steps
    rows = []
    for (name, grid, block), group in groups.items():
        us = sum(float(e["dur"]) for e in group) / steps
        args = group[0].get("args", {})
        rows.append({
            "batch": batch, "ctx": ctx, "precision": precision, "kernel": name[:80], "grid": grid.replace(" ", ""),
            "block": block.replace(" ", ""), "registers": args.get("registers per thread", ""),
            "occupancy%": args.get("est. achieved occupancy %", ""), "launches/step": round(len(group) / steps, 2),
            "us/step": round(us, 2), "us/launch": round(us * steps / len(group), 2),
            "%device": round(100 * us / device_us, 2) if device_us else "",
        })  # fmt: skip
    rows.sort(key=lambda row: -row["us/step"])
    return rows, device_us


def profile_decode(backend, tokens: list[list[int]], states, steps: int) -> tuple[list[dict], float]:
    """`steps` decode steps under the profiler: the trace's events (kernels among them) and the wall
    milliseconds per step they took there."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_ms = gpu_bench.step_seconds(backend, tokens, states, steps) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return events, wall_ms


def run(opts: argparse.Namespace) -> None:
    from dwarfstar.backends.triton.synthetic import synthetic_weights

    device = torch.device("cuda")
    contexts, batches = ([int(c) for c in text.split(",")] for text in (opts.ctx, opts.batch))
    weights = synthetic_weights(opts.synthetic, opts.layers, device)
    out = gpu_bench.CsvRows(opts.csv, PROFILE_COLUMNS)
    try:
        for precision in gpu_bench.precisions(opts.decode_precision):
            name = "fast" if precision.fast else "exact"
            backend = gpu_bench.decode_backend(weights, contexts, batches, 2 * opts.steps, opts.warmup, precision)
            for ctx, b in itertools.product(contexts, batches):
                tokens, states = gpu_bench.decode_inputs(backend, ctx, b)
                gpu_bench.step_seconds(backend, tokens, states, opts.warmup)  # compile, capture the graphs
                plain_ms = gpu_bench.step_seconds(backend, tokens, states, opts.steps) * 1e3
                events, wall_ms = profile_decode(backend, tokens, states, opts.steps)
                rows, device_us = kernel_rows(events, opts.steps, b, ctx, name)
                launches = sum(row["launches/step"] for row in rows)
                print(f"{name} batch {b} ctx {ctx}: {plain_ms:.3f} ms a step ({wall_ms:.3f} profiled), kernels "
                      f"{device_us / 1e3:.3f} ms of device time a step in {launches:.0f} launches",
                      flush=True)  # fmt: skip
                for row in rows[: opts.top]:
                    out(row)
                print(gpu_bench.format_table(rows[: opts.top]), flush=True)
                del states
            del backend
            gc.collect()
    finally:
        out.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dwarfstar.backends.triton.gpu_profile", description=__doc__)
    parser.add_argument("--synthetic", default="flash-q2", help="flash-q2, flash-q4 or pro-q2")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--ctx", default="2048")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--decode-precision", default="exact,fast", help="exact and/or fast, comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="steps timed, then as many profiled")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (the graphs are captured in them)")
    parser.add_argument("--top", type=int, default=60, help="rows kept per batch, longest first")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--dry", action="store_true", help="no device: the arguments, the imports, the CSV header")
    opts = parser.parse_args(argv)
    try:
        gpu_bench.precisions(opts.decode_precision)
    except ValueError as exc:
        parser.error(str(exc))
    return opts


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.dry:
        from torch.profiler import ProfilerActivity  # noqa: F401  (what the run imports)

        from dwarfstar.backends.triton.synthetic import synthetic_weights  # noqa: F401

        gpu_bench.CsvRows(opts.csv, PROFILE_COLUMNS).close()  # the header, as a run writes it first
        what = f"{opts.synthetic} at ctx {opts.ctx}, batch {opts.batch}, {opts.decode_precision}"
        print(f"dry: profile {what}", flush=True)
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile needs a CUDA or ROCm GPU (the profiler reads the device's kernel records)")
    with gpu_bench.tuning("first"):
        run(opts)


if __name__ == "__main__":
    main()
