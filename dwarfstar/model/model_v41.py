"""A DeepSeek V4.1 model as the session layer drives it (`backends.protocol.Backend`), over any backend's
`Ops41`: `forward_v41.Transformer41` and what every backend's V4.1 model shares (the input checks, one
sequence after another in a batch, `all_logits` one token per call, sampling). A backend subclasses it
with its ops, its states (`new_state`) and its DSpark stages' ops (`dspark_ops`): the reference's
`ReferenceModel41`, Triton's, MLX's.

A batch runs its sequences one after another. `all_logits` over several tokens runs them one at a time
(any split of a sequence into calls gives the same logits: tests/v41/test_v41_forward.py); an image
block then enters a row at a time, which the forward allows since V4.1's blocks attend causally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic

import torch

from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.forward import ExpertSource, forward_then_sample
from dwarfstar.model.forward_v41 import A, Capture41, Ops41, Transformer41
from dwarfstar.model.image_spans import ImageSpan, check_ids
from dwarfstar.sampling import Sampler, sample_batch

if TYPE_CHECKING:
    from dwarfstar.gguf.reader import GGUFFile
    from dwarfstar.model.dspark_v41 import DSparkOps41


class Model41(ABC, Generic[A]):
    def __init__(self, ops: Ops41[A], max_seq_len: int | None = None) -> None:
        """`max_seq_len`: the longest sequence (None: the model's)."""
        self.args: ModelArgs41 = ops.args
        self.max_seq_len = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        self.transformer = Transformer41(ops)

    @property
    def experts(self) -> ExpertSource:
        """Where the MoE reads the routed experts from (`Ops41.experts`): a backend entry's
        `attach_experts` sets a streamed cache here (`--ssd-streaming`), as it does on a V4 model."""
        return self.transformer.ops.experts

    @experts.setter
    def experts(self, source: ExpertSource) -> None:
        self.transformer.ops.experts = source

    def hold(self, first: int, last: int) -> None:
        """Run only layers first..last-1, as one stage of a route (`forward_v41.slice_problem` says which
        slices cannot be one); the weights are read as the layers first run, so the others stay unread."""
        self.transformer = Transformer41(self.transformer.ops, range(first, last))

    @property
    def layer_range(self) -> range:
        """The layers this model runs: all of them, or a stage's."""
        return self.transformer.held

    @abstractmethod
    def new_state(self) -> Any:
        """An empty sequence in the backend's arrays (`forward_v41.State41`, with the session's `logits`,
        `snapshot` and `restore`)."""

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: Any,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
        capture: Capture41[A] | None = None,
    ) -> torch.Tensor:
        """Logits after the tokens, which continue `state`: [T, vocab] with `all_logits`, else [1, vocab];
        `state.logits` holds the last one's. Bad input is refused before the state changes. `capture`
        records its layers' inputs, a call at a time (`forward_v41.Capture41`)."""
        ids, spans = self.check_call(tokens, state, images)
        if all_logits:
            steps = [self.transformer.forward([t], state, _row(spans, i), capture) for i, t in enumerate(ids)]
        else:
            steps = [self.transformer.forward(ids, state, spans, capture)]
        logits = torch.stack(steps)
        state.logits = logits[-1]
        return logits

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[Any],
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
            self.check_call(tokens, state, mine)
        return [self.forward(t, s, all_logits, i) for t, s, i in zip(token_lists, states, spans, strict=True)]

    @abstractmethod
    def dspark_ops(self, args: ModelArgs41, weights: GGUFFile) -> DSparkOps41:
        """The backend's steps for a DSpark drafter's stages (`model.dspark_v41`): the layers of `args`
        (`dspark_v41.stage_args41`) over `weights`, a view of the support file and the target's shared
        tensors."""

    # the sampling rules run on the logits' device (the CPU: `head` returns host logits), one sync per step
    sample_batch = staticmethod(sample_batch)

    def decode_sample(self, tokens: Sequence[int], states: Sequence[Any], samplers: Sequence[Sampler]) -> list[int]:
        return forward_then_sample(self, tokens, states, samplers)

    def check_call(
        self, tokens: Sequence[int] | torch.Tensor, state: Any, images: Sequence[ImageSpan] | None
    ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """A call's token ids and image spans, refused (before any state changes) where they do not fit."""
        ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if not ids.numel():
            raise DwarfStarError("a forward call needs at least one token")
        if state.pos + ids.numel() > self.max_seq_len:
            raise ContextOverflowError(
                f"context overflow: {state.pos} + {ids.numel()} tokens exceed the context of {self.max_seq_len}"
            )
        spans = tuple(images or ())
        for span in spans:
            if span.attend is not None:
                raise DwarfStarError(
                    "a DeepSeek V4.1 image block attends causally: this block has Vision-Exp's bidirectional window"
                )
            span.check_width(self.args.dim)
        check_ids(ids, spans, self.args.vocab_size)
        return ids.tolist(), spans


def _row(spans: tuple[ImageSpan, ...], i: int) -> tuple[ImageSpan, ...]:
    """The one-token call at index `i` of a call with `spans`: the row of the block holding it, if any."""
    return tuple(ImageSpan(0, s.rows[i - s.offset : i - s.offset + 1]) for s in spans if s.offset <= i < s.stop)
