"""An image as the language model takes it: the encoder's rows, laid out as the image's block (issue 34).

`ImageEncoder` holds a loaded encoder (`model.vision_file.VisionFile`) on a backend (its
`vision_ops`) and turns a prepared image (`prompt.images.prepare_image`) into the rows of its block at
a given position of the token stream: the block's layout (`prompt.image_layout.layout`: Vision-Exp's
depends on the position, through its leading compress pads) with each position's row, the learned
`image_start` / `image_pad` / `image_newline` / `image_end` vectors for the structure and the aligner's
rows (by the layout's `perm`) for the image content.

The encoder's output depends only on the image's bytes, so it is kept by their SHA-256 digest, least
recently used first out, within a byte budget: a conversation that sends the same screenshot in every
turn encodes it once. The digest is also what the block's token ids are made from
(`model.image_spans.content_ids`), so the prefix caches tell two images apart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.backends.registry import BackendEntry
from dwarfstar.model.image_spans import ImageSpan, content_ids
from dwarfstar.model.vision import VISION_EXP, VisionArgs, VisionEncoder, special_vectors
from dwarfstar.model.vision_file import VisionFile
from dwarfstar.prompt.image_layout import ImageLayout, layout
from dwarfstar.prompt.images import ImageError, ImagePart, PreparedImage, digest, prepare_image, split_slots
from dwarfstar.tokenizer.specials import PromptPart
from dwarfstar.tokenizer.tokenizer import Tokenizer

CACHE_BYTES = 256 << 20  # encoder outputs kept: a 4096-wide 366-token image is 6 MB in float32


@dataclass(frozen=True)
class PlacedImage:
    """An image at its place in a prompt, its pixels not yet through the encoder: `offset`, its block's
    first position in the sequence (an index into ids placed from position 0); the block's layout
    there; the digest of the image's bytes (the block's ids and the encoder cache's key); and
    `attend`: START and END as indices into the block, the range Vision-Exp's window attention reads
    both ways (None for V4.1, whose image tokens attend causally). Placing needs no encoder (a
    request's ids, and whether they fit the context, are known before the engine runs it);
    `ImageEncoder.span` makes the block's rows."""

    offset: int
    image: PreparedImage
    layout: ImageLayout
    digest: bytes
    attend: tuple[int, int] | None

    @property
    def length(self) -> int:
        return len(self.layout)


class ImageEncoder:
    def __init__(self, vision: VisionFile, entry: BackendEntry, cache_bytes: int = CACHE_BYTES) -> None:
        self.args: VisionArgs = vision.args
        self.encoder = VisionEncoder(entry.vision_ops(vision.args, vision.weights()))
        self.vectors = {name: vision.tensor(name).float() for name in special_vectors(vision.args.family)}
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the encoder (cache misses)

    def content(self, image: PreparedImage, key: bytes) -> torch.Tensor:
        """The aligner's rows [rows·cols, out_dim] of `image` (float32, host), from the cache by `key`."""
        rows = self._cache.get(key)
        if rows is not None:
            self._cache.move_to_end(key)
            return rows
        out = self.encoder.encode(image.pixels, image.grid)
        rows = (out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))).float().cpu()
        self.encoded += 1
        self._cache[key] = rows
        while sum(r.nbytes for r in self._cache.values()) > self.cache_bytes and len(self._cache) > 1:
            self._cache.popitem(last=False)
        return rows

    def span(self, placed: PlacedImage) -> ImageSpan:
        """The placed image's block as the forward takes it: its rows in the layout's order."""
        rows = assemble(placed.layout, self.content(placed.image, placed.digest), self.vectors)
        return ImageSpan(placed.offset, rows, placed.attend)


def place_image(args: VisionArgs, image: PreparedImage, key: bytes, start: int) -> PlacedImage:
    """`image` (whose bytes' digest is `key`) placed with its first token at position `start` of the
    sequence."""
    plan = layout(args.family, image.rows, image.cols, start)
    attend = (plan.pad, len(plan) - 1) if args.family == VISION_EXP else None
    return PlacedImage(start, image, plan, key, attend)


def place(
    args: VisionArgs,
    tokenizer: Tokenizer,
    parts: Sequence[PromptPart],
    images: Sequence[ImagePart],
    base: int = 0,
) -> tuple[list[int], list[PlacedImage]]:
    """The ids of a rendered prompt whose text holds image slots (`prompt.images.slot`), each slot
    replaced by its image's block for the encoder `args`, and the images placed: `base` tokens come
    before these ids, and a block's offset is its position in the sequence, `base` plus its index in
    these ids (where Vision-Exp's leading pads depend on it). A block's
    ids come from the image's digest and the block's length, which Vision-Exp's leading pads change
    (`content_ids`), so a prefix cache matches the same image at the same alignment, and nothing else.
    Every image must have its one slot (a template that dropped its message is a clear error), in any
    order: a conversation may render messages in another order than an API reads their parts (an
    Anthropic turn's tool results before its text). Decoding and resizing each image is the work
    here; nothing runs the encoder."""
    pieces = split_slots(parts)
    slots = [piece for piece in pieces if isinstance(piece, int)]
    if sorted(slots) != list(range(len(images))):
        raise ImageError(
            f"the prompt places images {slots}, not each of the {len(images)} images once (a message's text may "
            "not hold U+E000/U+E001 sequences: they stand for images)"
        )
    ids: list[int] = []
    placed: list[PlacedImage] = []
    for piece in pieces:
        if isinstance(piece, list):
            ids += tokenizer.encode_prompt(piece)
            continue
        part = images[piece]
        key = digest(part.data)
        image = place_image(args, prepare_image(part, args), key, start=base + len(ids))
        ids += content_ids(key, image.length, tokenizer.vocab_size)
        placed.append(image)
    return ids, placed


def expand(
    encoder: ImageEncoder,
    tokenizer: Tokenizer,
    parts: Sequence[PromptPart],
    images: Sequence[ImagePart],
    base: int = 0,
) -> tuple[list[int], list[ImageSpan]]:
    """`place`, then each block's rows from `encoder`: the ids and the blocks as the forward takes them
    (offsets counting the `base` tokens before the ids)."""
    ids, placed = place(encoder.args, tokenizer, parts, images, base)
    return ids, [encoder.span(image) for image in placed]


def assemble(plan: ImageLayout, content: torch.Tensor, vectors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The block's rows: each structural position its learned vector, the k-th IMAGE position the
    content row `plan.perm[k]`."""
    by_name = {t.name: f"image_{t.name.lower()}" for t in type(plan.types[0])}
    rows = torch.empty(len(plan), content.shape[1], dtype=torch.float32)
    image = [i for i, t in enumerate(plan.types) if t.name == "IMAGE"]
    rows[image] = content[list(plan.perm)]
    for i, t in enumerate(plan.types):
        if t.name != "IMAGE":
            rows[i] = vectors[by_name[t.name]]
    return rows
