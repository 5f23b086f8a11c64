"""`dwarfstar bench serve`: a live server process, batched and serialised clients, one row per client
count with medians over the rounds, and the batching ratio those medians' rounds give."""

from __future__ import annotations

from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.errors import DwarfStarError


def test_bench_serve_prints_a_row_per_client_count(tiny_model_file):
    _register_commands()
    args = ["bench", "serve", "-m", str(tiny_model_file(0)), "--backend", "reference", "--clients", "1,2"]
    result = CliRunner().invoke(app, [*args, "-n", "4", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert "median of 2 rounds" in lines[-4] and lines[-3].split()[0] == "clients"
    for n, line in zip((1, 2), lines[-2:], strict=True):
        cells = line.split()
        assert int(cells[0]) == n and float(cells[3]) > 0 and float(cells[4]) > 0 and cells[5].endswith("x")


def test_bench_serve_refuses_zero_rounds(tiny_model_file):
    _register_commands()
    result = CliRunner().invoke(app, ["bench", "serve", "-m", str(tiny_model_file(0)), "--repeats", "0"])
    # `dwarfstar.cli.main` prints a DwarfStarError as a one-line error; the bare app raises it
    assert isinstance(result.exception, DwarfStarError) and "--repeats must be at least 1" in str(result.exception)
