"""Images in a conversation: the typed part every API parses an image into, and its pixels for the encoder.

An `ImagePart` is an image as a request sent it (the raw bytes, their media type, where it sits);
`prepare_image(part, args)` decodes it and lays it out as the vision encoder `args` reads an image (issue
34; the facts of DeepSeek's `inference/image_processor.py` of each model, as vLLM's ports of it and
ds4's `ds4_image.c` restate them):

- decoded with Pillow: PNG, JPEG, WebP, GIF (its first frame), at most `MAX_PIXELS` (refused before its
  pixels are decoded); the EXIF orientation applied; an alpha channel composited on gray (127, 127, 127).
  These are this server's (the issue asks for them): the reference's `load_image`, as ported, only
  calls `convert("RGB")`, which drops alpha (a transparent pixel keeps its stored colour, often black)
  and applies no EXIF orientation (ds4 applies a JPEG's);
- planned (`canvas_size`) at a width of at most `max_wh_ratio` times the height (Vision-Exp: 8; V4.1:
  no limit), an image under `min_pixels` scaled up (aspect kept, truncated to whole pixels), the canvas
  its size rounded up to whole 14-pixel patches, then shrunk when its block is over the budget
  (`max_tokens`, Vision-Exp 384, V4.1 1,024) as each family solves it: Vision-Exp keeps 3 tokens for
  its leading pads, makes the rows even and retries a budget one token smaller until the block fits
  (`_vision_exp_fit`); V4.1 solves once (`_v41_fit`);
- the image fitted into the canvas (aspect kept, centred, the rest gray 127), or, for an image at least
  `max_wh_ratio` times as wide as high, stretched onto it (both bicubic, Pillow's default);
- pixels scaled to [0, 1], normalised as (x - 0.5) / 0.5 and rounded to bfloat16 as the reference
  feeds the encoder, held as a float32 `[3, height, width]` tensor.

The aligner unfolds 3×3 patches into one token: the block's tokens are counted by
`image_layout.block_tokens` (without Vision-Exp's position-dependent leading pads), its order is
`image_layout.layout`.

Pillow is imported only when an image arrives: `dwarfstar --help` and every text-only request never
load it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dwarfstar.model.vision import V41, PatchGrid, VisionArgs
from dwarfstar.prompt.image_layout import COMPRESS_PAD, block_tokens
from dwarfstar.tokenizer.specials import Control, PromptPart

MAX_PIXELS = 8192 * 8192  # a larger image is refused before its pixels are decoded (a PNG of a few KB can claim 1e10)
GRAY = (127, 127, 127)
MAX_IMAGES = 16  # per request, as ds4
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names for the media types above
# where an image sits in a message's text, until the prompt is tokenized (`slot`, `split_slots`): private-use
# characters, which a request's own text may not hold (`check_free_of_slots`)
SLOT_OPEN, SLOT_CLOSE = "\ue000", "\ue001"
_SLOT = re.compile(f"{SLOT_OPEN}(\\d+){SLOT_CLOSE}")


class ImageError(ValueError):
    """An image that cannot be read: its message names what is wrong, the caller names the part."""


@dataclass(frozen=True)
class ImagePart:
    """An image as the request sent it: the encoded bytes, their media type, and `where`: its JSON path
    (or file), named in errors. Its place in the conversation is its slot (`slot`) in a message's text."""

    data: bytes = field(repr=False)  # up to tens of MB: never in a log line
    media_type: str
    where: str


@dataclass(frozen=True)
class PreparedImage:
    """What the vision encoder consumes: normalised pixels `[3, height, width]` (float32 holding
    bfloat16 values), their patch grid, and the token grid and block the aligner's output fills."""

    pixels: torch.Tensor
    grid: PatchGrid  # patches: height / 14 × width / 14
    rows: int  # image-token rows after the 3×3 unfold
    cols: int
    tokens: int  # the block without Vision-Exp's leading pads (`image_layout.block_tokens`)


def from_base64(data: object, media_type: object) -> tuple[bytes, str]:
    """The bytes of base64 `data` and its media type, one of `MEDIA_TYPES`."""
    if media_type not in MEDIA_TYPES:
        raise ImageError(f"media type {media_type!r} is not supported; send one of {', '.join(MEDIA_TYPES)}")
    if not isinstance(data, str) or not data:
        raise ImageError("the image data must be a non-empty base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None
    return raw, str(media_type)


def from_url(url: object) -> tuple[bytes, str]:
    """A `data:image/...;base64,...` URL; an http(s) URL is refused: the server makes no outbound requests."""
    if not isinstance(url, str) or not url:
        raise ImageError("the image URL must be a non-empty string")
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "image URLs are not fetched (this server makes no outbound requests unless started with "
            "--allow-image-urls); send the image inline as a data URL, data:image/png;base64,..."
        )
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma or not head.endswith(";base64"):
        raise ImageError("the image URL must be a base64 data URL, data:image/png;base64,...")
    return from_base64(data, head[len("data:") : -len(";base64")])


