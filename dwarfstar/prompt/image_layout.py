"""The token layout of one image block in the prompt, per vision encoder family (issue 34).

An image of `rows` × `cols` image tokens (the aligner's grid, its rows in reading order) takes a block
of tokens where its placeholder stood. Each position has a type; an IMAGE position takes one aligner
row, the others a learned vector of the encoder (`image_start`, `image_pad`, `image_newline`,
`image_end`). The facts are those of DeepSeek's `inference/image_processor.py` as vLLM's ports and ds4's
`ds4_image.c` restate them (they agree):

- **Vision-Exp** (`VISION_EXP`, the "N-layout"; types `ExpToken`): first 0 to 3 PAD tokens, as many as
  put START at a position ≡ 3 (mod 4) of the token stream, so the body starts on a multiple of 4 (the KV
  compressor's groups); START; the rows, an odd count made even by one more row of PADs, each row `cols`
  IMAGE and a NEWLINE (the extra row all PAD), emitted in pairs and column-major inside a pair: (2p, 0),
  (2p + 1, 0), (2p, 1), (2p + 1, 1) ... (2p, cols), (2p + 1, cols); 0 or 2 PADs making the body a multiple
  of 4; END. The IMAGE slots are not in reading order: `perm` names each one's aligner row.
- **V4.1** (`V41`, types `V41Token`): START, then each row's `cols` IMAGE and a NEWLINE, then END; no
  pad, no interleave, the same wherever the block starts; the IMAGE slots in reading order.

`block_tokens` is a block's length without the leading pads: the image budget counts it (the pads
depend on where the block lands, at most `COMPRESS_PAD`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from dwarfstar.model.vision import V41, VISION_EXP

COMPRESS_PAD = 3  # the most pad tokens Vision-Exp's 4-token alignment puts before a block


class ExpToken(IntEnum):
    """A Vision-Exp block position's type (ds4's and the reference's numbering)."""

    START = 0
    PAD = 1
    IMAGE = 2
    NEWLINE = 3
    END = 4


class V41Token(IntEnum):
    """A V4.1 block position's type (renumbered: V4.1 has no pad)."""

    START = 0
    IMAGE = 1
    NEWLINE = 2
    END = 3


@dataclass(frozen=True)
class ImageLayout:
    """One image block: each position's type, in order; `perm[k]`, the aligner row (r·cols + c) the
    k-th IMAGE position takes; `pad`, the leading PAD positions before START (Vision-Exp only)."""

    types: tuple[ExpToken, ...] | tuple[V41Token, ...]
    perm: tuple[int, ...]
    pad: int

    def __len__(self) -> int:
        return len(self.types)


def block_tokens(family: str, rows: int, cols: int) -> int:
    """The tokens of a `rows` × `cols` block without its leading pads: what the image budget counts."""
    line = cols + 1
    if family == V41:
        return rows * line + 2
    pairs = (rows + 1) // 2
    return 2 * pairs * line + (pairs * line) % 2 * 2 + 2


def layout(family: str, rows: int, cols: int, start: int) -> ImageLayout:
    """The block of a `rows` × `cols` image whose first token sits at position `start` of the stream."""
    if rows < 1 or cols < 1 or start < 0:
        raise ValueError(f"an image block of {rows} × {cols} tokens at position {start}")
    if family == VISION_EXP:
        return _vision_exp(rows, cols, start)
    if family == V41:
        return _v41(rows, cols)
    raise ValueError(f"unknown vision encoder family {family!r}")


def _vision_exp(rows: int, cols: int, start: int) -> ImageLayout:
    pad = COMPRESS_PAD - start % 4
    types = [ExpToken.PAD] * pad + [ExpToken.START]
    perm = []
    for top in range(0, rows, 2):  # a pair of rows; past the last row, the extra one is all PAD
        for c in range(cols + 1):
            for r in (top, top + 1):
                if r >= rows:
                    types.append(ExpToken.PAD)
                elif c == cols:
                    types.append(ExpToken.NEWLINE)
                else:
                    types.append(ExpToken.IMAGE)
                    perm.append(r * cols + c)
    body = len(types) - pad - 1
    types += [ExpToken.PAD] * (body % 4) + [ExpToken.END]  # a body of pairs is even: 0 or 2 more
    return ImageLayout(tuple(types), tuple(perm), pad)


def _v41(rows: int, cols: int) -> ImageLayout:
    line = (V41Token.IMAGE,) * cols + (V41Token.NEWLINE,)
    return ImageLayout((V41Token.START, *line * rows, V41Token.END), tuple(range(rows * cols)), 0)
