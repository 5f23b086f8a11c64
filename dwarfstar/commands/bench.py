"""`dwarfstar bench`: the measurement commands, each in its own `bench_*` module on this group."""

from __future__ import annotations

import typer

from dwarfstar.cli import app

bench_app = typer.Typer(no_args_is_help=True, help="Measure the engine: KV cache I/O, prefill and decode speed.")
app.add_typer(bench_app, name="bench")
