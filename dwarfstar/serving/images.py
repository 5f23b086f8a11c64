"""Image parts of the three chat APIs, read into `prompt.images.ImagePart` (validation.py, `media`).

- Chat Completions: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or the
  URL as a bare string);
- Responses: `{"type": "input_image", "image_url": "data:..."}`; a `file_id` is refused (no Files API);
- Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`; a `url` source is
  refused.

An http(s) URL is refused: the server makes no outbound requests. At most `MAX_IMAGES` images a
request. Each image read leaves its slot in its message's text (`prompt.images.slot`), where the
service places its block (`engine.images.place`); `Images.check` decodes each first (a corrupt image
is a 400 naming its part). Without a vision encoder every image is refused, so none is ever silently
dropped, but one in a tool result, which becomes `[Unsupported image]`.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from dwarfstar.prompt.images import MAX_IMAGES, ImageError, ImagePart, decode, from_base64, from_url, slot
from dwarfstar.serving.errors import bad_request
from dwarfstar.serving.validation import NO_VISION, unsupported_part


class Images(list[ImagePart]):
    """The images of one request, in the order they are read, refused past `MAX_IMAGES`. `vision`: the
    model reads images (a vision encoder is loaded)."""

    def __init__(self, vision: bool) -> None:
        super().__init__()
        self.vision = vision

    def read(self, part: Any, kind: str, where: str, *, tool: bool = False) -> str:
        """The image `part` of type `kind`: read, and the text that stands for it in its message, its
        slot (`prompt.images.slot`). Without a vision encoder an image is refused (400, `check`), but one in a
        tool result (`tool`: an agent's read of an image file) is the text `[Unsupported image]`, as
        the DeepSeek V4 encoder writes a tool message's non-text part (validation.py, `media`).
        Without one the others are still read and decoded (`check`), so a bad image is named first."""
        if tool and not self.vision:
            return unsupported_part(kind)
        if len(self) == MAX_IMAGES:
            raise bad_request(f"{where}: at most {MAX_IMAGES} images a request", param=where)
        try:
            self.append(ImagePart(*_read(part, kind), where=where))
        except ImageError as exc:
            raise bad_request(f"{where}: {exc}", param=where) from None
        return slot(len(self) - 1)

    async def check(self) -> None:
        """Each image decodes (else a 400 naming the part), off the event loop, and the model can see
        them (else a 400 naming the first and the missing `--vision`)."""

        def decode_all() -> None:
            for part in self:
                try:
                    decode(part)
                except ImageError as exc:
                    raise bad_request(f"{part.where}: {exc}", param=part.where) from None

        if self:
            await run_in_threadpool(decode_all)
        if self and not self.vision:
            raise bad_request(f"{self[0].where}: an image, but {NO_VISION}", param=self[0].where)


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
