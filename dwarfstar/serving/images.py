"""Image parts of the three chat APIs, read into `prompt.images.ImagePart` (validation.py, `media`).

- Chat Completions: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or the
  URL as a bare string);
- Responses: `{"type": "input_image", "image_url": "data:..."}`; a `file_id` is refused (no Files API);
- Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`; a `url` source is
  refused.

An http(s) URL is refused: the server makes no outbound requests. At most `MAX_IMAGES` images a
request. `check_images` then decodes each (a corrupt image is a 400 naming its part) and refuses them
all when the model has no vision encoder, so an image is never silently dropped.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from dwarfstar.prompt.images import MAX_IMAGES, ImageError, ImagePart, decode, from_base64, from_url
from dwarfstar.serving.errors import ApiError, bad_request

NO_VISION = "this model has no vision encoder; send text only, or serve a model with vision"


class Images(list[ImagePart]):
    """The images of one request, in the order they appear, refused past `MAX_IMAGES`."""

    def read(self, part: Any, kind: str, *, message: int, offset: int, where: str) -> None:
        """The image `part` of type `kind`, in the request's message `message` after `offset` characters
        of its text."""
        if len(self) == MAX_IMAGES:
            raise bad_request(f"{where}: at most {MAX_IMAGES} images a request", param=where)
        try:
            self.append(ImagePart(*_read(part, kind), message=message, offset=offset, where=where))
        except ImageError as exc:
            raise bad_request(f"{where}: {exc}", param=where) from None


def _read(part: dict[str, Any], kind: str) -> tuple[bytes, str]:
    if kind == "image_url":  # Chat Completions
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return from_url(url)
    if kind == "input_image":  # Responses
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise ImageError("file_id images are not supported (this server has no Files API); send image_url")
        return from_url(part.get("image_url"))
    source = part.get("source")  # Messages
    if not isinstance(source, dict) or source.get("type") != "base64":
        got = source.get("type") if isinstance(source, dict) else None
        raise ImageError(
            f"image source of type {got!r} is not supported (this server makes no outbound requests); "
            'send {"type": "base64", "media_type": ..., "data": ...}'
        )
    return from_base64(source.get("data"), source.get("media_type"))


async def check_images(images: list[ImagePart], vision: bool) -> None:
    """Each image decodes (else a 400 naming the part), and the model can see them (else a 400)."""
    if not images:
        return

    def decode_all() -> None:
        for part in images:
            try:
                decode(part)
            except ImageError as exc:
                raise bad_request(f"{part.where}: {exc}", param=part.where) from None

    try:
        await run_in_threadpool(decode_all)
    except ImportError:  # no Pillow installed: still say what matters most
        if vision:
            raise ApiError(500, "reading images needs Pillow: pip install 'pillow>=11'") from None
    if not vision:
        raise bad_request(f"{images[0].where}: {NO_VISION}", param=images[0].where)
