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
from dwarfstar.commands.prompt_tools import default_bench_text
from dwarfstar.commands.steer import DirSteeringAttn, DirSteeringFfn, DirSteeringFile, steering_options
from dwarfstar.engine import BACKENDS, load_engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.hub import resolve_model
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
    path = resolve_model(model)
    with loading(path) as progress:
        engine = load_engine(path, backend, ctx=alloc, progress=progress, steering=steering)
    tokens = read_bench_tokens(engine.tokenizer.encode, text, points[-1])
    note(
        f"{path.name} on {engine.backend_name}: {len(points)} frontiers {points[0]}..{points[-1]}, "
        f"{gen_tokens} gen tokens each; weights read per token {weight_bytes_per_token(engine.model) / 1e6:.1f} MB"
    )
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
        rows = run_bench(
            throttle(engine.backend, power),
            engine.model,
            tokens,
            points,
            gen_tokens,
            alloc,
            on_row=lambda row: progress.console.print(_row_line(row), markup=False, highlight=False, soft_wrap=True),
            on_tokens=lambda n: progress.advance(task, n),
        )
    if csv_out is None:
        write_csv(rows, sys.stdout)
    else:
        with csv_out.open("w", encoding="utf-8") as out:
            write_csv(rows, out)
        note(f"wrote {csv_out}")
    if plot_out is not None:
        plot(rows, plot_out, f"{path.name} ({engine.backend_name}), {gen_tokens} gen tokens per frontier")
        note(f"wrote {plot_out}")
