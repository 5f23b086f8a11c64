"""Reasoning efforts: which preamble opens a thinking prompt, by release.

DeepSeek changed its encoder's effort table after the V4 preview releases:
- the preview (V4 Flash and PRO as first published): `max` opens the prompt with the "Absolute maximum"
  preamble, and nothing else adds one;
- Flash 0731 and PRO 0813 (the releases with a DSpark drafter): `low`, the default, adds nothing,
  `high` adds the "Absolute maximum" preamble and `max` the new "Beyond maximum" one.

An API's effort names map onto these levels as the vLLM and SGLang servers map them (`minimal` is
`low`, `medium` is `high`, `xhigh` is `max`; `none` turns thinking off, elsewhere). `max` needs a context
of THINK_MAX_MIN_CTX tokens, as in ds4; below it, a request for it gets the release's next level down.
Which release a model file is: `ModelArgs.reasoning_efforts` (dwarfstar/model/config.py).
"""

from __future__ import annotations

from dwarfstar.model.config import DSPARK_RELEASES, PREVIEW
from dwarfstar.prompt import templates

THINK_MAX_MIN_CTX = 393_216  # ds4 allows Think-Max only with a context this large
LEVELS = (None, "low", "high", "max")  # what the renderer takes; None: the release's default
_PREAMBLES = {
    PREVIEW: {"max": templates.REASONING_EFFORT_ABSOLUTE},
    DSPARK_RELEASES: {"high": templates.REASONING_EFFORT_ABSOLUTE, "max": templates.REASONING_EFFORT_BEYOND},
}
_ALIASES = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def preamble(release: str, level: str | None) -> str:
    """The text that opens a thinking prompt at `level` (one of LEVELS) for `release`."""
    return _PREAMBLES[release].get(level or "", "")


def effort_level(release: str, effort: str | None, ctx: int) -> str | None:
    """The renderer's level for an API effort name (None when absent): `max` only with a context of
    THINK_MAX_MIN_CTX, else the level below it, which for the preview adds no preamble."""
    level = _ALIASES.get(effort or "")
    if level == "max" and ctx < THINK_MAX_MIN_CTX:
        level = "high"
    return level if preamble(release, level) else None