_SIGNATURES = (  # a file's first bytes -> its media type
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def sniff(data: bytes) -> str | None:
    """The media type of an image's bytes, one of `MEDIA_TYPES`, from its first bytes (None: none of them)."""
    kind = next((media for magic, media in _SIGNATURES if data.startswith(magic)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "image/webp"
    return kind


def read_image_file(path: os.PathLike | str) -> ImagePart:
    """An image file as a part of the next message (the command line's `--image`, `/image`): its
    media type from its first bytes, checked to decode."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read the image {path}: {exc.strerror or exc}") from None
    kind = sniff(data)
    if kind is None:
        raise ImageError(f"{path} is not a PNG, JPEG, WebP or GIF image")
    part = ImagePart(data, kind, where=str(path))
    decode(part)  # a corrupt file is refused now, not when its turn is sent
    return part


def digest(data: bytes) -> bytes:
    """The identity of an image: the SHA-256 of its encoded bytes."""
    return hashlib.sha256(data).digest()


def keep_image(folder: Path, data: bytes) -> str:
    """Keep an image's bytes in `folder` (a saved chat's) as a file named by the hex SHA-256 of its
    bytes, written whole or not at all; a copy already there with the right bytes stays. Returns the name."""
    sha = digest(data).hex()
    path = folder / sha
    try:
        if path.is_file() and digest(path.read_bytes()).hex() == sha:
            return sha
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{sha}.tmp.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise ImageError(f"cannot save the image {path}: {exc.strerror or exc}") from None
    return sha


def kept_image(folder: Path, sha: str) -> bytes:
    """The bytes `keep_image` kept in `folder` as `sha`, checked against the name (a missing, unreadable
    or altered file is an ImageError naming it)."""
    path = folder / sha
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"image {path} is missing") from None
    except OSError as exc:
        raise ImageError(f"image {path} cannot be read: {exc.strerror or exc}") from None
    if digest(data).hex() != sha:
        raise ImageError(f"image {path} was altered (the SHA-256 of its bytes is not its name)")
    return data


def slot(index: int) -> str:
    """The text standing for the request's image `index` in its message, until tokenization."""
    return f"{SLOT_OPEN}{index}{SLOT_CLOSE}"


def check_free_of_slots(text: str) -> None:
    """A request's text must not hold the characters image slots are made of (U+E000, U+E001)."""
    if SLOT_OPEN in text or SLOT_CLOSE in text:
        raise ImageError("the text holds U+E000 or U+E001, private-use characters this server reserves for images")


def split_slots(parts: Sequence[PromptPart]) -> list[list[PromptPart] | int]:
    """A rendered prompt cut at its image slots: runs of parts, and between them each slot's image index."""
    out: list[list[PromptPart] | int] = [[]]
    for part in parts:
        if isinstance(part, Control):
            out[-1].append(part)
            continue
        pieces = _SLOT.split(part)  # text, index, text, index, ..., text
        for n, piece in enumerate(pieces):
            if n % 2:
                out += [int(piece), []]
            elif piece:
                out[-1].append(piece)
    return out


def decode(part: ImagePart):  # -> PIL.Image.Image (Pillow is imported here only)
    """The image as RGB: the first frame, the EXIF orientation applied, alpha composited on gray."""
    from PIL import Image, ImageOps

    try:
        image = Image.open(io.BytesIO(part.data), formats=FORMATS)
        if not image.width or not image.height:
            raise ImageError(f"a {image.width}×{image.height} image has no pixels")
        if image.width * image.height > MAX_PIXELS:
            raise ImageError(f"a {image.width}×{image.height} image is over {MAX_PIXELS:,} pixels; send a smaller one")
        image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the {part.media_type} data is not a readable image ({exc})") from None
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*GRAY, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def token_grid(height: int, width: int, args: VisionArgs) -> tuple[int, int]:
    """The image-token rows and columns of a canvas `height` × `width` (whole patches)."""
    cell = args.patch * args.downsample
    return -(-height // cell), -(-width // cell)


def canvas_tokens(height: int, width: int, args: VisionArgs) -> int:
    """The block (without leading pads) of a canvas `height` × `width`."""
    return block_tokens(args.family, *token_grid(height, width, args))


def _vision_exp_fit(width: int, height: int, budget: int, args: VisionArgs) -> tuple[int, int]:
    """Vision-Exp's canvas (width, height) for a block of about `budget` tokens: the grid whose
    rows·(cols + 1) + 2 tokens make `budget` at the image's aspect ratio, its rows made even, the image
    scaled into it and floored to whole patches. A very tall image gets one column, a very wide one two
    rows."""
    cell, ratio = args.patch * args.downsample, height / width
    across = math.sqrt((budget - 2) / ratio + 0.25) - 0.5  # the root of (w·ratio)·(w + 1) + 2 = budget
    if across < 1:
        rows = (budget - 2) // 2
        return cell, (rows - rows % 2) * cell
    if across * ratio < 2:
        return ((budget - 2) // 2 - 1) * cell, 2 * cell
    cols, rows = math.floor(across), math.floor(across * ratio)
    return _scaled(width, height, min(cols * cell / width, (rows - rows % 2) * cell / height), args.patch)


def _v41_fit(width: int, height: int, budget: int, args: VisionArgs) -> tuple[int, int]:
    """V4.1's canvas (width, height) for a block of at most `budget` tokens, solved once: the grid whose
    rows·(cols + 1) + 2 tokens make `budget` at the image's aspect ratio (no evening), the image scaled
    into it and floored to whole patches. A very tall image gets one column, a very wide one one row."""
    cell, ratio = args.patch * args.downsample, height / width
    across = math.sqrt((budget - 2) / ratio + 0.25) - 0.5
    if across < 1:
        return cell, (budget - 2) // 2 * cell
    if across * ratio < 1:
        return (budget - 3) * cell, cell
    cols, rows = math.floor(across), math.floor(across * ratio)
    return _scaled(width, height, min(cols * cell / width, rows * cell / height), args.patch)


def _scaled(width: int, height: int, scale: float, patch: int) -> tuple[int, int]:
    return math.floor(width * scale / patch) * patch, math.floor(height * scale / patch) * patch


def canvas_size(width: int, height: int, args: VisionArgs = VisionArgs()) -> tuple[int, int]:
    """The canvas (width, height), in whole patches, an image of `width` × `height` is laid out on for
    the encoder `args` (the module docstring's plan)."""
    if width < 1 or height < 1:
        raise ValueError(f"a {width}×{height} image has no pixels")
    if args.max_wh_ratio and width > height * args.max_wh_ratio:
        width = height * args.max_wh_ratio  # planned at the widest ratio; `prepare_image` stretches it
    if width * height < args.min_pixels:
        scale = math.sqrt(args.min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    patch = args.patch
    canvas = (-(-width // patch) * patch, -(-height // patch) * patch)
    if args.family == V41:
        if canvas_tokens(canvas[1], canvas[0], args) > args.max_tokens:
            canvas = _v41_fit(width, height, args.max_tokens, args)
    else:  # Vision-Exp: the budget keeps room for the leading pads, and shrinks until the block fits
        limit = budget = args.max_tokens - COMPRESS_PAD
        while canvas_tokens(canvas[1], canvas[0], args) > limit:
            if budget < 6:  # the smallest block, one image token: 2 rows of 2, start and end
                raise ValueError(f"an image budget of {args.max_tokens} tokens holds no image")
            canvas, budget = _vision_exp_fit(width, height, budget, args), budget - 1
    if canvas_tokens(canvas[1], canvas[0], args) > args.max_tokens:
        raise AssertionError(f"a {canvas[0]}×{canvas[1]} canvas is over {args.max_tokens} tokens")
    return canvas


def prepare_image(part: ImagePart, args: VisionArgs = VisionArgs()) -> PreparedImage:
    """The image `part`, decoded and laid out for the encoder `args` (default: Vision-Exp's)."""
    from PIL import Image, ImageOps

    image = decode(part)
    width, height = canvas_size(*image.size, args)
    if args.max_wh_ratio and image.width >= args.max_wh_ratio * image.height:
        fitted = image.resize((width, height), Image.Resampling.BICUBIC)  # stretched (Pillow's default filter)
    else:
        fitted = ImageOps.pad(image, (width, height), color=GRAY)
    pixels = torch.from_numpy(np.asarray(fitted, dtype=np.float32)).permute(2, 0, 1) / 255.0
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16).to(torch.float32).contiguous()
    rows, cols = token_grid(height, width, args)
    grid = PatchGrid(height // args.patch, width // args.patch)
    return PreparedImage(pixels, grid, rows, cols, block_tokens(args.family, rows, cols))
