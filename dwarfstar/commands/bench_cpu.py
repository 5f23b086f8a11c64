"""`dwarfstar bench cpu`: the CPU kernels' speed per weight format (dwarfstar/backends/cpu/bench.py)."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.errors import DwarfStarError


@bench_app.command("cpu")
def bench_cpu(
    threads: Annotated[list[int] | None, typer.Option(min=1, help="Thread counts (repeat; default 1 and all).")] = None,
    stream_mib: Annotated[int, typer.Option(min=1, help="MiB of each streamed matrix (past the caches).")] = 1024,
    json_out: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
) -> None:
    """GB/s and multiply-adds per second of each CPU kernel, in cache and streamed from memory."""
    from dwarfstar.backends.cpu.bench import as_dicts, measure, table
    from dwarfstar.backends.cpu.native import available

    why = available()
    if why is not None:
        raise DwarfStarError(f"the CPU kernels do not build here: {why}")
    counts = threads or sorted({1, os.cpu_count() or 1})
    rows = measure(counts, stream_mib)
    typer.echo(json.dumps(as_dicts(rows)) if json_out else table(rows))
