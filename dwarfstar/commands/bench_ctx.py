"""`dwarfstar bench [options]`: prefill and decode speed across context sizes (ds4-bench's method).

It is the `bench` group's own callback, so `dwarfstar bench` runs it and `dwarfstar bench kv` (and
the other subcommands) run instead of it. The CSV goes to `--csv FILE` or stdout; the rows are also
shown on stderr as they come, with the achieved GB/s next to the decode speed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.flags import DistFlags, ModelFlags, Power, SteeringFlags, output
from dwarfstar.commands.prompt_tools import EXCERPT, default_bench_text, read_text_file
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.bench.frontier import Row
    from dwarfstar.model.file_v41 import ModelFile41
    from dwarfstar.model.loader import ModelFile


PromptFile = Annotated[
    Path | None,
    typer.Option(
        "--prompt-file", "--text-file", help="Benchmark text (default: the book, packaged as a few kB repeated)."
    ),
]


def _row_line(row: Row) -> str:
    return (
        f"ctx {row.ctx_tokens:>7}: prefill {row.prefill_tokens} tok at {row.prefill_tps:9.2f} tok/s | "
        f"gen {row.gen_tokens} tok at {row.gen_tps:8.2f} tok/s = {row.gen_gbps:7.2f} GB/s | "
        f"KV {row.kvcache_bytes / 2**20:.1f} MiB"
    )


def bench_text(path: Path | None, tokens: int) -> str:
    """--prompt-file's text, else the book beside the checkout, else the packaged excerpt repeated to
    about `tokens` tokens (a few kB; the speed of prefill and decode does not depend on the words)."""
    text_path = path or default_bench_text()
    text = read_text_file(text_path)
    if path is None and text_path.name == EXCERPT:
        text = "\n".join([text] * (tokens * 8 // len(text) + 2))  # more characters than tokens, by far
    return text


@bench_app.callback(invoke_without_command=True, no_args_is_help=False)
def bench(
    context: typer.Context,
    model: ModelFlags,
    steering: SteeringFlags,
    dist: DistFlags,
    prompt_file: PromptFile = None,
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
    csv_out: Annotated[Path | None, output("--csv", help="CSV output file (default: stdout).")] = None,
    plot_out: Annotated[
        Path | None, output("--plot", help="Also draw tok/s against context (PNG, matplotlib).")
    ] = None,
    power: Power = 100,
) -> None:
    """Prefill and decode speed at growing context sizes, ds4-bench style; subcommands measure other parts."""
    if context.invoked_subcommand is not None:
        return
    from dwarfstar.bench.frontier import frontiers, read_bench_tokens, require_plotting, weight_bytes_per_token
    from dwarfstar.commands.engines import start
    from dwarfstar.console.terminal import note

    if plot_out is not None:
        require_plotting()
    points = frontiers(ctx_start, ctx_max, step_incr, step_mul)
    alloc = ctx_alloc or ctx_max + gen_tokens + 1
    text = bench_text(prompt_file, points[-1])
    spec = model.spec(ctx=alloc, power=power, steering=steering.options(), dist=dist.options())
    engine, route = start(spec)  # a worker serves its layers here and exits; a coordinator routes
    try:
        table = engine.model if route is None else _whole_table(spec.model)
        tokens = read_bench_tokens(engine.tokenizer.encode, text, points[-1])
        note(
            f"{spec.model.name} on {engine.backend_name}{'' if route is None else ' (a route)'}: {len(points)} "
            f"frontiers {points[0]}..{points[-1]}, {gen_tokens} gen tokens each; weights read per token "
            f"{weight_bytes_per_token(table) / 1e6:.1f} MB{_engram_note(table)}"
        )
        rows = _measure(engine.backend, table, tokens, points, gen_tokens, alloc, power)
        if table is not engine.model:
            table.close()
    finally:
        if route is not None:
            route.close()
    _write(rows, csv_out, plot_out, f"{spec.model.name} ({engine.backend_name}), {gen_tokens} gen tokens per frontier")


def _write(rows: list[Row], csv_out: Path | None, plot_out: Path | None, title: str) -> None:
    from dwarfstar.bench.frontier import plot, write_csv
    from dwarfstar.console.terminal import note

    if csv_out is None:
        write_csv(rows, sys.stdout)
    else:
        with csv_out.open("w", encoding="utf-8") as out:
            write_csv(rows, out)
        note(f"wrote {csv_out}")
    if plot_out is not None:
        plot(rows, plot_out, title)
        note(f"wrote {plot_out}")


def _engram_note(table: ModelFile | ModelFile41) -> str:
    """A V4.1 model's Engram row bytes per token, which the GB/s leaves out (read from the file); V4: nothing."""
    from dwarfstar.bench.token_bytes41 import engram_rows_per_token
    from dwarfstar.engram.rows import ROW_BYTES
    from dwarfstar.model.file_v41 import ModelFile41

    if not isinstance(table, ModelFile41):
        return ""
    rows = engram_rows_per_token(table.args)
    return (
        f"; Engram rows {rows} x {ROW_BYTES} B = {rows * ROW_BYTES / 1e3:.1f} kB per token (from the file, not in GB/s)"
    )


def _whole_table(path: Path) -> ModelFile | ModelFile41:
    """The whole model's tensor table, for the weights a token reads on every stage of a route (a
    coordinator maps only its own layers, and of a split set only its own parts)."""
    from dwarfstar.model.file_v41 import open_model41
    from dwarfstar.model.loader import is_v41, open_model

    try:
        return open_model41(path) if is_v41(path) else open_model(path)
    except DwarfStarError as exc:
        raise DwarfStarError(
            "bench on a route counts the weights every stage reads from the whole model's tensor table, "
            f"which needs every part of the model next to the coordinator's: {exc}"
        ) from None


def _measure(
    backend, table: ModelFile | ModelFile41, tokens, points, gen_tokens: int, alloc: int, power: int
) -> list[Row]:
    from rich.progress import TextColumn

    from dwarfstar.bench.frontier import run_bench
    from dwarfstar.console.terminal import count_bar
    from dwarfstar.session.throttle import throttle

    with count_bar("bench", TextColumn("tokens")) as progress:
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
