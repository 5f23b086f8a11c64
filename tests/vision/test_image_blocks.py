"""An image's block as the language model takes it (dwarfstar/engine/images.py): ds4's literal Vision-Exp
layout filled with the learned vectors and the encoder's rows in its order, V4.1's reading order, and
the encoder's output kept by the image's digest within a byte budget."""

from __future__ import annotations

from dataclasses import replace

import torch

from dwarfstar.backends.registry import backend_entry
from dwarfstar.engine.images import ImageEncoder, place_image
from dwarfstar.model.synthetic import VISION_PRESETS, write_synthetic_vision
from dwarfstar.model.vision import V41, VISION_TINY, PatchGrid, VisionEncoder
from dwarfstar.model.vision_file import RouterShape, open_vision
from dwarfstar.prompt.images import PreparedImage, digest

ROUTER = VISION_PRESETS["vision-tiny"][1]
V41_TINY = replace(VISION_TINY, family=V41, image_token_id=129264, max_tokens=1024, min_pixels=295936, max_wh_ratio=0)


def image(rows: int, cols: int, seed: int = 0) -> PreparedImage:
    """A prepared image of rows × cols image tokens (3 × 3 patches each)."""
    grid = PatchGrid(3 * rows, 3 * cols)
    pixels = torch.randn(3, 14 * grid.rows, 14 * grid.cols, generator=torch.Generator().manual_seed(seed))
    return PreparedImage(pixels, grid, rows, cols, tokens=0)


def encoder(tmp_path, args=VISION_TINY, router=ROUTER, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{args.family}.gguf"
    write_synthetic_vision(path, args, seed=1, router=router)
    vision = open_vision(path)
    return vision, ImageEncoder(vision, backend_entry("reference"), **options)


def test_a_vision_exp_block_is_ds4s_layout_filled(tmp_path):
    vision, images = encoder(tmp_path)
    picture = image(2, 3)
    block = images.span(place_image(images.args, picture, digest(b"png bytes"), start=0))
    content = VisionEncoder(backend_entry("reference").vision_ops(vision.args, vision.weights())).encode(
        picture.pixels, picture.grid
    )
    # ds4's unit test: h=2, w=3 at position 0 -> types 1 1 1 0 2 2 2 2 2 2 3 3 4, IMAGE order 0 3 1 4 2 5
    vector = {name: vision.tensor(f"image_{name}").float() for name in ("pad", "start", "newline", "end")}
    want = [vector["pad"]] * 3 + [vector["start"]] + [content[k] for k in (0, 3, 1, 4, 2, 5)]
    want += [vector["newline"]] * 2 + [vector["end"]]
    assert torch.equal(block.rows, torch.stack(want))
    assert block.attend == (3, 12)


def test_a_v41_block_reads_in_order_and_attends_causally(tmp_path):
    vision, images = encoder(tmp_path, V41_TINY, RouterShape(6, 8))
    picture = image(2, 2, seed=4)
    block = images.span(place_image(images.args, picture, digest(b"other"), start=5))
    content = images.content(picture, digest(b"other"))
    start, newline, end = (vision.tensor(f"image_{n}").float() for n in ("start", "newline", "end"))
    want = [start, content[0], content[1], newline, content[2], content[3], newline, end]
    assert torch.equal(block.rows, torch.stack(want)) and block.attend is None


def test_the_encoder_runs_once_per_image_within_its_budget(tmp_path):
    _, images = encoder(tmp_path)
    a, b = image(1, 2, seed=1), image(1, 2, seed=2)
    first = images.span(place_image(images.args, a, digest(b"a"), start=0))
    again = images.span(
        place_image(images.args, a, digest(b"a"), start=7)
    )  # another place: another layout, the same content
    assert images.encoded == 1 and len(again.rows) != len(first.rows)
    images.span(place_image(images.args, b, digest(b"b"), start=0))
    assert images.encoded == 2
    one = images.content(a, digest(b"a")).nbytes
    _, small = encoder(tmp_path / "small", cache_bytes=one)
    small.span(place_image(small.args, a, digest(b"a"), start=0))
    small.span(place_image(small.args, b, digest(b"b"), start=0))
    small.span(place_image(small.args, a, digest(b"a"), start=0))  # evicted by b: encoded again
    assert small.encoded == 3
