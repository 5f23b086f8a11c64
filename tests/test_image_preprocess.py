"""prompt/images.py: reading an image part and laying it out for the vision encoder.

Expected sizes and token counts are worked out here from the stated rules (patch 14, 3×3 patches a
token, a row newline, an odd last row padded, start and end tokens, at most 1,024 - 3 tokens, at least
544² pixels), not read from the module.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from dwarfstar.prompt.images import ImageError, ImagePart, decode, from_base64, from_url, prepare_image

GRAY_NORMALISED = (127 / 255 - 0.5) / 0.5


def encoded(image: Image.Image, fmt: str, **save) -> ImagePart:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return ImagePart(buffer.getvalue(), f"image/{fmt.lower()}", 0, 0, "messages[0].content[0]")


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
        decode(ImagePart(part.data[:30], "image/png", 0, 0, "w"))
    with pytest.raises(ImageError, match="not a readable image"):
        decode(ImagePart(b"GIF89a nonsense", "image/gif", 0, 0, "w"))


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
    rgb = decode(ImagePart(buffer.getvalue(), "image/gif", 0, 0, "w"))
    assert rgb.getpixel((4, 4)) == (255, 0, 0)


def test_webp_is_read():
    rgb = decode(encoded(Image.new("RGB", (16, 8), (0, 255, 0)), "WEBP", lossless=True))
    assert rgb.getpixel((3, 3)) == (0, 255, 0)


def test_a_small_image_is_scaled_up_to_the_minimum():
    prepared = prepare_image(encoded(Image.new("RGB", (100, 100), (255, 255, 255)), "PNG"))
    # 100² < 544²: scaled to 544², covered by 39 patches of 14 (546 pixels), 13 tokens of 3 patches a side
    assert prepared.pixels.shape == (3, 546, 546)
    assert (prepared.rows, prepared.cols) == (13, 13)
    # 169 image tokens, 13 newlines, an odd row count padded by a row of 14, start and end
    assert prepared.tokens == 13 * 13 + 13 + 14 + 2
    assert prepared.pixels.max().item() == 1.0  # white: (1 - 0.5) / 0.5


def test_a_large_image_is_shrunk_into_the_token_budget():
    prepared = prepare_image(encoded(Image.new("RGB", (1400, 1400)), "PNG"))
    # a k×k grid takes (k + k%2)(k + 1) + 2 tokens (+2 when its row pairs hold an odd count): k = 30 gives
    # 930 + 2 + 2 = 934 <= 1,021; k = 31 gives 32·32 + 2 = 1,026 > 1,021. 30 tokens a side: 90 patches, 1,260 px
    assert (prepared.rows, prepared.cols, prepared.tokens) == (30, 30, 934)
    assert prepared.pixels.shape == (3, 1260, 1260)


def test_the_aspect_is_kept_and_the_rest_padded_gray():
    prepared = prepare_image(encoded(Image.new("RGB", (100, 50), (0, 0, 0)), "PNG"))
    _, height, width = prepared.pixels.shape
    # 100×50 scaled to at least 544² (×7.69) is 770×385: 55 patches across, 385 rounded up to 28 patches down
    assert (height, width) == (28 * 14, 55 * 14)
    assert (prepared.rows, prepared.cols) == (-(-height // 42), -(-width // 42))
    assert prepared.pixels[:, height // 2, width // 2].tolist() == [-1.0, -1.0, -1.0]  # black: (0 - 0.5) / 0.5
    # the image's 385 rows leave 7 of the 392 to gray padding, above and below
    assert prepared.pixels[:, 0, width // 2].tolist() == pytest.approx([GRAY_NORMALISED] * 3)
    assert prepared.pixels[:, height - 1, width // 2].tolist() == pytest.approx([GRAY_NORMALISED] * 3)


def test_a_wide_image_over_the_budget_is_solved_from_its_aspect():
    prepared = prepare_image(encoded(Image.new("RGB", (1920, 1080)), "PNG"))
    # covered by whole patches (138 × 78 → 26 × 46 tokens) it is over 1,021 tokens. At the aspect ratio
    # r = 0.5625, w·r·(w + 1) + 2 = 1,021 gives w = √(1,019/r + ¼) − ½ = 42.07: 42 tokens across, 23.66 down,
    # made even: 22. The scale min(42·42/1920, 22·42/1080) = 0.8556 makes it 1642.7 × 924, floored to
    # patches 1,638 × 924: 117 × 66 patches, 39 × 22 tokens, 22·40 + 2 = 882 tokens (11 row pairs of 40: even)
    assert prepared.pixels.shape == (3, 924, 1638)
    assert (prepared.rows, prepared.cols, prepared.tokens) == (22, 39, 882)
