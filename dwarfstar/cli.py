"""`dwarfstar` command line. The command groups are in dwarfstar/commands/apps.py; each command lives
in its own module under dwarfstar/commands/, which imports only light modules at its top (the engine,
torch, the server and the hub inside the command), so `--help` answers at once."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

import dwarfstar
from dwarfstar.commands.apps import app
from dwarfstar.errors import DwarfStarError


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"dwarfstar {dwarfstar.__version__}")
        raise typer.Exit()


@app.callback()
def dwarfstar_options(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """DeepSeek V4 Flash/PRO inference engine."""


def _register_commands() -> None:
    """Import every command module; each adds its commands to `app` (in this order in the help: the
    commands people use first, then the tools)."""
    # isort: off
    import dwarfstar.commands.run  # noqa: F401
    import dwarfstar.commands.serve  # noqa: F401
    import dwarfstar.commands.agent  # noqa: F401
    import dwarfstar.commands.pull  # noqa: F401
    import dwarfstar.commands.bench_ctx  # noqa: F401
    import dwarfstar.commands.bench_dist  # noqa: F401
    import dwarfstar.commands.bench_gpu  # noqa: F401
    import dwarfstar.commands.bench_cpu  # noqa: F401
    import dwarfstar.commands.bench_kv  # noqa: F401
    import dwarfstar.commands.bench_mlx  # noqa: F401
    import dwarfstar.commands.bench_vision  # noqa: F401
    import dwarfstar.commands.bench_v41  # noqa: F401
    import dwarfstar.commands.speculate  # noqa: F401
    import dwarfstar.commands.eval  # noqa: F401
    import dwarfstar.commands.gates  # noqa: F401
    import dwarfstar.commands.steer  # noqa: F401
    import dwarfstar.commands.experts  # noqa: F401
    import dwarfstar.commands.convert  # noqa: F401
    import dwarfstar.commands.quant_tools  # noqa: F401
    import dwarfstar.commands.synth  # noqa: F401
    import dwarfstar.commands.prompt_tools  # noqa: F401
    # isort: on


def main() -> None:
    _register_commands()
    try:
        app()
    except DwarfStarError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
