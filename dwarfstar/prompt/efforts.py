"""Reasoning efforts: which preamble opens a thinking prompt, by release.

DeepSeek changed its encoder's effort table after the V4 preview releases:
- the preview (V4 Flash and PRO as first published): `max` opens the prompt with the "Absolute maximum"
  preamble, and nothing else adds one;
- Flash 0731 and PRO 0813 (the releases with a DSpark drafter): `low`, the default, adds nothing,
  `high` adds the "Absolute maximum" preamble and `max` the new "Beyond maximum" one;
- V4.1: a think level N in 1..100 opens every thinking prompt as `Reasoning Effort: N (range 1-100, ...)`
  (templates.THINK_LEVEL_PREFIX) behind the `<｜System｜>` token; the official encoder's presets are
  low 50, high 75 (its default) and max 100. Level 0 is no thinking (ds4's `--think-level 0`).

An API's effort names map onto these levels as the vLLM and SGLang servers map them (`minimal` is
`low`, `medium` is `high`, `xhigh` is `max`; `none` turns thinking off, elsewhere), for V4.1 too (so
`minimal` is 50 and `xhigh` 100). `max` needs a context of THINK_MAX_MIN_CTX tokens, as ds4's Think-Max
does; below it, a request for it gets the release's next level down (V4.1: 75). A V4.1 level given as a
number is taken as it is. Which release a model file is: `ModelArgs.reasoning_efforts`
(dwarfstar/model/config.py).
"""

from __future__ import annotations

from dwarfstar.model.config import DSPARK_RELEASES, PREVIEW, V41
from dwarfstar.prompt import templates
from dwarfstar.prompt.conversation import PromptError

THINK_MAX_MIN_CTX = 393_216  # ds4 allows Think-Max only with a context this large
LEVELS = (None, "low", "high", "max")  # what the renderer takes for a V4 release; None: the release's default
MAX_THINK_LEVEL = 100  # V4.1: 1..100 thinks at that effort, 0 does not think
PRESET_THINK_LEVELS = {"low": 50, "high": 75, "max": 100}  # V4.1's official presets; None is `high`
# what the renderer takes: a name in LEVELS, or for V4.1 also a think level 1..MAX_THINK_LEVEL
Effort = str | int | None
RELEASE_NAMES = {PREVIEW: "DeepSeek V4 preview", DSPARK_RELEASES: "DeepSeek V4 Flash 0731 / PRO 0813"}
_PREAMBLES = {
    PREVIEW: {"max": templates.REASONING_EFFORT_ABSOLUTE},
    DSPARK_RELEASES: {"high": templates.REASONING_EFFORT_ABSOLUTE, "max": templates.REASONING_EFFORT_BEYOND},
}
_ALIASES = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def has_think_levels(release: str) -> bool:
    """Whether `release` takes numeric think levels and opens system messages with `<｜System｜>` (V4.1)."""
    return release == V41


def think_level_error(release: str, what: str) -> str | None:
    """Why `what` (a flag or field setting a numeric think level) cannot apply to a model of `release`;
    None when it can."""
    if has_think_levels(release):
        return None
    return f"{what} needs a DeepSeek V4.1 model; this model is {RELEASE_NAMES[release]} (release {release!r})"


def check_effort(release: str, effort: Effort) -> None:
    """A PromptError unless `effort` is one the renderer takes for `release` (see `Effort`)."""
    if effort in LEVELS:  # no number equals one of them
        return
    if isinstance(effort, int) and not isinstance(effort, bool):
        problem = think_level_error(release, "a numeric reasoning effort")
        if problem:
            raise PromptError(problem)
        if 1 <= effort <= MAX_THINK_LEVEL:
            return
    raise PromptError(f"reasoning_effort must be one of low, high, max or unset, got {effort!r}")


def think_level(effort: Effort) -> int:
    """A V4.1 level for a checked `effort`: the preset a name stands for, V4.1's default for None."""
    if isinstance(effort, int):
        return effort
    return PRESET_THINK_LEVELS[effort or "high"]


def preamble(release: str, level: Effort) -> str:
    """The text that opens a thinking prompt at `level` (checked by `check_effort`) for `release`."""
    if has_think_levels(release):
        return templates.THINK_LEVEL_PREFIX.format(think_level(level))
    return _PREAMBLES[release].get(level or "", "")


def effort_level(release: str, effort: str | None, ctx: int) -> Effort:
    """The renderer's level for an API effort name (None when absent): `max` only with a context of
    THINK_MAX_MIN_CTX, else the level below it, which for the preview adds no preamble; V4.1's level
    as a number."""
    level = _ALIASES.get(effort or "")
    if level == "max" and ctx < THINK_MAX_MIN_CTX:
        level = "high"
    if has_think_levels(release):
        return think_level(level)
    return level if preamble(release, level) else None
