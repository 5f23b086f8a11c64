"""The draft's side of one speculating sequence: its state following the target, the target's final
streams not fed to it yet, and its last row, from which it proposes.

A `DraftTrack` lives where the target's final streams are computed: in the speculator's own process
on one machine, on the last stage of a route (`dwarfstar.distributed.drafting`), so the streams
never travel. What the speculator decides (which tokens pair with the held rows, how many drafts)
is computed from positions alone (`paired_tokens`), so a route's coordinator tells its last stage
the same feeds one process would make.
"""

from __future__ import annotations

from typing import Any

import torch

from dwarfstar.sampling import Sampler
from dwarfstar.speculative.mtp import MTPDraft
from dwarfstar.speculative.verify import draw, next_uniform, rule_probabilities


def paired_tokens(known: list[int], fed_to: int, target_pos: int, shift: int) -> list[int]:
    """The tokens of the draft rows now due: one per held target row from `fed_to` whose paired
    token (`shift` after it) is in `known`, the sequence as far as it is known."""
    end = min(target_pos, len(known) - shift)
    return known[fed_to + shift : end + shift] if end > fed_to else []


def margin_of(logits: torch.Tensor) -> float:
    """ds4's confidence gate: the top-1 / top-2 logit gap."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


class HeldRows:
    """A draft's state following the target from position `base`, and the rows a target pass left
    for the positions it has not read yet (`hidden`, of positions fed_to .. fed_to + held - 1)."""

    def __init__(self, state: Any, base: int) -> None:
        self.state, self.base = state, base
        self.hidden: Any = None

    @property
    def fed_to(self) -> int:
        """The target position the draft's next row reads."""
        return self.base + self.state.pos

    @property
    def held(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]

    def cut(self, target_pos: int) -> bool:
        """The target went back to `target_pos`: drop the held rows past it. False when the draft had
        already read past it (its state cannot go back; the track is lost)."""
        keep = target_pos - self.fed_to
        if keep < 0:
            return False
        if keep < self.held:
            self.hidden = self.hidden[:keep] if keep else None
        return True


class DraftTrack(HeldRows):
    """The MTP block's state from target position `base`, the held target streams and its last row."""

    layers: tuple[int, ...] = ()  # no target layer's streams but the final ones

    def __init__(self, draft: MTPDraft, shift: int, base: int) -> None:
        super().__init__(draft.new_state(), base)
        self.draft, self.shift = draft, shift
        self.last: tuple[torch.Tensor, Any] | None = None  # the draft's last row: logits, output streams

    @property
    def ready(self) -> bool:
        """The draft has a row to propose from."""
        return self.last is not None

    def rows(self, streams: Any, captured: dict[int, Any], rows: slice) -> Any:
        """What a pass leaves for the draft: the target's final streams of the sequence's rows."""
        return streams

    def hold(self, streams: Any) -> None:
        """Keep the target's final streams of the positions just computed."""
        self.hidden = streams if self.hidden is None else self.draft.model.cache.storage.cat((self.hidden, streams))

    def feed(self, known: list[int], target_pos: int) -> None:
        """Draft rows for every held row whose paired token is known (`known`: the sequence)."""
        tokens = paired_tokens(known, self.fed_to, target_pos, self.shift)
        if tokens:
            self.feed_rows(tokens)

    def feed_rows(self, tokens: list[int]) -> None:
        """The first len(tokens) held rows, each paired with its token, through the draft."""
        count = len(tokens)
        rows, rest = self.hidden[:count], self.hidden[count:]
        self.last = self.draft.rows(rows, tokens, self.state)
        self.hidden = rest if rest.shape[0] else None

    def propose(
        self, sequence: list[int], n: int, sampler: Sampler, margin: float
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Up to n drafts continuing `sequence` (the target's tokens and the pending one), drafting on
        the draft's own output from the second on; with their draft logits. The draft state is back
        where it was afterwards."""
        greedy = sampler.params.greedy
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        snap = self.state.snapshot() if n > 1 else None
        assert self.last is not None
        logits, streams = self.last
        sequence = list(sequence)
        for k in range(n):
            if k:
                token = sequence[self.fed_to + self.shift]
                logits, streams = self.draft.rows(streams, [token], self.state)
            if margin and margin_of(logits) < margin:
                break
            if greedy:
                token = int(logits.argmax())
            else:
                token = draw(rule_probabilities(logits, sampler.params), next_uniform(sampler))
            drafts.append(token)
            rows.append(logits)
            sequence.append(token)
        if snap is not None:
            self.state.restore(snap)
        return drafts, rows
