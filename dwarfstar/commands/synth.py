"""`dwarfstar synth`: write a deterministic random-weight model (tiny, tiny-k or flash-shaped)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.cli import app
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.synthetic import LAYOUTS, PRESETS, write_synthetic_model


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Output .gguf path.")],
    preset: Annotated[str, typer.Option(help=f"Model shape: {', '.join(PRESETS)}.")] = "tiny",
    layout: Annotated[str, typer.Option(help="f32: every float tensor F32; ds4: the published file types.")] = "f32",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed writes the same bytes.")] = 0,
) -> None:
    """Write a random DeepSeek V4 model in ds4 layout, for tests and benches."""
    if preset not in PRESETS:
        raise DwarfStarError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if layout not in LAYOUTS:
        raise DwarfStarError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    start = time.perf_counter()
    write_synthetic_model(out, PRESETS[preset], layout=layout, seed=seed, name=f"dwarfstar-{preset}")
    size = out.stat().st_size / 1e6
    typer.echo(f"wrote {out} ({preset}, {layout}, seed {seed}): {size:.1f} MB in {time.perf_counter() - start:.1f} s")
