"""`dwarfstar bench vision`: the vision encoder's time per image on a backend (issue 34).

An image of each `--size` (a gradient drawn with Pillow, PNG-encoded) is prepared as a request's image
is (decode, plan, resize, normalise) and encoded by the backend's `VisionOps` through `VisionEncoder`:
the preparation and the encoder are timed apart (the encoder's best of `--repeat` runs), with the
patches, the image tokens and the encoder's multiply-adds per second. The weights are an encoder
GGUF's, or random ones at a preset's exact shapes (`--preset`, `--layers` for fewer ViT blocks).
"""

from __future__ import annotations

import io
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.errors import DwarfStarError

PRESETS = ("vision-exp", "v4.1", "vision-tiny")


@bench_app.command("vision")
def bench_vision(
    encoder: Annotated[
        Path | None, typer.Argument(help="An encoder GGUF (default: random weights at --preset's shapes).")
    ] = None,
    preset: Annotated[str, typer.Option(help=f"Shapes of the random weights: {', '.join(PRESETS)}.")] = "vision-exp",
    layers: Annotated[int | None, typer.Option(min=1, help="ViT blocks instead of the preset's.")] = None,
    size: Annotated[list[str] | None, typer.Option(help="Image WIDTHxHEIGHT (repeat; default 1920x1080).")] = None,
    backend: Annotated[str, typer.Option(help="Compute backend (auto: this machine's best).")] = "auto",
    repeat: Annotated[int, typer.Option(min=1, help="Encoder runs per image; the best is reported.")] = 2,
) -> None:
    """Seconds to prepare and to encode one image, patches, image tokens, and GFLOP/s."""
    import torch

    from dwarfstar.backends.registry import backend_entry, pick_backend
    from dwarfstar.model.vision import V41_FLASH, VISION_EXP_FLASH, VISION_TINY, VisionEncoder

    sizes = [_size(s) for s in size or ["1920x1080"]]
    if encoder is not None:
        from dwarfstar.model.vision_file import open_vision

        vision = open_vision(encoder)
        args, tensors, source = vision.args, vision.weights(), str(encoder)
    else:
        presets = {"vision-exp": VISION_EXP_FLASH, "v4.1": V41_FLASH, "vision-tiny": VISION_TINY}
        if preset not in presets:
            raise DwarfStarError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        args = presets[preset] if layers is None else replace(presets[preset], n_layers=layers)
        gen = torch.Generator().manual_seed(0)
        tensors = {
            name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            for name, shape in args.tensor_shapes().items()
        }
        source = f"random {preset} weights"
    name = pick_backend(backend)
    encode = VisionEncoder(backend_entry(name).vision_ops(args, tensors))
    typer.echo(f"{source}: {args.family}, {args.n_layers} blocks of {args.dim}, output {args.out_dim}; backend {name}")
    typer.echo(f"{'image':>11} {'canvas':>11} {'patches':>8} {'tokens':>7} {'prepare s':>10} {'encode s':>9} GFLOP/s")
    for width, height in sizes:
        part, start = _image(width, height), time.perf_counter()
        image = _prepare(part, args)
        prepared = time.perf_counter() - start
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            out = encode.encode(image.pixels, image.grid)
            float(out.sum())  # a lazy backend's work, done
            best = min(best, time.perf_counter() - start)
        grid = image.grid
        patches = grid.rows * grid.cols
        rate = _flops(args, patches, image.rows * image.cols) / best / 1e9
        typer.echo(
            f"{width:>5}x{height:<5} {grid.cols * args.patch:>5}x{grid.rows * args.patch:<5} {patches:>8} "
            f"{image.tokens:>7} {prepared:>10.3f} {best:>9.3f} {rate:7.1f}"
        )


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise DwarfStarError(f"--size takes WIDTHxHEIGHT, e.g. 1920x1080; got {text!r}") from None
    if width < 1 or height < 1:
        raise DwarfStarError(f"--size {text}: both sides must be at least 1 pixel")
    return width, height


def _image(width: int, height: int):
    """A PNG of a horizontal and vertical gradient, as a request would send it."""
    import numpy as np
    from PIL import Image

    from dwarfstar.prompt.images import ImagePart

    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack(np.broadcast_arrays(x + 0 * y, y + 0 * x, (x + y) / 2), axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    return ImagePart(buffer.getvalue(), "image/png", where="--size")


def _prepare(part, args):
    from dwarfstar.prompt.images import ImageError, prepare_image

    try:
        return prepare_image(part, args)
    except ImageError as exc:
        raise DwarfStarError(str(exc)) from None


def _flops(args, patches: int, tokens: int) -> float:
    """The encoder's floating-point operations for one image: 2 per multiply-add of each product."""
    d, inter, n = args.dim, args.inter_dim, patches
    per_block = n * (3 * d * d + d * d + 2 * inter * d + inter * d) + 2 * n * n * d  # products, then QK and PV
    cells = args.downsample * args.downsample
    return 2.0 * (
        n * 3 * args.patch * args.patch * d
        + args.n_layers * per_block
        + tokens * (cells * d + args.out_dim) * args.out_dim
    )
