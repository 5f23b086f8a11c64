"""prompt/image_layout.py: the token layout of an image block, per vision encoder family.

The literal vectors are ds4's (`tests/test_deepseek4_vision_image.c`); the reference layouts below are
written here from the stated rules, position by position (which cell of the rows × (cols + 1) grid a
body position holds), not as the module builds them (cell by cell, in emission order).
"""

from __future__ import annotations

import pytest

from dwarfstar.model.vision import V41, VISION_EXP
from dwarfstar.prompt.image_layout import ExpToken, ImageLayout, V41Token, block_tokens, layout

SIZES = [(h, w) for h in range(1, 10) for w in range(1, 10)] + [(14, 25), (18, 18), (1, 188), (188, 1), (7, 13)]


@pytest.mark.parametrize(
    ("rows", "cols", "start", "types", "perm"),
    [
        (2, 3, 0, [1, 1, 1, 0, 2, 2, 2, 2, 2, 2, 3, 3, 4], [0, 3, 1, 4, 2, 5]),
        (3, 2, 5, [1, 1, 0, 2, 2, 2, 2, 3, 3, 2, 1, 2, 1, 3, 1, 4], [0, 2, 1, 3, 4, 5]),
        (1, 1, 3, [0, 2, 1, 3, 1, 4], [0]),
    ],
)
def test_ds4s_vision_exp_vectors(rows, cols, start, types, perm):
    block = layout(VISION_EXP, rows, cols, start)
    assert list(block.types) == types
    assert list(block.perm) == perm
    assert block.pad == types.index(0)
    assert all(isinstance(t, ExpToken) for t in block.types)


def reference_vision_exp(rows: int, cols: int, start: int) -> tuple[list[int], list[int]]:
    """START at the first position ≡ 3 (mod 4) from `start`, PADs before it; the body: rows made even,
    row length cols + 1, pairs of rows interleaved column by column; 0 or 2 PADs to a multiple of 4; END."""
    pad = next(k for k in range(4) if (start + k) % 4 == 3)
    line = cols + 1
    even_rows = rows + rows % 2
    types, perm = [1] * pad + [0], []
    for j in range(even_rows * line):
        pair, within = divmod(j, 2 * line)
        c, r = divmod(within, 2)
        r += 2 * pair
        if r == rows:  # the added row
            types.append(1)
        elif c == cols:
            types.append(3)
        else:
            types.append(2)
            perm.append(r * cols + c)
    tail = (even_rows // 2 * line) % 2 * 2
    return types + [1] * tail + [4], perm


def reference_v41(rows: int, cols: int) -> tuple[list[int], list[int]]:
    """START, each row's IMAGE tokens and a NEWLINE, END; IMAGE slots in reading order."""
    types, perm = [0], []
    for j in range(rows * (cols + 1)):
        r, c = divmod(j, cols + 1)
        if c == cols:
            types.append(2)
        else:
            types.append(1)
            perm.append(r * cols + c)
    return types + [3], perm


def budget_formula(family: str, h: int, w: int) -> int:
    """The note's budget count, without leading pads: Vision-Exp h(w+1) + 2, plus a PAD row for an odd h,
    plus 2 when the row pairs hold an odd count; V4.1 h(w+1) + 2."""
    if family == V41:
        return h * (w + 1) + 2
    return h * (w + 1) + 2 + (w + 1 if h % 2 else 0) + ((h + 1) // 2 * (w + 1)) % 2 * 2


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_vision_exp_matches_the_reference_at_every_start(rows, cols):
    for start in range(9):
        block = layout(VISION_EXP, rows, cols, start)
        assert (list(block.types), list(block.perm)) == reference_vision_exp(rows, cols, start)
        assert len(block) == block_tokens(VISION_EXP, rows, cols) + block.pad
        assert block_tokens(VISION_EXP, rows, cols) == budget_formula(VISION_EXP, rows, cols)
        assert block.pad == 3 - start % 4 and (start + block.pad) % 4 == 3  # START on 3 (mod 4)
        assert block.types[block.pad] == ExpToken.START and block.types[-1] == ExpToken.END
        assert (len(block) - block.pad - 2) % 4 == 0  # the body fills whole 4-token groups
        assert sorted(block.perm) == list(range(rows * cols))
        assert block.types.count(ExpToken.IMAGE) == rows * cols
        assert block.types.count(ExpToken.NEWLINE) == rows


@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_v41_is_reading_order_wherever_it_starts(rows, cols):
    for start in range(5):
        block = layout(V41, rows, cols, start)
        assert (list(block.types), list(block.perm)) == reference_v41(rows, cols)
        assert block.pad == 0
        assert len(block) == block_tokens(V41, rows, cols) == budget_formula(V41, rows, cols)
        assert all(isinstance(t, V41Token) for t in block.types)


def test_v41_literal():
    block = layout(V41, 2, 3, 7)
    assert block == ImageLayout((0, 1, 1, 1, 2, 1, 1, 1, 2, 3), (0, 1, 2, 3, 4, 5), 0)


@pytest.mark.parametrize(("family", "rows", "cols", "start"), [(VISION_EXP, 0, 3, 0), (V41, 2, 0, 0), (V41, 1, 1, -1)])
def test_an_empty_block_or_a_negative_start_is_refused(family, rows, cols, start):
    with pytest.raises(ValueError, match="an image block"):
        layout(family, rows, cols, start)


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown vision encoder family"):
        layout("v5", 1, 1, 0)
