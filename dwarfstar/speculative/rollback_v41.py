"""Rollback of a V4.1 state after a rejected draft without running the kept tokens again (V4's is
rollback.py).

The verifying pass runs [pending, d_1..d_n] from position `start` one token a call (as the model's
`all_logits` does); only the first `keep` of them stay. What the rejected tokens left behind, part by
part (`forward_v41.State41`):

- window rows: the state keeps the last window - 1 positions' rows, so a pass no longer than that still
  holds all of its own; the kept state's are the snapshot's followed by the kept tokens' of the pass.
- compressed rows and index keys: appended per finished group; the kept tokens finish the first
  (start + keep) // ratio of them, and the rejected tokens' come after.
- ratio-2 compressor frontiers: advanced past the kept tokens (in place, on Triton), and what they
  held is in no other part of the state; the pass records a copy of them after each call
  (`frontiers`), and the kept state takes the one after its last token.
- tokens and the next-token logits: the kept tokens', the logits of the last one's row.

No projection, attention or expert runs. Every row the kept state holds is the one the pass computed
one token a call, as plain decoding does: the state is plain decoding's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dwarfstar.model.forward_v41 import Ops41


def frontiers(ops: Ops41, state: Any) -> dict[int, tuple[Any, Any]]:
    """Copies of the state's compressor frontiers as they are now (a backend may advance them in place)."""
    return {il: tuple(ops.append(part[:0], part) for part in pair) for il, pair in state.frontiers.items()}  # type: ignore[misc]


def can_truncate41(window: int, verified: int) -> bool:
    """The state holds every window row of a pass of `verified` tokens only while they fit its window - 1."""
    return verified <= window - 1


def truncate41(
    ops: Ops41,
    state: Any,
    snap: Any,
    after: Sequence[dict[int, tuple[Any, Any]]],
    kept: int,
    logits: torch.Tensor,
) -> None:
    """Leave `state` as if only the first `kept` tokens of the pass after `snap` (its snapshot before the
    pass) had run: `after` holds the pass's `frontiers` after each of its calls, `logits` [T, vocab] its
    logits."""
    args, verified = ops.args, state.pos - snap.pos
    if not 1 <= kept <= verified or not can_truncate41(args.window, verified):
        raise ValueError(f"cannot truncate a pass of {verified} tokens to {kept}")
    end = snap.pos + kept
    for il, rows in state.windows.items():
        first = rows.shape[0] - verified  # the pass's first row
        joined = ops.append(snap.windows[il], rows[first : first + kept])
        state.windows[il] = joined[max(0, joined.shape[0] - (args.window - 1)) :]
    for il in state.rows:
        groups = end // args.compress_ratios[il]
        state.rows[il], state.index_keys[il] = state.rows[il][:groups], state.index_keys[il][:groups]
    state.frontiers = dict(after[kept - 1])
    del state.tokens[end:]
    state.logits = logits[kept - 1].clone()
