"""The engine a command's `EngineSpec` describes, started for the command line: loaded under a progress
bar, joined to its route when the process is a pipeline stage (a worker serves its layers and exits
here; a coordinator's engine runs through the route), and the closing lines of a chat."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from dwarfstar.backends.protocol import Backend
    from dwarfstar.console.terminal import Speed
    from dwarfstar.distributed.route import Route
    from dwarfstar.engine.load import Engine
    from dwarfstar.engine.spec import EngineSpec


def start(spec: EngineSpec) -> tuple[Engine, Route | None]:
    """Load the engine; on a coordinator also its route (the caller closes it), whose sessions are at
    most the spec's context (the model's when it is longer)."""
    from dwarfstar.console.terminal import loading
    from dwarfstar.engine.load import load_engine

    with loading(spec.model) as progress:
        engine = load_engine(spec, progress)
    held = engine.model.args.max_seq_len
    return engine, join_route(engine, spec, min(spec.ctx or held, held))


def join_route(engine: Engine, spec: EngineSpec, ctx: int) -> Route | None:
    """A worker serves its layers here and exits when its coordinator shuts it down; a coordinator's
    engine gets the route as its backend (the returned route). With MTP speculation the last worker
    loads the block and drafts, and the coordinator requires it."""
    from dwarfstar.engine.launch import distribute, run_worker

    dist = spec.dist
    if dist is None:
        return None
    if dist.role == "worker":
        run_worker(engine, dist, ctx, spec.speculation)
        raise typer.Exit(0)
    return distribute(engine, replace(dist, mtp=spec.speculation is not None), ctx)


def closing_lines(engine: Engine, paced: Backend, power: int, prefill: Speed, decode: Speed) -> None:
    """After a chat: load, prefill and decode speed (with the idle time of --power), and the expert
    cache's figures under --ssd-streaming."""
    from dwarfstar.console.terminal import note, summary_line
    from dwarfstar.session.throttle import ThrottledBackend

    if prefill.tokens:
        idle = (power, paced.duty.slept_s) if isinstance(paced, ThrottledBackend) else None
        note(summary_line(engine.load_seconds, prefill, decode, idle))
    if engine.experts is not None:
        note(describe_experts(engine.experts.stats.summary(len(engine.experts.where), engine.experts.capacity)))


def describe_experts(summary: dict) -> str:
    """The exit-summary line of a streamed run."""
    return (
        f"experts: hit {summary['hit_rate']:.1%} | {summary['bytes_per_token'] / 1e6:.2f} MB read/token | "
        f"miss p50 {summary['miss_latency_p50_ms']:.2f} ms p99 {summary['miss_latency_p99_ms']:.2f} ms | "
        f"resident {summary['resident_experts']}/{summary['capacity_experts']} | "
        f"waited {summary['stall_seconds']:.2f} s for reads"
    )
