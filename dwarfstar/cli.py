"""`dwarfstar` command line. Each command group lives in its own module under `dwarfstar/commands/`."""

from __future__ import annotations

import sys

import typer

from dwarfstar.errors import DwarfStarError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="DeepSeek V4 Flash/PRO inference engine.",
)


def _register_commands() -> None:
    # One import per command module; each module adds its commands to `app`.
    import dwarfstar.backends.mlx.bench_command  # noqa: F401
    import dwarfstar.commands.bench_ctx  # noqa: F401
    import dwarfstar.commands.bench_dist  # noqa: F401
    import dwarfstar.commands.bench_gpu  # noqa: F401
    import dwarfstar.commands.bench_kv  # noqa: F401
    import dwarfstar.commands.convert  # noqa: F401
    import dwarfstar.commands.eval  # noqa: F401
    import dwarfstar.commands.experts  # noqa: F401
    import dwarfstar.commands.gates  # noqa: F401
    import dwarfstar.commands.prompt_tools  # noqa: F401
    import dwarfstar.commands.quant_tools  # noqa: F401
    import dwarfstar.commands.serve  # noqa: F401
    import dwarfstar.commands.steer  # noqa: F401
    from dwarfstar.commands import agent, pull, run, synth  # noqa: F401


def main() -> None:
    _register_commands()
    try:
        app()
    except DwarfStarError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
