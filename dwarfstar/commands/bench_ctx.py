"""`dwarfstar bench [options]`: prefill and decode speed across context sizes (ds4-bench's method).

It is the `bench` group's own callback, so `dwarfstar bench` runs it and `dwarfstar bench kv` (and
the other subcommands) run instead of it. The CSV goes to `--csv FILE` or stdout; the rows are also
shown on stderr as they come, with the achieved GB/s next to the decode speed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dwarfstar.commands.bench import bench_app
from dwarfstar.commands.dist_options import (
    DistAddr,
    DistBackend,
    DistBind,
    DistBits,
    DistDebug,
    DistLayers,
    DistPrefillChunk,
    DistPrefillWindow,
    DistRole,
    DistSecret,
    DistStages,
    DistTimeout,
    dist_options,
    join_route,
)
from dwarfstar.commands.prompt_tools import default_bench_text
from dwarfstar.commands.steer import DirSteeringAttn, DirSteeringFfn, DirSteeringFile, steering_options
from dwarfstar.engine import BACKENDS, load_engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.hub import resolve_model
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.speedbench import Row, frontiers, plot, read_bench_tokens, run_bench, weight_bytes_per_token, write_csv
from dwarfstar.terminal import loading, note, stderr_console
from dwarfstar.throttle import throttle


def _row_line(row: Row) -> str:
    return (
        f"ctx {row.ctx_tokens:>7}: prefill {row.prefill_tokens} tok at {row.prefill_tps:9.2f} tok/s | "
        f"gen {row.gen_tokens} tok at {row.gen_tps:8.2f} tok/s = {row.gen_gbps:7.2f} GB/s | "
        f"KV {row.kvcache_bytes / 2**20:.1f} MiB"
    )


@bench_app.callback(invoke_without_command=True, no_args_is_help=False)
def bench(
    context: typer.Context,
    model: Annotated[Path | None, typer.Option("-m", "--model", help="GGUF model (default: ./ds4flash.gguf).")] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option("--prompt-file", "--text-file", help="Benchmark text (default: shared promessi_sposi.txt)."),
    ] = None,
    ctx_start: Annotated[int, typer.Option(help="First frontier (tokens).")] = 2048,
    ctx_max: Annotated[int, typer.Option(help="Last frontier (tokens).")] = 32768,
    ctx_alloc: Annotated[
        int | None, typer.Option(help="Context to allocate (default: ctx-max + gen-tokens + 1).")
    ] = None,
    step_incr: Annotated[int, typer.Option(help="Linear step between frontiers.")] = 2048,
    step_mul: Annotated[float, typer.Option(help="Multiplicative step (> 1 replaces --step-incr).")] = 1.0,
    gen_tokens: Annotated[
        int, typer.Option("--gen-tokens", "-n", "--tokens", min=1, help="Greedy tokens decoded per frontier.")
    ] = 128,
    csv_out: Annotated[Path | None, typer.Option("--csv", help="CSV output file (default: stdout).")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Also draw tok/s against context (PNG).")] = None,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
    power: Annotated[int, typer.Option(min=1, max=100, help="Keep the device about N% busy.")] = 100,
    dir_steering_file: DirSteeringFile = None,
    dir_steering_ffn: DirSteeringFfn = None,
    dir_steering_attn: DirSteeringAttn = None,
    mtp: Annotated[
        bool, typer.Option("--mtp", help="Instead: MTP speculation, with and without (as `bench mtp`; -n tokens).")
    ] = False,
    mtp_drafts: Annotated[str, typer.Option(help="With --mtp: draft counts, comma-separated.")] = "1,2,3",
    dist_role: DistRole = None,
    layers: DistLayers = None,
    dist_addr: DistAddr = None,
    dist_bind: DistBind = None,
    dist_stages: DistStages = 2,
    dist_activation_bits: DistBits = 32,
    dist_prefill_chunk: DistPrefillChunk = 4096,
    dist_prefill_window: DistPrefillWindow = 1,
    dist_timeout: DistTimeout = 600.0,
    dist_secret: DistSecret = "",
    dist_backend: DistBackend = "gloo",
    debug: DistDebug = False,
) -> None:
    """Prefill and decode speed at growing context sizes, ds4-bench style; subcommands measure other parts."""
    if context.invoked_subcommand is not None:
        return
    if mtp:
        from dwarfstar.commands.speculate import BENCH_PROMPT, mtp_bench

        mtp_bench(model, None, mtp_drafts, gen_tokens, BENCH_PROMPT, backend)
        return
    points = frontiers(ctx_start, ctx_max, step_incr, step_mul)
    steering = steering_options(dir_steering_file, dir_steering_ffn, dir_steering_attn)
    alloc = ctx_alloc or ctx_max + gen_tokens + 1
    text_path = prompt_file or default_bench_text()
    try:
        text = text_path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DwarfStarError(f"cannot read {text_path}: {exc.strerror or exc}") from None
    dist = dist_options(
        dist_role, layers, dist_addr, dist_bind, dist_stages, dist_activation_bits, dist_prefill_chunk,
        dist_prefill_window, dist_timeout, dist_secret, dist_backend, debug,
    )  # fmt: skip
    path = resolve_model(model)
    with loading(path) as progress:
        engine = load_engine(
            path, backend, ctx=alloc, progress=progress, steering=steering, layers=dist.stage_layers(path)
        )
    route = join_route(engine, dist, alloc)  # a worker serves its layers here and exits; a coordinator routes
    try:
        table = engine.model if route is None else _whole_table(path)
        tokens = read_bench_tokens(engine.tokenizer.encode, text, points[-1])
        note(
            f"{path.name} on {engine.backend_name}{'' if route is None else ' (a route)'}: {len(points)} frontiers "
            f"{points[0]}..{points[-1]}, {gen_tokens} gen tokens each; weights read per token "
            f"{weight_bytes_per_token(table) / 1e6:.1f} MB"
        )
        rows = _measure(engine.backend, table, tokens, points, gen_tokens, alloc, power)
        if table is not engine.model:
            table.close()
    finally:
        if route is not None:
            route.close()
    if csv_out is None:
        write_csv(rows, sys.stdout)
    else:
        with csv_out.open("w", encoding="utf-8") as out:
            write_csv(rows, out)
        note(f"wrote {csv_out}")
    if plot_out is not None:
        plot(rows, plot_out, f"{path.name} ({engine.backend_name}), {gen_tokens} gen tokens per frontier")
        note(f"wrote {plot_out}")


def _whole_table(path: Path) -> ModelFile:
    """The whole model's tensor table, for the weights a token reads on every stage of a route (a
    coordinator maps only its own layers, and of a split set only its own parts)."""
    try:
        return open_model(path)
    except DwarfStarError as exc:
        raise DwarfStarError(
            "bench on a route counts the weights every stage reads from the whole model's tensor table, "
            f"which needs every part of the model next to the coordinator's: {exc}"
        ) from None


def _measure(backend, table: ModelFile, tokens, points, gen_tokens: int, alloc: int, power: int) -> list[Row]:
    with Progress(
        TextColumn("bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=stderr_console,
        transient=True,
    ) as progress:
        task = progress.add_task("bench", total=points[-1] + gen_tokens * len(points))
        return run_bench(
            throttle(backend, power),
            table,
            tokens,
            points,
            gen_tokens,
            alloc,
            on_row=lambda row: progress.console.print(_row_line(row), markup=False, highlight=False, soft_wrap=True),
            on_tokens=lambda n: progress.advance(task, n),
        )
