"""DSML tags as the model writes them, drift included, for the parser to read in place of the canonical ones.

After long contexts the model sometimes spells a tag slightly wrong: a lookalike bracket (`‹` or `＜`
for `<`, `›` or `＞` for `>`), an ASCII `|` for the fullwidth bar `｜` or a bar left out, or
`toolcalls` / `tool-calls` for `tool_calls`. Such a tag is unambiguous (no prose or value spells
`DSML` between brackets by chance), so the parser accepts it as the canonical tag. Only tags drift
this way; names and values are read exactly.

A tag is a sequence of slots, each a tuple of accepted spellings ("" for a slot that may be absent),
so a match can also say "the text ends inside a possible tag", which a streaming parser must wait on.
"""

from __future__ import annotations

from dataclasses import dataclass

from dwarfstar.prompt import dsml

_OPEN_BRACKETS = ("<", "‹", "＜")
_CLOSE_BRACKETS = (">", "›", "＞")
_BARS = ("｜", "|", "")
_UNDERSCORES = ("_", "", "-", " ")


@dataclass(frozen=True, slots=True)
class Hit:
    at: int
    size: int  # characters of the tag; 0 when the text ends inside a possible tag (wait for more)

    @property
    def partial(self) -> bool:
        return self.size == 0


class Tag:
    """One DSML tag (e.g. `</｜DSML｜invoke>`) with the spellings the parser accepts for it."""

    def __init__(self, canonical: str) -> None:
        self.canonical = canonical
        self.slots = _slots(canonical)
        self.longest = sum(max(len(spelling) for spelling in slot) for slot in self.slots)

    def match(self, text: str, at: int = 0) -> int | None:
        """Characters of the tag starting at `text[at]`; 0 if `text` ends inside a possible spelling of
        it; None if none can start there."""
        end = _match(self.slots, text, 0, at)
        if end is None:
            return None
        return 0 if end == _WAIT else end - at

    def find(self, text: str, start: int = 0) -> Hit | None:
        """The first spelling at or after `start`: full, or partial when it runs to the end of `text`
        (a partial one holds only the tag's characters, a bracket first, so no full one lies after it)."""
        for at in range(start, len(text)):
            if text[at] in _OPEN_BRACKETS:
                size = self.match(text, at)
                if size is not None:
                    return Hit(at, size)
        return None


def _slots(canonical: str) -> tuple[tuple[str, ...], ...]:
    slots: list[tuple[str, ...]] = []
    literal = ""
    rest = canonical
    while rest:
        for piece, spellings in _DRIFT:
            if rest.startswith(piece):
                if literal:
                    slots.append((literal,))
                    literal = ""
                slots.extend(spellings)
                rest = rest[len(piece) :]
                break
        else:
            literal, rest = literal + rest[0], rest[1:]
    if literal:
        slots.append((literal,))
    return tuple(slots)


# Longest pieces first: `｜DSML｜` before its bars.
_DRIFT: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    (dsml.DSML, (_BARS, ("DSML",), _BARS)),
    ("tool_calls", (("tool",), _UNDERSCORES, ("calls",))),
    ("<", (_OPEN_BRACKETS,)),
    (">", (_CLOSE_BRACKETS,)),
)


_WAIT = -1  # the text ends inside a possible spelling


def _match(slots: tuple[tuple[str, ...], ...], text: str, slot: int, at: int) -> int | None:
    """Where a spelling of `slots[slot:]` starting at `at` ends; _WAIT; or None."""
    if slot == len(slots):
        return at
    waiting = False
    for spelling in slots[slot]:
        if text.startswith(spelling, at):
            end = _match(slots, text, slot + 1, at + len(spelling))
            if end is not None and end != _WAIT:
                return end
            waiting = waiting or end == _WAIT
        elif at + len(spelling) > len(text) and spelling.startswith(text[at:]):
            waiting = True
    return _WAIT if waiting else None


BLOCK_OPEN = Tag(dsml.BLOCK_OPEN)
BLOCK_CLOSE = Tag(dsml.BLOCK_CLOSE)
INVOKE_OPEN = Tag(dsml.INVOKE_OPEN)
INVOKE_CLOSE = Tag(dsml.INVOKE_CLOSE)
PARAM_OPEN = Tag(dsml.PARAM_OPEN)
PARAM_CLOSE = Tag(dsml.PARAM_CLOSE)
