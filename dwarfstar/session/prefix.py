"""Prefix reuse for stateless clients, which resend the whole conversation on every request.

Two matches, in order (the second is ds4's, DS4_SURFACE §4.3):
1. token prefix: keep the longest common prefix of the cached and the new prompt tokens;
2. rendered bytes: if the cached tokens decode to a prefix of the new rendered prompt, keep them
   all and tokenize only the rest. This catches a generated token whose text the client sends
   back and which BPE now splits differently ("ab" sampled as "a" + "b"), where the token match
   would throw away everything after it.

The prefill that follows keeps checkpoints where the messages a client is likeliest to change start,
and at the prompt's end (`checkpoint_marks`): a new conversation after the same system prompt, a
thinking turn's `<think>` closed by the next request, a retried turn, each cut back to one of those
places, replays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.prompt.render import Prompt
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.specials import ASSISTANT, USER, Control, PromptPart
from dwarfstar.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReusePlan:
    keep: int  # cached tokens kept
    suffix: list[int]  # tokens to prefill after them
    match: str  # "tokens", "text" or "none"
    images: list[ImageSpan] = field(default_factory=list)  # the image blocks among `suffix` (offsets into it)


FIRST_RUN = 256  # tokens compared in the first slice; each further slice doubles
MARK_GAP = 32  # fewest tokens between checkpoint marks (a pass each)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix. Integer arrays compare in one vectorised pass; lists
    compare slice against slice in C (list equality) instead of token by token in Python: slices
    double until one differs, then halving finds the first difference, so a mismatch at position k
    costs O(k) compared tokens whatever the lengths."""
    n = min(len(a), len(b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        differ = np.flatnonzero(a[:n] != b[:n])
        return int(differ[0]) if differ.size else n
    a = a if isinstance(a, list) else list(a)
    b = b if isinstance(b, list) else list(b)
    lo, step = 0, FIRST_RUN  # invariant: a[:lo] == b[:lo]
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # the first difference is in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def image_reuse(cached: Sequence[int], ids: Sequence[int], images: Sequence[ImageSpan]) -> tuple[int, list[ImageSpan]]:
    """The cached tokens a prompt `ids` with image blocks `images` (offsets into `ids`) keeps, and the
    blocks after them (offsets from the cut), for the prefill of the rest. Only the token match: a
    block's ids come from its image (`content_ids`), so the same image at the same place matches and
    nothing else does; a cut inside a block moves back to its start (a block is prefilled whole)."""
    keep = common_prefix_len(cached, ids)
    keep = next((s.offset for s in images if s.offset < keep < s.stop), keep)
    return keep, [replace(s, offset=s.offset - keep) for s in images if s.offset >= keep]


def parts_after(parts: Sequence[PromptPart], byte_offset: int) -> list[PromptPart] | None:
    """The prompt parts after `byte_offset` of its UTF-8 text; None if the offset cuts a character
    or a control token (then the bytes cannot be continued exactly)."""
    rest: list[PromptPart] = []
    seen = 0
    for part in parts:
        raw = str(part).encode("utf-8")
        if seen >= byte_offset:
            rest.append(part)
        elif seen + len(raw) > byte_offset:
            if isinstance(part, Control):
                return None
            try:
                rest.append(raw[byte_offset - seen :].decode("utf-8"))
            except UnicodeDecodeError:
                return None
        seen += len(raw)
    return rest


def plan_reuse(cached: Sequence[int], prompt: Prompt, tokenizer: Tokenizer) -> ReusePlan:
    ids = tokenizer.encode_prompt(prompt.parts)
    k = common_prefix_len(cached, ids)
    # cached image ids (past the vocabulary) have no text: only the token match applies
    if k == len(cached) or max(cached) >= tokenizer.vocab_size:
        return ReusePlan(k, ids[k:], "tokens" if k else "none")
    cached_bytes = tokenizer.decode_bytes(cached)
    if prompt.text.encode("utf-8").startswith(cached_bytes):
        rest = parts_after(prompt.parts, len(cached_bytes))
        if rest is not None:
            return ReusePlan(len(cached), tokenizer.encode_prompt(rest), "text")
    return ReusePlan(k, ids[k:], "tokens" if k else "none")


def checkpoint_marks(plan: ReusePlan, tokenizer: Tokenizer) -> list[int]:
    """Where the plan's prefill keeps checkpoints, each just after a role token (where a message's
    content starts) and at the prompt's end:
    - the first user message's content (after the system prompt: where another conversation of the
      same client diverges, a new working directory or git status);
    - the last user message's, and the last assistant turn's (a retried or edited turn, a thinking
      prompt's `<think>`, which the next turn renders closed);
    - the end (a retried turn).
    A mark ends a pass, so one less than MARK_GAP tokens after the previous (or the cut) is left out:
    that pass would cost more than the replay it saves. The end ends a pass anyway."""
    user, assistant = tokenizer.token_id(USER), tokenizer.token_id(ASSISTANT)
    users = [i for i, token in enumerate(plan.suffix) if token == user]
    assistants = [i for i, token in enumerate(plan.suffix) if token == assistant]
    marks, last = [], plan.keep
    for i in sorted({*users[:1], *users[-1:], *assistants[-1:]}):
        if plan.keep + i + 1 - last >= MARK_GAP:
            last = plan.keep + i + 1
            marks.append(last)
    return [*marks, plan.keep + len(plan.suffix)]


def prefill_with_reuse(session: Session, prompt: Prompt, tokenizer: Tokenizer, **prefill_kwargs) -> ReusePlan:
    """Bring the session to the state after `prompt`, running only what the cache cannot supply and
    keeping a checkpoint where each new message starts."""
    plan = plan_reuse(session.tokens, prompt, tokenizer)
    session.truncate(plan.keep)
    session.mark(checkpoint_marks(plan, tokenizer))
    if plan.suffix:
        session.prefill(plan.suffix, **prefill_kwargs)
    return plan
