"""`dwarfstar synth`: write a deterministic random-weight model (tiny, tiny-k, flash- or pro-shaped),
as one file or, with `--split-at`, as a split set in ds4's naming; a DeepSeek V4.1 model in ds4's
`deepseek41` layout (v41-tiny, v41-shaped), also as a set; or a vision encoder in ds4's encoder-GGUF layout
(vision-tiny, vision-exp-shaped)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app
from dwarfstar.commands.flags import writable
from dwarfstar.errors import DwarfStarError

PRESETS_HELP = (  # model.synthetic.PRESETS, VISION_PRESETS and model.synthetic_v41.V41_PRESETS
    "Model shape: tiny, tiny-k, flash-shaped, pro-shaped; DeepSeek V4.1: v41-tiny (every mechanism at toy "
    "size), v41-shaped (Flash V4.1's shapes, 4 layers, ds4 types; its 94 GiB Engram tables written as holes "
    "that take no disk); or a vision encoder (BF16, as ds4's --vision file): vision-tiny (for tiny, with its "
    "image router biases), vision-exp-shaped (the real Vision-Exp encoder, 933 MB)."
)


@app.command(rich_help_panel=TOOLS)
def synth(
    out: Annotated[
        Path, typer.Argument(help="Output .gguf path (with --split-at, the parts' name stem).", callback=writable)
    ],
    preset: Annotated[str, typer.Option(help=PRESETS_HELP)] = "tiny",
    layout: Annotated[
        str | None,
        typer.Option(
            help="f32 (the default): every float tensor F32; ds4: the published file types; ds4-mxfp4: MXFP4 "
            "experts. Not for a vision encoder."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed writes the same bytes.")] = 0,
    layers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Layers instead of the preset's, in its compression pattern (e.g. 14 Flash layers); "
            "for a vision encoder, its ViT blocks.",
        ),
    ] = None,
    split_at: Annotated[
        list[int] | None,
        typer.Option(
            "--split-at",
            help="Write a split set instead, a new part starting at this layer (repeat for more parts): "
            "OUT-Layers00-02.gguf, OUT-Layers-03-output.gguf, as ds4 splits PRO Q4.",
        ),
    ] = None,
) -> None:
    """Write a random DeepSeek V4 model (or vision encoder) in ds4 layout, for tests and benches."""
    from dwarfstar.model.synthetic import LAYOUTS, PRESETS, VISION_PRESETS, preset_with_layers, write_synthetic_model
    from dwarfstar.model.synthetic_v41 import V41_PRESETS

    if preset in VISION_PRESETS:
        _synth_vision(out, preset, seed, layers, layout, split_at)
        return
    if preset in V41_PRESETS:
        _synth_v41(out, preset, seed, layers, layout, split_at)
        return
    if preset not in PRESETS:
        known = ", ".join([*PRESETS, *VISION_PRESETS, *V41_PRESETS])
        raise DwarfStarError(f"unknown preset {preset!r}; choose one of {known}")
    layout = layout or "f32"
    if layout not in LAYOUTS:
        raise DwarfStarError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    args = PRESETS[preset] if layers is None else preset_with_layers(preset, layers)
    n_layers = args.n_layers
    start = time.perf_counter()

    def write(path: Path) -> None:
        write_synthetic_model(path, args, layout=layout, seed=seed, name=f"dwarfstar-{preset}")

    files = _write_parts(out, split_at, n_layers, preset, write)
    took = time.perf_counter() - start
    for path in files:
        size = path.stat().st_size / 1e6
        typer.echo(f"wrote {path} ({preset}, {n_layers} layers, {layout}, seed {seed}): {size:.1f} MB")
    typer.echo(f"in {took:.1f} s")


def _write_parts(
    out: Path, split_at: list[int] | None, n_layers: int, preset: str, write: Callable[[Path], None]
) -> list[Path]:
    """`write(path)` the model at `out`, or with `split_at` as a split set `out`'s stem names (`write_split`:
    the whole file written first, then removed). Returns the files written."""
    from dwarfstar.model.loader import write_split

    if not split_at:
        write(out)
        return [out]
    if not all(0 < layer < n_layers for layer in split_at):
        raise DwarfStarError(f"--split-at must name layers 1 to {n_layers - 1} of the {n_layers}-layer {preset}")
    whole = out.with_name(out.stem + ".whole.gguf")
    write(whole)
    try:
        return write_split(whole, split_at, out.with_suffix(""))
    finally:
        whole.unlink()


def _synth_vision(
    out: Path, preset: str, seed: int, layers: int | None, layout: str | None, split_at: list[int] | None
) -> None:
    from dataclasses import replace

    from dwarfstar.model.synthetic import VISION_PRESETS, write_synthetic_vision

    if layout is not None:
        raise DwarfStarError(f"--layout is for language models; {preset} is a vision encoder, BF16 as ds4 writes it")
    if split_at:
        raise DwarfStarError(f"--split-at is for language models; {preset} is a vision encoder, one file")
    args, router = VISION_PRESETS[preset]
    if layers is not None:
        args = replace(args, n_layers=layers)
    start = time.perf_counter()
    write_synthetic_vision(out, args, seed=seed, router=router, name=f"dwarfstar-{preset}")
    size = out.stat().st_size / 1e6
    blocks = f"{args.n_layers} ViT layer" + ("s" if args.n_layers > 1 else "")
    typer.echo(
        f"wrote {out} ({preset}: {args.family} encoder, {blocks}, BF16, image router biases "
        f"for {router.n_layers} layers of {router.n_experts} experts, seed {seed}): {size:.1f} MB"
    )
    typer.echo(f"in {time.perf_counter() - start:.1f} s")


def _synth_v41(
    out: Path, preset: str, seed: int, layers: int | None, layout: str | None, split_at: list[int] | None
) -> None:
    from dwarfstar.model.synthetic import LAYOUTS
    from dwarfstar.model.synthetic_v41 import V41_HOLES, V41_LAYOUT, v41_preset, write_synthetic_v41

    layout = layout or V41_LAYOUT[preset]
    if layout not in LAYOUTS:
        raise DwarfStarError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    args = v41_preset(preset, layers)
    holes = preset in V41_HOLES
    if holes and split_at:  # the parts are written by copying every byte: the holes would fill the disk
        raise DwarfStarError(f"--split-at copies the Engram tables' bytes; {preset}'s are holes of ~94 GiB each")
    start = time.perf_counter()

    def write(path: Path) -> None:
        write_synthetic_v41(path, args, layout=layout, seed=seed, name=f"dwarfstar-{preset}", engram_holes=holes)

    files = _write_parts(out, split_at, args.n_layers, preset, write)
    tables = f"Engram tables on layers {', '.join(map(str, args.engram_layers))}" + (" written as holes" * holes)
    for path in files:
        stat = path.stat()
        typer.echo(
            f"wrote {path} ({preset}, DeepSeek V4.1, {args.n_layers} layers, {layout}, seed {seed}; {tables}): "
            f"{stat.st_size / 1e6:.1f} MB, {stat.st_blocks * 512 / 1e6:.1f} MB on disk"
        )
    typer.echo(f"in {time.perf_counter() - start:.1f} s")
