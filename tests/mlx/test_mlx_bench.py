"""`dwarfstar bench mlx`: MLX decode tok/s against the reference backend in one run, with parity and GB/s."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app


def test_bench_mlx_reports_the_ratio_against_the_reference():
    _register_commands()
    result = CliRunner().invoke(app, ["bench", "mlx", "-n", "4", "--prompt-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["mlx_tok_s"] > 0 and report["reference_tok_s"] > 0
    assert abs(report["mlx_over_reference"] - report["mlx_tok_s"] / report["reference_tok_s"]) < 1e-9
    assert report["max_rel"] < 1e-2 and report["mean_kl"] < 1e-5  # the decoded logits agree (QAT on)
    assert report["achieved_gb_s"] > 0 and report["bandwidth_limit_tok_s"] > report["mlx_tok_s"]
