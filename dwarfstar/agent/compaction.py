"""When to compact the context, and which verbatim tail survives it (ds4's COMPACT rules, §6).

Soft trigger: before a user turn, once the context is 85% full or has 8192 tokens free (that margin
capped at a quarter of the context, so small contexts still get room to work). Hard trigger: a tool
result that would not fit with HARD_RESERVE tokens to spare. The model then writes a durable-state
summary, and the transcript becomes system + summary + the newest entries that fit in TAIL_FRACTION
of the context (at most TAIL_MAX tokens), starting at a user turn so no reply loses its question.
"""

from __future__ import annotations

from collections.abc import Sequence

SOFT_FRACTION = 0.85
SOFT_FREE = 8192
HARD_RESERVE = 1024
SUMMARY_TOKENS = 4096
TAIL_FRACTION = 0.10
TAIL_MAX = 50000

SUMMARY_REQUEST = (
    "The context is nearly full and will be compacted. Write the durable state of this task, which will "
    "replace the conversation so far: the goal, what is done (files changed and how), what was learned "
    "(facts, commands, errors), and the next steps. Be complete but brief. Plain text, no tool calls."
)


def soft_due(used: int, ctx: int) -> bool:
    return used >= SOFT_FRACTION * ctx or ctx - used <= min(SOFT_FREE, ctx // 4)


def hard_due(used: int, incoming: int, ctx: int) -> bool:
    return used + incoming + HARD_RESERVE > ctx


def summary_budget(used: int, ctx: int) -> int:
    """Tokens the summary may take: SUMMARY_TOKENS, or what is left with the hard reserve kept."""
    return max(0, min(SUMMARY_TOKENS, ctx - used - HARD_RESERVE // 4))


def tail_start(kinds: Sequence[str], sizes: Sequence[int], ctx: int) -> int:
    """Index of the first entry of the kept tail: the earliest user turn from which the rest fits."""
    budget = min(int(TAIL_FRACTION * ctx), TAIL_MAX)
    start, total = len(kinds), 0
    for i in range(len(kinds) - 1, -1, -1):
        total += sizes[i]
        if total > budget:
            break
        if kinds[i] == "user":
            start = i
    return start
