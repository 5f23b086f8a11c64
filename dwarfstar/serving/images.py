"""Image parts of the three chat APIs, read into `prompt.images.ImagePart` (validation.py, `media`).

- Chat Completions: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (or the
  URL as a bare string);
- Responses: `{"type": "input_image", "image_url": "data:..."}`; a `file_id` is refused (no Files API);
- Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`; a `url` source is
  refused.

An http(s) URL (an Anthropic `url` source) is refused: the server makes no outbound requests, unless
started with `--allow-image-urls`, when `Images.check` fetches it (`fetch_all`). At most `MAX_IMAGES` images a
request. Each image read leaves its slot in its message's text (`prompt.images.slot`), where the
service places its block (`engine.images.place`); `Images.check` decodes each first (a corrupt image
is a 400 naming its part). Without a vision encoder every image is refused, so none is ever silently
dropped, but one in a tool result, which becomes `[Unsupported image]`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.concurrency import run_in_threadpool

from dwarfstar.prompt.images import MAX_IMAGES, ImageError, ImagePart, decode, from_base64, from_url, slot, sniff
from dwarfstar.serving.errors import bad_request
from dwarfstar.serving.fields import MAX_BODY_BYTES
from dwarfstar.serving.validation import NO_VISION, unsupported_part

FETCH_SECONDS = 30.0  # each fetch's connect and read timeouts (serve --allow-image-urls)


class Images(list[ImagePart]):
    """The images of one request, in the order they are read, refused past `MAX_IMAGES`. `vision`: the
    model reads images (a vision encoder is loaded); `fetch`: http(s) URLs are fetched
    (`serve --allow-image-urls`), by `check`."""

    def __init__(self, vision: bool, fetch: bool = False) -> None:
        super().__init__()
        self.vision, self.fetch = vision, fetch
        self._urls: dict[int, str] = {}  # index -> the URL its bytes come from (`check` fetches them)

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
        url = _remote(part, kind) if self.fetch else None
        try:
            self.append(ImagePart(b"", "", where) if url else ImagePart(*_read(part, kind), where=where))
        except ImageError as exc:
            raise bad_request(f"{where}: {exc}", param=where) from None
        if url:
            self._urls[len(self) - 1] = url
        return slot(len(self) - 1)

    async def check(self) -> None:
        """Each image fetched (an http(s) URL, with `fetch`), each decodes (else a 400 naming the part),
        off the event loop, and the model can see them (else a 400 naming the first and the missing
        `--vision`)."""
        if self._urls and self.vision:  # without vision the request is refused: nothing to fetch
            fetched = await fetch_all(list(self._urls.values()), [self[n].where for n in self._urls])
            for n, image in zip(self._urls, fetched, strict=True):
                self[n] = image
            self._urls.clear()

        def decode_all() -> None:
            for part in (part for n, part in enumerate(self) if n not in self._urls):
                try:
                    decode(part)
                except ImageError as exc:
                    raise bad_request(f"{part.where}: {exc}", param=part.where) from None

        if self:
            await run_in_threadpool(decode_all)
        if self and not self.vision:
            raise bad_request(f"{self[0].where}: an image, but {NO_VISION}", param=self[0].where)


def _remote(part: dict[str, Any], kind: str) -> str | None:
    """The http(s) URL the image `part` names, if it names one."""
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    elif kind == "input_image":
        url = part.get("image_url")
    else:
        source = part.get("source")
        url = source.get("url") if isinstance(source, dict) and source.get("type") == "url" else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


async def fetch_all(urls: list[str], wheres: list[str]) -> list[ImagePart]:
    """The images at `urls` (`serve --allow-image-urls`), fetched together within `FETCH_SECONDS` and,
    all together, `MAX_BODY_BYTES` (the request body's own limit), each a PNG, JPEG, WebP or GIF by its
    first bytes; a failure is a 400 naming the part and what went wrong."""
    import httpx2

    budget = [MAX_BODY_BYTES]

    async def one(client: httpx2.AsyncClient, url: str, where: str) -> ImagePart:
        data = bytearray()
        try:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise bad_request(f"{where}: fetching {url} answered HTTP {response.status_code}", param=where)
                async for chunk in response.aiter_bytes():
                    data += chunk
                    budget[0] -= len(chunk)
                    if budget[0] < 0:
                        raise bad_request(
                            f"{where}: the images fetched for this request pass {MAX_BODY_BYTES >> 20} MiB", param=where
                        )
        except httpx2.HTTPError as exc:
            raise bad_request(f"{where}: cannot fetch {url}: {exc or type(exc).__name__}", param=where) from None
        media = sniff(bytes(data))
        if media is None:
            raise bad_request(f"{where}: {url} is not a PNG, JPEG, WebP or GIF image", param=where)
        return ImagePart(bytes(data), media, where)

    timeout = httpx2.Timeout(FETCH_SECONDS)
    async with httpx2.AsyncClient(timeout=timeout, follow_redirects=True, max_redirects=5) as client:
        return list(await asyncio.gather(*(one(client, url, where) for url, where in zip(urls, wheres, strict=True))))


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
            f"image source of type {got!r} is not supported (this server makes no outbound requests unless "
            'started with --allow-image-urls); send {"type": "base64", "media_type": ..., "data": ...}'
        )
    return from_base64(source.get("data"), source.get("media_type"))
