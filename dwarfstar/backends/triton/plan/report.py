"""`dwarfstar bench gpu-plan`: the decode step as the GPU would run it, measured without one.

Records one captured decode step at the real shapes (`recorder`), compiles each Triton kernel
variant it launches for the target (`target`), reads the machine code (`disasm`) and models the time
per token at stated figures (`predict`). Every row is grouped by kernel variant and launch shape.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dwarfstar.backends.triton.plan import disasm, predict
from dwarfstar.backends.triton.plan.recorder import DecodeStep, Launch, record_decode_step
from dwarfstar.backends.triton.plan.target import activate, parse_target, usage, wide_loads
from dwarfstar.backends.triton.plan.uncaptured import Uncaptured
from dwarfstar.backends.triton.runtime import KernelWork, LoopWork

MODEL_NOTE = "MODEL, not a measurement: launches counted and code compiled without a GPU, time from stated figures"


@dataclass
class LoopRow:
    """One declared loop of a kernel (`runtime.LoopWork`) and the compiled loop it was paired with."""

    name: str
    programs: int
    instructions: int  # warp-instructions per compiled pass
    loads: dict  # bytes per lane -> global loads per compiled pass
    unroll: int  # source iterations per compiled pass
    passes: int  # compiled passes per program
    instructions_per_weight_byte: float | None
    weight_bytes: float  # weight bytes one program streams per compiled pass
    program_bytes: int  # bytes one program streams per compiled pass
    in_flight_bytes: int = 0  # over the whole chip: its share of the resident programs


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
    loop_instructions: int = 0  # warp-instructions per pass of the main loop (of several: streaming the most weights)
    loop_loads: dict = field(default_factory=dict)  # bytes per lane -> global loads per pass
    unroll: int = 1  # source iterations per compiled pass
    # warp-instructions per weight byte in the loops: the main loop's, or over all of them where the
    # programs run different loops (`_launch_ipb`; each loop's own figure in `loops`)
    instructions_per_weight_byte: float | None = None
    in_flight_bytes: int = 0  # over the whole chip, from resident programs
    weight_bytes: int = 0  # per launch
    bytes: int = 0  # per launch
    seconds: float = 0.0  # per step, all launches
    memory_s: float = 0.0  # per launch
    issue_s: float = 0.0  # per launch
    gathers_s: float = 0.0  # per launch: the cache lines its table lookups touch (`predict.gather_lines`)
    total_instructions: int = 0  # warp-instructions per launch
    program_loads: int = 0  # bytes one program loads per pass of its main loop
    loops: list[LoopRow] = field(default_factory=list)  # each declared loop, the most bytes loaded per pass first


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
    precision: str = "exact"
    compiled: bool = True  # False: launches counted only, times as if every launch ran at full bandwidth
    note: str = MODEL_NOTE
    uncaptured: Uncaptured | None = None  # a step no graph captures: its waits and host time
    per_layer: list[dict] = field(default_factory=list)  # launches of each layer, where recorded (`step41`)

    @property
    def launches(self) -> int:
        return sum(r.launches for r in self.rows)

    def launches_of(self, kind: str) -> int:
        return sum(r.launches for r in self.rows if r.kind == kind)

    @property
    def device_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def seconds(self) -> float:
        return self.uncaptured.seconds if self.uncaptured else self.device_seconds

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
        } | (self.uncaptured.totals() if self.uncaptured else {"captured": True})


def _work(launch: Launch):
    module = importlib.import_module(launch.fn.fn.__module__)
    work = getattr(module, "launch_work", None)
    return work(launch.name, launch.args) if work else None


def _variant(launch: Launch) -> str:
    consts = {k: v for k, v in launch.args.items() if k[:1].isupper() or k in ("num_warps", "num_stages")}
    return " ".join(f"{k}={v}" for k, v in consts.items())


def build_plan(
    preset: str,
    batch: int,
    ctx: int,
    target: str,
    compile_kernels: bool = True,
    layers: int | None = None,
    precision: str = "exact",
) -> Plan:
    """Record, compile and model one decode step for `target` (this process compiles for it only),
    its matrices at `precision` ("exact" or "fast"). Preset `v41`: V4.1's uncaptured step
    (`step41`), one sequence, exact."""
    gpu_target = parse_target(target)
    activate(gpu_target)
    gpu = predict.FIGURES[gpu_target.backend]
    step = _record(preset, batch, ctx, layers, gpu.multiprocessors, precision)
    uncaptured = None if step.captured else Uncaptured(host_reads=step.host_reads)
    rows: dict[tuple, Row] = {}
    compiled: dict[int, tuple] = {}
    for launch in step.launches:
        if launch.kind == "torch":
            row = rows.setdefault(("torch", launch.name), Row("torch", launch.name, ""))
            seconds = predict.launch_time(gpu, 1, 1, 0, 0, launch.bytes, 0, 0).seconds
            row.launches += 1
            row.bytes = max(row.bytes, launch.bytes)
        elif launch.kind == "triton":
            work = _work(launch)
            key = ("triton", launch.name, _variant(launch), launch.programs, work)
            row = rows.get(key)
            if row is None:
                row = rows[key] = Row("triton", launch.name, _variant(launch), programs=launch.programs)
                if compile_kernels:
                    _analyse(row, launch, work, gpu, gpu_target.backend, compiled)
            row.launches += 1
            seconds = _time(row, gpu, work)
        else:  # an upload or a host read: a wait of the uncaptured step, no launch
            seconds = 0.0
        if launch.kind in ("torch", "triton"):
            row.seconds += seconds
        if uncaptured is not None:
            uncaptured.add(launch, seconds)
    if uncaptured is not None:
        uncaptured.finish()
    rows_ = list(rows.values())
    return Plan(
        preset, target, gpu.name, batch, ctx, step.n_layers, step.weight_bytes, rows_, precision, compile_kernels,
        uncaptured=uncaptured, per_layer=_per_layer(step),
    )  # fmt: skip


def _per_layer(step: DecodeStep) -> list[dict]:
    if step.captured:
        return []
    from dwarfstar.backends.triton.plan.step41 import layer_launches

    return layer_launches(step)


def _record(preset: str, batch: int, ctx: int, layers: int | None, multiprocessors: int, precision: str) -> DecodeStep:
    if preset != "v41":
        return record_decode_step(preset, batch, ctx, layers, multiprocessors=multiprocessors, precision=precision)
    from dwarfstar.backends.triton.plan.step41 import record_decode_step41

    if batch != 1:
        raise ValueError(
            f"the V4.1 Triton backend runs a batch's sequences one after another (no batched step): its plan is "
            f"one sequence's step, --batch 1 (asked for {batch}); B sequences take B such steps"
        )
    if precision != "exact":
        raise ValueError(f"the V4.1 Triton backend runs its matrices exact only: --precision exact, got {precision!r}")
    return record_decode_step41(ctx, layers, multiprocessors)


def _declared(work: KernelWork, programs: int) -> list[LoopWork]:
    """A launch's loops, most bytes loaded per pass first: as declared, or the one main loop."""
    if work.loops:
        return sorted(work.loops, key=lambda lw: -(lw.loads or lw.streamed))
    weight = work.weight_bytes / max(1, programs * work.iterations) if work.loop_bytes else 0
    return [LoopWork("main", programs, work.iterations, weight, 0, work.loop_bytes)]


