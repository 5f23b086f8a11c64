"""The `Backend` protocol: what the session layer drives, whichever backend lowers the model.

This module imports no backend: the session, the server and the tools are written against it, and
`backends.registry` says which backend a run gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dwarfstar.model.config import ModelArgs
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler


class Backend(Protocol):
    args: ModelArgs

    def new_state(self) -> SequenceState: ...

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        """Logits after the tokens, which continue `state`. `images`: the call's image blocks
        (`dwarfstar.model.image_spans.ImageSpan`, offsets into `tokens`, each wholly inside it), or None;
        a backend that cannot run them refuses them with a clear error before any state changes."""
        ...

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits: bool,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Several sequences in one pass; `images`: each sequence's image blocks, as `forward` takes
        them (None: no sequence has any)."""
        ...

    def sample_batch(self, logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
        """One token per row of logits [B, vocab] on the backend's device, with one host sync."""
        ...

    def decode_sample(
        self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence[Sampler]
    ) -> list[int]:
        """A decode step (one token per state), then each state's next token drawn by its sampler, with
        one host sync; the states' logits are left as `forward_batch` leaves them. A backend that
        captures its decode step draws inside it."""
        ...
