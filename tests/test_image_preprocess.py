"""prompt/images.py: reading an image part and laying it out for the vision encoder of each family.

Expected sizes and token counts are worked out here from the stated rules (patch 14, 3×3 patches a
token; Vision-Exp: at most 384 - 3 tokens counted with its pad row and pair padding, at least 384²
pixels, widths planned at most 8 heights and stretched past it; V4.1: at most 1,024 tokens counted
rows·(cols + 1) + 2, at least 544² pixels, no ratio limit), not read from the module.
"""

from __future__ import annotations

import base64
import io
import math
import struct
import zlib

import pytest
import torch
from PIL import Image

from dwarfstar.model.vision import V41, V41_FLASH, PatchGrid, VisionArgs
from dwarfstar.prompt.images import (
    ImageError,
    ImagePart,
    canvas_size,
    decode,
    from_base64,
    from_url,
    prepare_image,
)

EXP = VisionArgs()  # Vision-Exp's budget: 384 tokens, 147,456 pixels, ratio 8
V41_ARGS = V41_FLASH


def bf16(x: float) -> float:
    """`x` as float32, rounded to bfloat16 (the top 16 bits, to nearest, ties to even)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def normalised(value: int) -> float:
    """A channel value 0-255 as the encoder reads it: float32 (v/255 - 0.5)/0.5, then bfloat16."""
    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    return bf16(f32(f32(f32(value / 255) - 0.5) / 0.5))


GRAY_NORMALISED = normalised(127)


def encoded(image: Image.Image, fmt: str, **save) -> ImagePart:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return ImagePart(buffer.getvalue(), f"image/{fmt.lower()}", "messages[0].content[0]")


def test_a_data_url_is_read_into_its_bytes():
    assert from_url("data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()) == (b"\x89PNG", "image/png")


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("https://example.com/a.png", "not fetched"),
        ("http://example.com/a.png", "not fetched"),
        ("data:image/png,abc", "base64 data URL"),
        ("file:///etc/passwd", "base64 data URL"),
        ("data:image/bmp;base64,AAAA", "'image/bmp' is not supported"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64,", "non-empty"),
        (None, "non-empty string"),
    ],
)
def test_a_bad_url_is_refused_with_its_reason(url, fragment):
    with pytest.raises(ImageError, match=fragment):
        from_url(url)


def test_a_media_type_must_be_an_image_format():
    with pytest.raises(ImageError, match="'text/plain' is not supported"):
        from_base64("AAAA", "text/plain")


def test_corrupt_data_is_refused():
    part = encoded(Image.new("RGB", (8, 8)), "PNG")
    with pytest.raises(ImageError, match="not a readable image"):
        decode(ImagePart(part.data[:30], "image/png", "w"))
    with pytest.raises(ImageError, match="not a readable image"):
        decode(ImagePart(b"GIF89a nonsense", "image/gif", "w"))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` × `height` RGB pixels and whose data holds none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("size", [(0, 5), (5, 0), (0, 0)])
def test_a_zero_size_image_is_refused(size):
    with pytest.raises(ImageError):
        decode(ImagePart(png_header(*size), "image/png", "w"))
    with pytest.raises(ValueError, match="has no pixels"):
        canvas_size(*size)


def test_an_unsupported_format_is_refused_whatever_its_media_type_says():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "BMP")
    with pytest.raises(ImageError, match="not a readable image"):
        decode(ImagePart(buffer.getvalue(), "image/png", "w"))


def test_an_image_over_the_pixel_limit_is_refused_before_decoding():
    huge = encoded(Image.new("1", (8192, 8193)), "PNG")  # one bit a pixel: 8 MB here, a few KB encoded
    with pytest.raises(ImageError, match="^a 8192×8193 image is over 67,108,864 pixels; send a smaller one$"):
        decode(huge)


def test_the_exif_orientation_is_applied():
    image = Image.new("RGB", (60, 30), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 30, 30))  # the left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    upright = decode(encoded(image, "JPEG", exif=exif, quality=95))
    assert upright.size == (30, 60)
    red, blue = upright.getpixel((15, 10)), upright.getpixel((15, 50))  # the left half is now on top
    assert red[0] > 200 > red[2] and blue[2] > 200 > blue[0]


def test_alpha_is_composited_on_gray():
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    image.putpixel((1, 1), (255, 0, 0, 255))
    image.putpixel((2, 2), (255, 0, 0, 128))
    rgb = decode(encoded(image, "PNG"))
    assert rgb.mode == "RGB"
    assert rgb.getpixel((0, 0)) == (127, 127, 127)
    assert rgb.getpixel((1, 1)) == (255, 0, 0)
    half = rgb.getpixel((2, 2))  # 255·128/255 + 127·127/255 ≈ 191 red, 127·127/255 ≈ 63 green and blue
    assert abs(half[0] - 191) <= 1 and abs(half[1] - 63) <= 1 and abs(half[2] - 63) <= 1


def test_a_transparent_palette_colour_is_gray():
    image = Image.new("P", (4, 4), 0)
    image.putpalette([0, 0, 0, 255, 255, 255])
    image.putpixel((3, 3), 1)
    rgb = decode(encoded(image, "PNG", transparency=0))  # palette index 0, black, is transparent
    assert rgb.getpixel((0, 0)) == (127, 127, 127) and rgb.getpixel((3, 3)) == (255, 255, 255)


def test_a_gif_is_read_at_its_first_frame():
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100)
    rgb = decode(ImagePart(buffer.getvalue(), "image/gif", "w"))
    assert rgb.getpixel((4, 4)) == (255, 0, 0)


def test_webp_is_read():
    rgb = decode(encoded(Image.new("RGB", (16, 8), (0, 255, 0)), "WEBP", lossless=True))
    assert rgb.getpixel((3, 3)) == (0, 255, 0)


def tokens(family: str, h: int, w: int) -> int:
    """The budget count of an h × w token grid (the reference's formula, restated)."""
    if family == V41:
        return h * (w + 1) + 2
    return h * (w + 1) + 2 + (w + 1 if h % 2 else 0) + ((h + 1) // 2 * (w + 1)) % 2 * 2


def test_a_small_image_is_scaled_up_to_the_minimum():
    prepared = prepare_image(encoded(Image.new("RGB", (100, 100), (255, 255, 255)), "PNG"))
    # 100² < 384²: scaled by 3.84 to 384², covered by 28 patches of 14 (392 pixels), 10 tokens of 3
    # patches a side: 100 image tokens, 10 newlines, 5 row pairs of 11 (odd): 2 pads, start and end
    assert prepared.pixels.shape == (3, 392, 392)
    assert prepared.grid == PatchGrid(28, 28)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (10, 10, 10 * 11 + 2 + 2)
    assert prepared.pixels.max().item() == 1.0  # white: (1 - 0.5) / 0.5


def test_v41_scales_a_small_image_up_to_its_own_minimum():
    prepared = prepare_image(encoded(Image.new("RGB", (100, 100), (255, 255, 255)), "PNG"), V41_ARGS)
    # 100² < 544²: scaled to 544², 39 patches (546 pixels), 13 tokens a side: 13·14 + 2, no pad row
    assert prepared.pixels.shape == (3, 546, 546)
    assert prepared.grid == PatchGrid(39, 39)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (13, 13, 13 * 14 + 2)


def test_a_large_image_is_shrunk_into_the_token_budget():
    prepared = prepare_image(encoded(Image.new("RGB", (1400, 1400)), "PNG"))
    # 100 × 100 patches are 34 × 34 tokens, over 381. At ratio 1, w·(w + 1) + 2 = 381 gives
    # w = √379.25 − ½ = 18.97: 18 × 18 tokens (18 is even), 54 patches, 756 pixels a side;
    # 18·19 + 2 + 2 (9 row pairs of 19: odd) = 346 tokens
    assert (prepared.rows, prepared.cols, prepared.tokens) == (18, 18, 346)
    assert prepared.pixels.shape == (3, 756, 756)
    prepared = prepare_image(encoded(Image.new("RGB", (1400, 1400)), "PNG"), V41_ARGS)
    # V4.1: w·(w + 1) + 2 = 1,024 gives w = √1,022.25 − ½ = 31.47: 31 × 31 tokens, 1,302 pixels, 31·32 + 2
    assert (prepared.rows, prepared.cols, prepared.tokens) == (31, 31, 994)
    assert prepared.pixels.shape == (3, 1302, 1302)


def test_the_aspect_is_kept_and_the_rest_padded_gray():
    prepared = prepare_image(encoded(Image.new("RGB", (100, 50), (0, 0, 0)), "PNG"))
    _, height, width = prepared.pixels.shape
    # 100×50 scaled to at least 384² (×5.43) is 543×271: 39 patches across, 271 rounded up to 20 patches down
    assert (height, width) == (20 * 14, 39 * 14)
    assert (prepared.rows, prepared.cols) == (-(-height // 42), -(-width // 42))
    assert prepared.pixels[:, height // 2, width // 2].tolist() == [-1.0, -1.0, -1.0]  # black: (0 - 0.5) / 0.5
    # the image fitted to 546 wide is 273 high: 7 of the 280 rows are gray padding, above and below
    assert prepared.pixels[:, 0, width // 2].tolist() == [GRAY_NORMALISED] * 3
    assert prepared.pixels[:, height - 1, width // 2].tolist() == [GRAY_NORMALISED] * 3


def two_halves(width: int, height: int) -> ImagePart:
    image = Image.new("RGB", (width, height), (255, 0, 0))
    image.paste((0, 0, 255), (width // 2, 0, width, height))  # the right half blue
    return encoded(image, "PNG")


def test_an_image_wider_than_the_ratio_is_planned_at_it_and_stretched():
    prepared = prepare_image(two_halves(4096, 64))
    # planned as 512 × 64 (8:1), scaled up to 147,456 pixels (×2.12): 1086 × 135, covered 1092 × 140;
    # 4 × 26 tokens: 4·27 + 2 = 110. The image is stretched onto the whole canvas: no gray rows
    assert prepared.pixels.shape == (3, 140, 1092)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (4, 26, 110)
    red, blue = [normalised(255), normalised(0), normalised(0)], [normalised(0), normalised(0), normalised(255)]
    assert prepared.pixels[:, 0, 10].tolist() == red and prepared.pixels[:, 139, 10].tolist() == red
    assert prepared.pixels[:, 0, 1080].tolist() == blue and prepared.pixels[:, 139, 1080].tolist() == blue


def test_exactly_the_ratio_is_stretched_and_just_under_it_padded():
    # both plan to 1092 × 140 (1086 or 1085 × 135 covered); at 8:1 the image is stretched onto it, at
    # 799:100 fitted, 137 rows high, between two gray rows above and one below (Pillow centres by rounding)
    at = prepare_image(encoded(Image.new("RGB", (800, 100), (0, 0, 0)), "PNG"))
    under = prepare_image(encoded(Image.new("RGB", (799, 100), (0, 0, 0)), "PNG"))
    assert at.pixels.shape == under.pixels.shape == (3, 140, 1092)
    assert at.pixels[:, 0, 500].tolist() == [-1.0] * 3
    assert under.pixels[:, 1, 500].tolist() == under.pixels[:, 139, 500].tolist() == [GRAY_NORMALISED] * 3
    assert under.pixels[:, 2, 500].tolist() == under.pixels[:, 138, 500].tolist() == [-1.0] * 3


def test_v41_has_no_ratio_limit():
    prepared = prepare_image(two_halves(4096, 64), V41_ARGS)
    # 262,144 < 544²: ×1.0625 to 4352 × 68, covered 4354 × 70; 2 × 104 tokens, 2·105 + 2. Fitted, not
    # stretched: 4354 wide is 68 high, a gray row above and below
    assert prepared.pixels.shape == (3, 70, 4354)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (2, 104, 212)
    assert prepared.pixels[:, 0, 10].tolist() == [GRAY_NORMALISED] * 3
    assert prepared.pixels[:, 1, 10].tolist() == [normalised(255), normalised(0), normalised(0)]


@pytest.mark.parametrize(
    ("args", "size", "canvas"),
    [
        (EXP, (17, 9), (532, 280)),
        (EXP, (1920, 1080), (1036, 588)),
        (EXP, (2048, 2048), (756, 756)),
        (EXP, (4096, 64), (1092, 140)),
        (EXP, (8192, 1), (1092, 140)),
        # r = 0.9: at budgets 381 and 380, w = 20.03 and 20.0 give 20 × 18 tokens, 840 × 756, a block of
        # 18·21 + 2 + 2 = 382, over 381; at 379, w = 19.97: 19 across, 17.98 down made 16, the scale
        # min(19·42/800, 16·42/720) = 0.9333 makes 746.7 × 672, floored 742 × 672: 16 × 18 tokens, 306
        (EXP, (800, 720), (742, 672)),
        (EXP, (1, 8192), (42, 188 * 42)),  # one column, (381 - 2) // 2 = 189 rows made even
        (V41_ARGS, (17, 9), (756, 406)),
        (V41_ARGS, (1920, 1080), (1708, 966)),
        (V41_ARGS, (2048, 2048), (1302, 1302)),
        (V41_ARGS, (8192, 1), (1021 * 42, 42)),  # one row of 1,021: 1,022 + 2
        (V41_ARGS, (1, 8192), (42, 511 * 42)),  # one column of 511: 511·2 + 2
    ],
)
def test_the_worked_canvas_sizes(args, size, canvas):
    assert canvas_size(*size, args) == canvas


def test_a_wide_image_over_the_budget_is_solved_from_its_aspect():
    # 1920 × 1080 is 138 × 78 patches, 46 × 26 tokens: over 381. At r = 0.5625, w·r·(w + 1) + 2 = 381
    # gives w = √(379/r + ¼) − ½ = 25.46: 25 across, 14.32 down made 14. The scale
    # min(25·42/1920, 14·42/1080) = 0.5444 makes 1045.3 × 588, floored to patches 1036 × 588: 74 × 42
    # patches, 25 × 14 tokens, 14·26 + 2 = 366 (7 row pairs of 26: even)
    prepared = prepare_image(encoded(Image.new("RGB", (1920, 1080)), "PNG"))
    assert prepared.pixels.shape == (3, 588, 1036)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (14, 25, 366)
    # V4.1: w = √(1022/r + ¼) − ½ = 42.13: 42 across, 23.70 down, 23 (not made even); the scale
    # min(42·42/1920, 23·42/1080) = 0.8944 makes 1717.3 × 966, floored 1708 × 966: 23 × 41, 23·42 + 2
    assert canvas_size(1920, 1080, V41_ARGS) == (1708, 966)


SIDES = (1, 2, 9, 17, 64, 100, 383, 384, 545, 1000, 1080, 1920, 2048, 3000, 4096, 8192)


@pytest.mark.parametrize("args", [EXP, V41_ARGS], ids=["vision-exp", "v4.1"])
def test_every_plan_is_within_its_budget(args):
    limit = args.max_tokens - (3 if args.family != V41 else 0)
    for width in SIDES:
        for height in SIDES:
            w, h = canvas_size(width, height, args)
            assert w % 14 == h % 14 == 0 and w > 0 and h > 0, (width, height)
            grid = math.ceil(h / 42), math.ceil(w / 42)
            assert tokens(args.family, *grid) <= limit, (width, height, w, h)


def test_pixels_are_rounded_to_bfloat16():
    image = Image.new("RGB", (4, 4), (100, 127, 200))
    prepared = prepare_image(encoded(image, "PNG"))
    assert prepared.pixels.dtype == torch.float32 and prepared.pixels.is_contiguous()
    # (100/255 − ½)/½ = −0.2156863 in float32; to 8 significant bits −0.2158203125 (221/128 · 2⁻³)
    assert normalised(100) == -0.2158203125
    value = prepared.pixels[:, prepared.pixels.shape[1] // 2, prepared.pixels.shape[2] // 2].tolist()
    assert value == [normalised(100), normalised(127), normalised(200)]
    low_bits = prepared.pixels.view(torch.int32) & 0xFFFF
    assert not low_bits.any()
