"""Images in a conversation: the typed part every API parses an image into, and its pixels for the encoder.

An `ImagePart` is an image as a request sent it (the raw bytes, their media type, where it sits);
`prepare_image` decodes it and lays it out as DeepSeek V4's vision encoder reads an image (the facts of
DeepSeek V4.1's `inference/image_processor.py`, as vLLM's `deepseek_v4/common/mm_preprocess.py`
describes them):

- decoded with Pillow: PNG, JPEG, WebP, GIF (its first frame), at most `MAX_PIXELS`; the EXIF
  orientation applied; an alpha channel composited on gray (127, 127, 127);
- an image under `MIN_PIXELS` (544²) scaled up, keeping its aspect ratio;
- a canvas of whole 14-pixel patches (`PATCH`) covering it, or, when its token block is over
  `MAX_IMAGE_TOKENS` (1,024, less the 3 tokens the compressor's alignment pad may take), a smaller one
  solved from the budget and the aspect ratio (`canvas_size`);
- the image fitted into the canvas (aspect kept, centred) and the rest padded with gray 127;
- pixels scaled to [0, 1] and normalised as (x - 0.5) / 0.5, a float32 `[3, height, width]` tensor.

The aligner unfolds 3×3 patches (`ALIGN`) into one token: `rows` × `cols` image tokens, each row closed
by a newline token, the block opened and closed by one token each, an odd row count padded by one
more row, and the block padded to an even count of row pairs' tokens (`block_tokens`).

Pillow is imported only when an image arrives: `dwarfstar --help` and every text-only request never
load it.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass, field

import numpy as np
import torch

PATCH = 14
ALIGN = 3  # the aligner's unfold: 3×3 patches make one token
MAX_IMAGE_TOKENS = 1024
COMPRESS_PAD = 3  # the most pad tokens the KV compressor's 4-token alignment may add before the block
MIN_PIXELS = 544 * 544
MAX_PIXELS = 8192 * 8192  # a larger image is refused before its pixels are decoded (a PNG of a few KB can claim 1e10)
GRAY = (127, 127, 127)
MAX_IMAGES = 16  # per request, as ds4
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names for the media types above


class ImageError(ValueError):
    """An image that cannot be read: its message names what is wrong, the caller names the part."""


@dataclass(frozen=True)
class ImagePart:
    """An image as the request sent it: the encoded bytes, their media type, and where it sits: `message`,
    the index of the request's message that holds it; `offset`, the characters of that message's text
    before it; `where`, its JSON path, named in errors."""

    data: bytes = field(repr=False)  # up to tens of MB: never in a log line
    media_type: str
    message: int
    offset: int
    where: str


@dataclass(frozen=True)
class PreparedImage:
    """What the vision encoder consumes: normalised pixels `[3, height, width]` and the token grid."""

    pixels: torch.Tensor
    rows: int  # image-token rows after the 3×3 unfold
    cols: int
    tokens: int  # the whole block: image tokens, row newlines, padding, start and end


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
            "image URLs are not fetched (this server makes no outbound requests); "
            "send the image inline as a data URL, data:image/png;base64,..."
        )
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma or not head.endswith(";base64"):
        raise ImageError("the image URL must be a base64 data URL, data:image/png;base64,...")
    return from_base64(data, head[len("data:") : -len(";base64")])


def decode(part: ImagePart):  # -> PIL.Image.Image (Pillow is imported here only)
    """The image as RGB: the first frame, the EXIF orientation applied, alpha composited on gray."""
    from PIL import Image, ImageOps

    try:
        image = Image.open(io.BytesIO(part.data), formats=FORMATS)
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


def block_tokens(rows: int, cols: int) -> int:
    """The tokens of a `rows` × `cols` image block (the module docstring's layout)."""
    padded_rows = rows + rows % 2
    line = cols + 1
    return padded_rows * line + (padded_rows // 2 * line) % 2 * 2 + 2


def grid(height: int, width: int) -> tuple[int, int]:
    """The token rows and columns of a canvas `height` × `width` (whole patches)."""
    return math.ceil(height // PATCH / ALIGN), math.ceil(width // PATCH / ALIGN)


def _shrunk(width: int, height: int, budget: int) -> tuple[int, int]:
    """The canvas for a block of about `budget` tokens: the grid whose `rows`·(`cols` + 1) + 2 tokens make
    `budget` at the image's aspect ratio, its rows made even, the image scaled into it and floored to
    whole patches. A very tall image gets one column, a very wide one two rows."""
    cell, ratio = PATCH * ALIGN, height / width
    across = math.sqrt((budget - 2) / ratio + 0.25) - 0.5  # the root of (w·ratio)·(w + 1) + 2 = budget
    if across < 1:
        rows = (budget - 2) // 2
        return cell, (rows - rows % 2) * cell
    if across * ratio < 2:
        return ((budget - 2) // 2 - 1) * cell, 2 * cell
    cols, rows = math.floor(across), math.floor(across * ratio)
    scale = min(cols * cell / width, (rows - rows % 2) * cell / height)
    return max(PATCH, math.floor(width * scale / PATCH) * PATCH), max(PATCH, math.floor(height * scale / PATCH) * PATCH)


def canvas_size(width: int, height: int) -> tuple[int, int]:
    """The canvas (width, height), in whole patches, an image of `width` × `height` is laid out on: the
    image covered by whole patches, or, when that block is over the budget, the largest `_shrunk` canvas
    whose block fits."""
    if width * height < MIN_PIXELS:
        scale = math.sqrt(MIN_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    limit = MAX_IMAGE_TOKENS - COMPRESS_PAD
    canvas = (math.ceil(width / PATCH) * PATCH, math.ceil(height / PATCH) * PATCH)
    budget = limit
    while block_tokens(*grid(canvas[1], canvas[0])) > limit:
        canvas, budget = _shrunk(width, height, budget), budget - 1
    return canvas


def prepare_image(part: ImagePart) -> PreparedImage:
    from PIL import ImageOps

    image = decode(part)
    width, height = canvas_size(*image.size)
    fitted = ImageOps.pad(image, (width, height), color=GRAY)
    pixels = torch.from_numpy(np.asarray(fitted, dtype=np.float32)).permute(2, 0, 1) / 255.0
    rows, cols = grid(height, width)
    return PreparedImage((pixels - 0.5) / 0.5, rows, cols, block_tokens(rows, cols))
