"""`dwarfstar bench gpu-plan`: the decode step as the GPU would run it, measured without one.

Records one captured decode step at the real shapes (`recorder`), compiles each Triton kernel
variant it launches for the target (`target`), reads the machine code (`disasm`) and models the time
per token at stated figures (`predict`). Every row is grouped by kernel variant and launch shape.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dwarfstar.backends.triton.plan import disasm, predict
from dwarfstar.backends.triton.plan.recorder import Launch, record_decode_step
from dwarfstar.backends.triton.plan.target import activate, parse_target, usage, wide_loads

MODEL_NOTE = "MODEL, not a measurement: launches counted and code compiled without a GPU, time from stated figures"


@dataclass
class Row:
    """Launches of one kernel variant with one shape in a step."""

    kind: str
    kernel: str
    variant: str  # the constexprs and warps
    launches: int = 0
    programs: int = 0
    warps: int = 0
    registers: int = 0
    spills: int = 0
    shared: int = 0
    wide_loads: int = 0  # 128-bit global loads in the code
    loop_instructions: int = 0  # warp-instructions per pass of the main loop
    loop_loads: dict = field(default_factory=dict)  # bytes per lane -> global loads per pass
    unroll: int = 1  # source iterations per compiled pass
    instructions_per_weight_byte: float | None = None  # main loop, warp-instructions
    in_flight_bytes: int = 0  # over the whole chip, from resident programs
    weight_bytes: int = 0  # per launch
    bytes: int = 0  # per launch
    seconds: float = 0.0  # per step, all launches
    memory_s: float = 0.0  # per launch
    issue_s: float = 0.0  # per launch
    total_instructions: int = 0  # warp-instructions per launch
    program_loads: int = 0  # bytes one program loads per pass of its main loop


@dataclass
class Plan:
    preset: str
    target: str
    gpu: str
    batch: int
    ctx: int
    n_layers: int
    weight_bytes: int  # one step reads
    rows: list[Row]
    compiled: bool = True  # False: launches counted only, times as if every launch ran at full bandwidth
    note: str = MODEL_NOTE

    @property
    def launches(self) -> int:
        return sum(r.launches for r in self.rows)

    def launches_of(self, kind: str) -> int:
        return sum(r.launches for r in self.rows if r.kind == kind)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    def totals(self) -> dict:
        gpu = predict.FIGURES[self.target.split(":")[0]]
        step = self.seconds
        return {
            "launches": self.launches,
            "triton_launches": self.launches_of("triton"),
            "torch_launches": self.launches_of("torch"),
            "launches_per_layer": round(self.launches / self.n_layers, 1),
            "predicted_ms_per_step": round(step * 1e3, 3),
            "predicted_tok_s": round(self.batch / step, 1),
            "weight_GB_per_step": round(self.weight_bytes / 1e9, 3),
            "ceiling_tok_s_datasheet": round(gpu.datasheet_bandwidth / self.weight_bytes * self.batch, 1),
            "ceiling_tok_s_measured_copy": round(gpu.bandwidth / self.weight_bytes * self.batch, 1),
            "predicted_pct_of_datasheet_ceiling": round(100 * self.weight_bytes / step / gpu.datasheet_bandwidth, 1),
        }


def _work(launch: Launch):
    module = importlib.import_module(launch.fn.fn.__module__)
    work = getattr(module, "launch_work", None)
    return work(launch.name, launch.args) if work else None


def _variant(launch: Launch) -> str:
    consts = {k: v for k, v in launch.args.items() if k[:1].isupper() or k in ("num_warps", "num_stages")}
    return " ".join(f"{k}={v}" for k, v in consts.items())


def build_plan(
    preset: str, batch: int, ctx: int, target: str, compile_kernels: bool = True, layers: int | None = None
) -> Plan:
    """Record, compile and model one decode step for `target` (this process compiles for it only)."""
    gpu_target = parse_target(target)
    activate(gpu_target)
    gpu = predict.FIGURES[gpu_target.backend]
    step = record_decode_step(preset, batch, ctx, layers)
    rows: dict[tuple, Row] = {}
    compiled: dict[int, tuple] = {}
    for launch in step.launches:
        if launch.kind == "torch":
            row = rows.setdefault(("torch", launch.name), Row("torch", launch.name, ""))
            timing = predict.launch_time(gpu, 1, 1, 0, 0, launch.bytes, 0, 0)
            row.launches += 1
            row.bytes = max(row.bytes, launch.bytes)
            row.seconds += timing.seconds
            continue
        work = _work(launch)
        key = ("triton", launch.name, _variant(launch), launch.programs, work)
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row("triton", launch.name, _variant(launch), programs=launch.programs)
            if compile_kernels:
                _analyse(row, launch, work, gpu, gpu_target.backend, compiled)
        row.launches += 1
        row.seconds += _time(row, gpu, work)
    rows_ = list(rows.values())
    return Plan(preset, target, gpu.name, batch, ctx, step.n_layers, step.weight_bytes, rows_, compile_kernels)


def _analyse(row: Row, launch: Launch, work, gpu, backend: str, compiled: dict) -> None:
    args, grid, kwargs = launch.call
    kernel = launch.fn.run(*args, grid=grid, warmup=True, **kwargs)
    if kernel.hash not in compiled:
        compiled[kernel.hash] = (usage(kernel, backend), disasm.parse(kernel, backend), wide_loads(kernel, backend))
    (regs, spills), code, wide = compiled[kernel.hash]
    meta = kernel.metadata
    row.warps, row.registers, row.spills, row.shared, row.wide_loads = meta.num_warps, regs, spills, meta.shared, wide
    row.variant += f" warps={meta.num_warps} stages={meta.num_stages}"
    loop = code.loop
    program_loads = loop.load_bytes * gpu.lanes * row.warps if loop else 0
    if loop:
        row.loop_instructions = loop.instructions
        row.loop_loads = dict(sorted(loop.widths.items()))
    if work is not None:
        row.weight_bytes, row.bytes = work.weight_bytes, work.bytes
        if loop and work.loop_bytes:
            row.unroll = max(1, round(program_loads / work.loop_bytes))
            passes = max(1, work.iterations // row.unroll)
            weight_per_pass = work.weight_bytes / (launch.programs * passes)
            row.instructions_per_weight_byte = round(loop.instructions * row.warps / weight_per_pass, 3)
    straight = code.total.instructions - (loop.instructions if loop else 0)
    passes = max(1, work.iterations // row.unroll) if work is not None and loop else 1
    per_warp = straight + (loop.instructions * passes if loop else 0)
    row.total_instructions = launch.programs * row.warps * per_warp
    row.program_loads = program_loads


def _time(row: Row, gpu, work) -> float:
    moved = work.bytes if work is not None else 0
    timing = predict.launch_time(
        gpu, row.programs, row.warps or 4, row.registers, row.shared, moved, row.program_loads, row.total_instructions
    )
    row.memory_s, row.issue_s, row.in_flight_bytes = timing.memory, timing.issue, timing.in_flight
    return timing.seconds


def plan_json(plan: Plan) -> dict:
    return {
        "note": plan.note,
        "preset": plan.preset,
        "target": plan.target,
        "gpu_figures": asdict(predict.FIGURES[plan.target.split(":")[0]]),
        "batch": plan.batch,
        "ctx": plan.ctx,
        "layers": plan.n_layers,
        "totals": plan.totals(),
        "compiled": plan.compiled,
        "rows": [asdict(r) for r in sorted(plan.rows, key=lambda r: -r.seconds)],
    }


def format_plan(plan: Plan, top: int = 40) -> str:
    from dwarfstar.backends.triton.bench import format_table

    totals = plan.totals()
    step = plan.seconds
    lines = [
        f"{plan.preset} decode step, batch {plan.batch}, context {plan.ctx}, {plan.n_layers} layers, "
        f"compiled for {plan.target}, timed at {plan.gpu}'s stated figures",
        f"** {plan.note} **" + ("" if plan.compiled else " (not compiled: times assume full bandwidth)"),
        "launches per step {launches} (Triton {triton_launches}, torch {torch_launches}), "
        "{launches_per_layer} per layer".format(**totals),
        "predicted {predicted_ms_per_step} ms per step, {predicted_tok_s} tok/s; weights {weight_GB_per_step} GB "
        "per step; ceiling {ceiling_tok_s_datasheet} tok/s at the datasheet bandwidth "
        "({ceiling_tok_s_measured_copy} at the measured copy rate): {predicted_pct_of_datasheet_ceiling}% "
        "of it".format(**totals),
        "",
    ]
    table = []
    for r in sorted(plan.rows, key=lambda r: -r.seconds)[:top]:
        table.append({
            "kernel": r.kernel if r.kind == "triton" else f"torch {r.kernel}",
            "launches": r.launches,
            "programs": r.programs,
            "warps": r.warps,
            "regs": r.registers,
            "spill": r.spills,
            "loads/pass": " ".join(f"{n}x{w}B" for w, n in r.loop_loads.items()) or "-",
            "instr/B": r.instructions_per_weight_byte if r.instructions_per_weight_byte is not None else "-",
            "in flight KB": round(r.in_flight_bytes / 1024) if r.in_flight_bytes else "-",
            "MB/launch": round(r.bytes / 1e6, 2),
            "us/step": round(r.seconds * 1e6, 1),
            "share %": round(100 * r.seconds / step, 1),
        })  # fmt: skip
    lines.append(format_table(table))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dwarfstar.backends.triton.plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="flash", help="flash, pro (q2 experts), or a synthetic preset name")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--target", default="cuda:90", help="cuda:90 or hip:gfx942")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="count launches only")
    parser.add_argument("--json", default=None, help="write the plan as JSON here")
    opts = parser.parse_args(argv)
    preset = {"flash": "flash-q2", "pro": "pro-q2"}.get(opts.preset, opts.preset)
    plan = build_plan(preset, opts.batch, opts.ctx, opts.target, not opts.no_compile, opts.layers)
    print(format_plan(plan), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(plan_json(plan), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
