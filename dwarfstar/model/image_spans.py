"""Image blocks in a language-model call (issue 34; facts and sources: shared/spec/RELEASES_2026.md).

An image block takes a run of positions in a sequence. The caller has already assembled the block's
embeddings (the encoder's learned start/pad/newline/end vectors and the aligner rows, in the layout's
order: `dwarfstar.prompt.image_layout`); the language model needs to know where the block sits, its rows,
and how the two places that treat images differently see it:

- routing: every position of the block is an image position (Vision-Exp masks `input_ids >= vocab`: all
  its positions, the leading PADs included), whose router selects by the layer's image bias `bias_vl`;
- attention (Vision-Exp): inside START..END (inclusive; the leading PADs are outside) the sliding-window
  branch is bidirectional: a position i sees back to max(start, i - (REACH - 1)) and forward to
  min(end, i + REACH), beyond its causal window; the compressed rows and the indexer stay causal.

The ids at a block's positions are any ids in [vocab_size, 2**31) (`IMAGE_IDS`): the model reads them only
to know the positions are image positions (their rows come from the span; a table looked up by id, the
embedding or a hash layer's, reads 0 there). Vision-Exp's sentinels `vocab_size + type` (five types, START
0, PAD 1, IMAGE 2, NEWLINE 3, END 4) are such ids, but two images of the same size would then give the
same token list, and every token-based prefix match (live sessions, checkpoints, the disk KV cache) would
reuse one image's KV for the other. So the caller gives each block ids that identify its image:
`content_ids(digest, length, vocab_size)`, from the image's content hash and the block's length, distinct
within the block. `check_batch` allows ids past the vocabulary at span positions and nowhere else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from dwarfstar.errors import DwarfStarError

REACH = 384  # Vision-Exp's `vision_max_n_token`: how far a span position sees across its span
IMAGE_IDS = 2**31  # ids at span positions lie in [vocab_size, IMAGE_IDS): a saved state keeps tokens as u32


def content_ids(digest: bytes, length: int, vocab_size: int) -> list[int]:
    """The ids of an image block of `length` positions whose image has content hash `digest`: in
    [vocab_size, IMAGE_IDS), distinct within the block, each a hash of the digest, the length and its
    index (so another image, or the same image laid out to another length, shares no id at the same
    index but by a 64-bit hash collision's chance, and token-based prefix matches stop at the block)."""
    if not 0 < vocab_size < IMAGE_IDS or length < 0:
        raise DwarfStarError(f"no image ids for a block of {length} positions past a vocabulary of {vocab_size}")
    if length > IMAGE_IDS - vocab_size:
        raise DwarfStarError(f"an image block of {length} positions has more positions than image ids")
    n = IMAGE_IDS - vocab_size
    seed = hashlib.blake2b(bytes(digest) + length.to_bytes(8, "little"), digest_size=32).digest()
    ids: list[int] = []
    seen: set[int] = set()
    for i in range(length):
        salt = 0
        while True:  # a repeat within the block (about length**2 / 2**32 for the first) draws again
            key = i.to_bytes(8, "little") + salt.to_bytes(4, "little")
            draw = vocab_size + int.from_bytes(hashlib.blake2b(key, key=seed, digest_size=8).digest(), "little") % n
            if draw not in seen:
                break
            salt += 1
        seen.add(draw)
        ids.append(draw)
    return ids


def cut_outside(spans: Iterable[ImageSpan], cut: int) -> int:
    """`cut`, an index into a call's tokens where a pass would end, moved out of the image block it
    falls inside (`spans`: the blocks, offsets into the same tokens): back to the block's start, or,
    where the block starts the call, on to its end (no pass can split a block)."""
    for span in spans:
        if span.offset < cut < span.stop:
            return span.stop if span.offset == 0 else span.offset
    return cut


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image block in one sequence's call.

    `offset`: the block's first position (a leading PAD, or START) as an index into the call's tokens;
    `rows`: its embeddings [length, dim], float32, in position order (they replace the embedding rows
    before the hyper-connection expansion); `attend`: START and END as indices into the block, the
    inclusive range whose window attention is bidirectional (Vision-Exp), or None where the block
    attends causally.
    """

    offset: int
    rows: torch.Tensor
    attend: tuple[int, int] | None = None

    @property
    def length(self) -> int:
        return int(self.rows.shape[0])

    @property
    def stop(self) -> int:
        """The call index just past the block."""
        return self.offset + self.length

    def check(self, n_tokens: int) -> None:
        """A clear error unless the rows are [length >= 1, dim], the block lies wholly inside a call of
        `n_tokens` tokens and `attend` lies inside the block."""
        if self.rows.dim() != 2 or self.length < 1:
            raise DwarfStarError(f"an image span's rows must be [length >= 1, dim], not {list(self.rows.shape)}")
        if self.offset < 0 or self.stop > n_tokens:
            raise DwarfStarError(
                f"an image span at {self.offset}..{self.stop - 1} does not lie inside the call's {n_tokens} "
                "tokens: an image block must be prefilled whole in one call"
            )
        if self.attend is not None:
            first, last = self.attend
            if not 0 <= first <= last < self.length:
                raise DwarfStarError(f"an image span's START..END {first}..{last} is not inside its {self.length} rows")

    def check_width(self, dim: int) -> None:
        """A clear error unless the rows are as wide as the model's hidden size."""
        if self.rows.shape[-1] != dim:
            raise DwarfStarError(
                f"an image span's rows are {self.rows.shape[-1]} wide; the model's hidden size is {dim}"
            )

    def window_bounds(self, base: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each position i of START..END (`base`: the position of the call's first token), the
        inclusive range of keys its window branch reads: (positions [S], lo [S], hi [S]).

        The Vision-Exp reference's visible window: left = min(i - start, REACH - 1), right = min(end - i,
        REACH); a row of `window + REACH` keys from first = max(0, i - (window - 1) - max(0, left -
        (window - 1))), those past i + right masked. So lo = first and hi = min(i + right, first +
        window + REACH - 1): the causal window [i - window + 1, i] and the span around i.
        """
        if self.attend is None:
            raise DwarfStarError("this image span attends causally: it has no bidirectional window")
        start, end = (base + self.offset + a for a in self.attend)
        i = torch.arange(start, end + 1)
        left, right = (i - start).clamp(max=REACH - 1), (end - i).clamp(max=REACH)
        lo = (i - (window - 1) - (left - (window - 1)).clamp(min=0)).clamp(min=0)
        hi = torch.minimum(i + right, lo + window + REACH - 1)
        return i, lo, hi


def window_reach(spans: tuple[ImageSpan, ...], start: int, length: int, window: int) -> torch.Tensor | None:
    """int64 [length, 2]: the first and last raw row each query of a chunk of `length` tokens from
    position `start` reads, as indices into its window rows (the min(start, window) rows before the
    chunk, oldest first, then the chunk's): its causal window, or inside a bidirectional span's
    START..END the span's reach too (`ImageSpan.window_bounds`: one range holding both). None where no
    span is bidirectional: every query's window is causal."""
    spans = tuple(span for span in spans if span.attend is not None)
    if not spans:
        return None
    shift = min(start, window) - start  # a position's index in the window rows
    own = torch.arange(start, start + length) + shift
    reach = torch.stack(((own - (window - 1)).clamp(min=0), own), 1)
    for span in spans:
        at, lo, hi = span.window_bounds(start, window)
        reach[at - start] = torch.stack((lo, hi), 1) + shift
    return reach


def router_biases(biases: Mapping[int, torch.Tensor], layers: range, n_experts: int) -> dict[int, torch.Tensor]:
    """The image router biases (`bias_vl`, from the vision encoder file: `VisionFile.image_router_biases`)
    of the held `layers`, float32 [n_experts] each; a clear error unless every held layer has one of
    n_experts values (others are ignored)."""
    missing = [il for il in layers if il not in biases]
    if missing:
        raise DwarfStarError(f"no image router bias for layer(s) {missing}")
    checked = {}
    for il in layers:
        bias = torch.as_tensor(biases[il], dtype=torch.float32).reshape(-1)
        if bias.numel() != n_experts:
            raise DwarfStarError(f"layer {il}'s image router bias has {bias.numel()} values for {n_experts} experts")
        checked[il] = bias
    return checked


def check_router_biases(held: Iterable[object | None]) -> None:
    """A clear error unless a backend holds each of its layers' image router biases (`held`: one per
    held layer, None where it has none): `Ops.check_images`'s."""
    if any(bias is None for bias in held):
        raise DwarfStarError(
            "image spans need the image router biases (layers.{i}.ffn.gate.bias_vl, in the vision encoder file): "
            "none are attached to this model"
        )


def image_mask(spans: tuple[ImageSpan, ...], n_tokens: int) -> torch.Tensor:
    """bool [n_tokens]: the call's positions that route as image positions (every position of a block)."""
    mask = torch.zeros(n_tokens, dtype=torch.bool)
    for span in spans:
        mask[span.offset : span.stop] = True
    return mask


def check_ids(tokens: torch.Tensor, spans: tuple[ImageSpan, ...], vocab_size: int) -> None:
    """A call's ids: its spans' image ids (`check_spans`), every other id in the vocabulary."""
    text = tokens[~check_spans(tokens, spans, vocab_size)] if spans else tokens
    bad = text[(text < 0) | (text >= vocab_size)]
    if bad.numel():
        raise DwarfStarError(f"token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})")


def check_spans(tokens: torch.Tensor, spans: tuple[ImageSpan, ...], vocab_size: int) -> torch.Tensor:
    """The image mask of one sequence's call (`image_mask`) once its spans are known to lie inside it, in
    order, apart, and to hold only image ids (past the vocabulary, below `IMAGE_IDS`)."""
    n, last = tokens.numel(), 0
    for span in spans:
        span.check(n)
        if span.offset < last:
            raise DwarfStarError(f"image spans overlap or are out of order (one starts at {span.offset})")
        last = span.stop
        ids = tokens[span.offset : span.stop]
        bad = ((ids < vocab_size) | (ids >= IMAGE_IDS)).nonzero()
        if bad.numel():
            at = int(bad[0])
            raise DwarfStarError(
                f"position {span.offset + at} of an image span holds id {int(ids[at])}, not an image id "
                f"({vocab_size}..{IMAGE_IDS - 1})"
            )
    return image_mask(spans, n)
