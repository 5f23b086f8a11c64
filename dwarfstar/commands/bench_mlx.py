"""`dwarfstar bench mlx`: MLX decode tok/s against the reference backend in one run (and GB/s on Apple).

Registered on the `bench` group; MLX is imported only when the command runs, so the CLI loads on
machines without it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.errors import DwarfStarError


@bench_app.command("mlx")
def bench_mlx(
    model: Annotated[
        Path | None, typer.Option("-m", "--model", help="GGUF model (default: a freshly written tiny model).")
    ] = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=2, help="Tokens decoded one at a time.")] = 32,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt tokens prefilled first.")] = 16,
    reference: Annotated[bool, typer.Option(help="Also time the reference backend and compare.")] = True,
    packing: Annotated[
        str | None, typer.Option(help="MLX weight packing: exact, affine4, affine2, blocks (default: per device).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Decode speed of the MLX backend, against the reference backend and the memory bandwidth."""
    from dwarfstar.backends.mlx import mlx_available

    if not mlx_available():
        raise DwarfStarError("MLX is not installed: pip install 'dwarfstar[mlx]'")
    from dwarfstar.backends.mlx.decode_bench import compare_decode

    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from dwarfstar.model.synthetic import TINY, write_synthetic_model

            model = Path(tmp) / "tiny.gguf"
            write_synthetic_model(model, TINY, seed=0, name="dwarfstar-tiny")
        report = compare_decode(model, tokens, prompt_tokens, with_reference=reference, packing=packing)
    if json_out:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"{report['model']} on {report['device']} ({report['chip']}), packing {report['packing']}")
    typer.echo(f"  mlx decode:       {report['mlx_tok_s']:9.2f} tok/s")
    if reference:
        typer.echo(f"  reference decode: {report['reference_tok_s']:9.2f} tok/s")
        typer.echo(f"  mlx / reference:  {report['mlx_over_reference']:9.3f}")
        typer.echo(f"  parity:           max rel {report['max_rel']:.2e}, mean KL {report['mean_kl']:.2e}")
    spec = report["spec_gb_s"]
    mb = report["bytes_per_token"] / 1e6
    typer.echo(
        f"  bandwidth:        {report['achieved_gb_s']:.2f} GB/s achieved ({mb:.1f} MB/token)"
        f" = {report['fraction_of_measured_read']:.1%} of a measured {report['measured_read_gb_s']:.1f} GB/s read"
        + ("" if spec is None else f", {report['fraction_of_spec']:.1%} of the chip's {spec:.0f} GB/s")
    )
    typer.echo(f"  bandwidth limit:  {report['bandwidth_limit_tok_s']:9.2f} tok/s")
