"""`dwarfstar test`: ds4_test's gates on real weights (vectors, long-context, tool-call, quality)."""

from __future__ import annotations

import typer

from dwarfstar.cli import app

test_app = typer.Typer(no_args_is_help=True, help="ds4's quality gates: prove a model still works after a change.")
app.add_typer(test_app, name="test")