def _pairs(work: KernelWork, programs: int, bodies: list[disasm.Body], threads: int) -> list[tuple]:
    """(declared loop, compiled loop): the main loop with the compiled loop that loads the most per
    pass; declared loops each with the unpaired compiled loop whose bytes loaded per pass (over a
    program's `threads`) are nearest their own by ratio (a kernel's other loops, a final sum over
    slots say, load other amounts)."""
    bodies = [b for b in bodies if not b.finishing] or bodies  # a finishing loop is never a declared one
    if not work.loops:
        return list(zip(_declared(work, programs), bodies[:1], strict=False))
    free, pairs = list(bodies), []
    for lw in _declared(work, programs):
        if not free:
            break
        want = max(1, lw.loads or lw.streamed)
        body = min(free, key=lambda b: abs(math.log(max(1, b.load_bytes * threads) / want)))
        free.remove(body)
        pairs.append((lw, body))
    return pairs


def _analyse(row: Row, launch: Launch, work: KernelWork | None, gpu, backend: str, compiled: dict) -> None:
    args, grid, kwargs = launch.call
    kernel = launch.fn.run(*args, grid=grid, warmup=True, **kwargs)
    if kernel.hash not in compiled:
        compiled[kernel.hash] = (usage(kernel, backend), disasm.parse(kernel, backend), wide_loads(kernel, backend))
    (regs, spills), code, wide = compiled[kernel.hash]
    meta = kernel.metadata
    row.warps, row.registers, row.spills, row.shared, row.wide_loads = meta.num_warps, regs, spills, meta.shared, wide
    row.variant += f" warps={meta.num_warps} stages={meta.num_stages}"
    if code.loop:
        row.loop_instructions = code.loop.instructions
        row.loop_loads = dict(sorted(code.loop.widths.items()))
        row.program_loads = code.loop.load_bytes * gpu.lanes * row.warps
    if work is not None:
        row.weight_bytes, row.bytes = work.weight_bytes, work.bytes
        pairs = _pairs(work, launch.programs, code.loops, gpu.lanes * row.warps)
        row.loops = [_loop_row(lw, body, row.warps, gpu) for lw, body in pairs]
    per_warp = code.total.instructions - sum(lr.instructions for lr in row.loops)
    per_warp *= launch.programs
    for lr in row.loops:
        per_warp += lr.programs * lr.instructions * lr.passes
    row.total_instructions = row.warps * per_warp
    if row.loops:
        main = max(row.loops, key=lambda lr: lr.programs * lr.passes * lr.weight_bytes)  # streams the most weights
        row.unroll, row.loop_instructions, row.loop_loads = main.unroll, main.instructions, main.loads
        row.instructions_per_weight_byte = _launch_ipb(row.loops, row.warps)
        # what a program has in flight, on average over the launch's programs
        row.program_loads = sum(lr.programs * lr.program_bytes for lr in row.loops) // max(1, launch.programs)


