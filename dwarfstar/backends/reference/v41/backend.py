"""A V4.1 model on the torch reference as the session layer drives it (`backends.protocol.Backend`):
`forward_v41.Transformer41` over `ReferenceOps41`, one `SequenceState41` per sequence.

A batch runs its sequences one after another. `all_logits` over several tokens runs them one at a
time (any split of a sequence into calls gives the same logits: tests/v41/test_v41_forward.py).
Image blocks are refused: V4.1's image input is not wired yet (issue 33).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dwarfstar.backends.reference.v41.model import ReferenceOps41
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import FAMILY41, ModelFile41
from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.forward_v41 import Transformer41
from dwarfstar.model.image_spans import ImageSpan, check_ids
from dwarfstar.model.state_v41 import SequenceState41, new_sequence41
from dwarfstar.sampling import Sampler, sample_batch


class ReferenceModel41:
    def __init__(self, ops: ReferenceOps41, max_seq_len: int | None = None) -> None:
        """`max_seq_len`: the longest sequence (None: the model's)."""
        self.args: ModelArgs41 = ops.args
        self.max_seq_len = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        self.transformer = Transformer41(ops)

    @classmethod
    def from_file(cls, model: ModelFile41, engram_cache_bytes: int, max_seq_len: int | None = None) -> ReferenceModel41:
        """The model over `model`'s weights, its Engram rows read through a cache of `engram_cache_bytes`."""
        return cls(ReferenceOps41.from_file(model, engram_cache_bytes), max_seq_len)

    def new_state(self) -> SequenceState41:
        return new_sequence41(self.args)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState41,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        """Logits after the tokens, which continue `state`: [T, vocab] with `all_logits`, else [1, vocab];
        `state.logits` holds the last one's. Bad input is refused before the state changes."""
        ids = self._check(tokens, state, images)
        if len(ids) > 1:  # a prompt's rows, read ahead (a decode step's 48 are not worth the hand-off)
            self.transformer.ops.prefetch([*state.tokens, *ids], state.pos)
        steps = [[t] for t in ids] if all_logits else [ids]
        logits = torch.stack([self.transformer.forward(step, state) for step in steps])
        state.logits = logits[-1]
        return logits

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState41],
        all_logits: bool = False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Each sequence's `forward`, one after another, all checked before any runs."""
        if len(token_lists) != len(states):
            raise DwarfStarError(f"{len(token_lists)} token lists for {len(states)} states")
        if len({id(s) for s in states}) != len(states):
            raise DwarfStarError("a sequence state appears twice in one batch")
        spans = [None] * len(states) if images is None else list(images)
        for tokens, state, mine in zip(token_lists, states, spans, strict=True):
            self._check(tokens, state, mine)
        return [self.forward(t, s, all_logits) for t, s in zip(token_lists, states, strict=True)]

    # the sampling rules run on the logits' device (here the CPU), one host sync per step
    sample_batch = staticmethod(sample_batch)

    def decode_sample(
        self, tokens: Sequence[int], states: Sequence[SequenceState41], samplers: Sequence[Sampler]
    ) -> list[int]:
        return forward_then_sample(self, tokens, states, samplers)

    def _check(
        self, tokens: Sequence[int] | torch.Tensor, state: SequenceState41, images: Sequence[ImageSpan] | None
    ) -> list[int]:
        if images:
            raise DwarfStarError(f"{FAMILY41} reads no images yet: its image input is not wired (issue 33)")
        ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if not ids.numel():
            raise DwarfStarError("a forward call needs at least one token")
        if state.pos + ids.numel() > self.max_seq_len:
            raise ContextOverflowError(
                f"context overflow: {state.pos} + {ids.numel()} tokens exceed the context of {self.max_seq_len}"
            )
        check_ids(ids, (), self.args.vocab_size)
        return ids.tolist()