def _launch_ipb(loops: list[LoopRow], warps: int) -> float | None:
    """Warp-instructions per weight byte over all of a launch's loops: every program's passes through
    its loop, over the weight bytes those passes stream (one loop: that loop's own figure)."""
    weight = sum(lr.programs * lr.passes * lr.weight_bytes for lr in loops)
    if not weight:
        return None
    return round(sum(lr.programs * lr.passes * lr.instructions * warps for lr in loops) / weight, 3)


def _loop_row(lw: LoopWork, body: disasm.Body, warps: int, gpu) -> LoopRow:
    loads = body.load_bytes * gpu.lanes * warps  # what one program's load instructions fetch per compiled pass
    unroll = max(1, round(loads / (lw.loads or lw.streamed))) if lw.loads or lw.streamed else 1
    per_pass = lw.weight_bytes * unroll
    ipb = round(body.instructions * warps / per_pass, 3) if per_pass else None
    streamed = lw.streamed * unroll if lw.streamed else loads
    passes = max(1, lw.passes // unroll)
    widths = dict(sorted(body.widths.items()))
    return LoopRow(lw.name, lw.programs, body.instructions, widths, unroll, passes, ipb, per_pass, streamed)


def _time(row: Row, gpu, work) -> float:
    moved = work.bytes if work is not None else 0
    lines = sum(
        lw.programs * lw.passes * predict.gather_lines(gpu, lookups, table)
        for lw in (work.loops if work is not None else ())
        for lookups, table in lw.gathers
    )
    timing = predict.launch_time(
        gpu, row.programs, row.warps or 4, row.registers, row.shared, moved, row.program_loads, row.total_instructions,
        lines,
    )  # fmt: skip
    row.memory_s, row.issue_s, row.gathers_s = timing.memory, timing.issue, timing.gathers
    row.in_flight_bytes = timing.in_flight
    everything = max(1, row.programs * row.program_loads)
    for lr in row.loops:  # each loop's share of the resident programs
        lr.in_flight_bytes = timing.in_flight * lr.programs * lr.program_bytes // everything
    return timing.seconds


def _bound(row: Row) -> str:
    """Which of a launch's modelled times is its time (`predict.launch_time`): the longest."""
    if row.kind != "triton" or not (row.memory_s or row.issue_s or row.gathers_s):
        return "-"
    return max((row.memory_s, "memory"), (row.issue_s, "issue"), (row.gathers_s, "gathers"))[1]


def plan_json(plan: Plan) -> dict:
    return {
        "note": plan.note,
        "preset": plan.preset,
        "target": plan.target,
        "gpu_figures": asdict(predict.FIGURES[plan.target.split(":")[0]]),
        "batch": plan.batch,
        "ctx": plan.ctx,
        "precision": plan.precision,
        "layers": plan.n_layers,
        "totals": plan.totals(),
        "compiled": plan.compiled,
        "captured": plan.uncaptured is None,
        "per_layer": plan.per_layer,
        "rows": [asdict(r) for r in sorted(plan.rows, key=lambda r: -r.seconds)],
    }


def format_plan(plan: Plan, top: int = 40) -> str:
    from dwarfstar.backends.triton.gpu_bench import format_table

    totals = plan.totals()
    step = plan.device_seconds  # the rows' shares: of the device's time
    lines = [
        f"{plan.preset} decode step ({plan.precision}), batch {plan.batch}, context {plan.ctx}, "
        f"{plan.n_layers} layers, "
        f"compiled for {plan.target}, timed at {plan.gpu}'s stated figures",
        f"** {plan.note} **" + ("" if plan.compiled else " (not compiled: times assume full bandwidth)"),
        "launches per step {launches} (Triton {triton_launches}, torch {torch_launches}), "
        "{launches_per_layer} per layer".format(**totals),
        *(plan.uncaptured.lines(plan.launches) if plan.uncaptured else []),
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
            "bound": _bound(r),
            "us/step": round(r.seconds * 1e6, 1),
            "share %": round(100 * r.seconds / step, 1),
        })  # fmt: skip
    lines.append(format_table(table))
    lines.append(
        "instr/B: SASS (AMDGCN) warp-instructions per weight byte in the main loop; for a kernel whose programs "
        "run different loops, over all its loops' passes (each loop below); the goal is <= 0.25 on sm_90; "
        "bound: what the model's time per launch is (memory, issue, or the cache lines table gathers touch)"
    )
    loops = [(r, lr) for r in sorted(plan.rows, key=lambda r: -r.seconds) if len(r.loops) > 1 for lr in r.loops]
    if loops:  # kernels whose programs take different branches: each loop
        lines += ["", "loops of kernels whose programs run different loops (per compiled pass):"]
        lines.append(format_table([{
            "kernel": r.kernel,
            "loop": lr.name,
            "programs": lr.programs,
            "regs": r.registers,
            "instr/pass": lr.instructions,
            "loads/pass": " ".join(f"{n}x{w}B" for w, n in lr.loads.items()) or "-",
            "unroll": lr.unroll,
            "instr/B": lr.instructions_per_weight_byte if lr.instructions_per_weight_byte is not None else "-",
            "KB/program": round(lr.program_bytes / 1024, 1),
            "in flight KB": round(lr.in_flight_bytes / 1024),
        } for r, lr in loops]))  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dwarfstar.backends.triton.plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="flash", help="flash, pro (q2 experts), v41, or a synthetic preset name")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--target", default="cuda:90", help="cuda:90 or hip:gfx942")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--precision", default="exact", choices=["exact", "fast"], help="the matrices' precision")
    parser.add_argument("--no-compile", action="store_true", help="count launches only")
    parser.add_argument("--json", default=None, help="write the plan as JSON here")
    opts = parser.parse_args(argv)
    preset = {"flash": "flash-q2", "pro": "pro-q2"}.get(opts.preset, opts.preset)
    plan = build_plan(preset, opts.batch, opts.ctx, opts.target, not opts.no_compile, opts.layers, opts.precision)
    print(format_plan(plan), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(plan_json(plan), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
