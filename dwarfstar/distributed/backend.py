"""`RouteBackend`: a route as the session layer's `Backend`, so `Session`, `decode_batch`, `run` and
`serve` drive it unchanged; a long single-sequence prefill goes in route chunks, pipelined when
`prefill_window` > 1."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from dwarfstar.distributed.pipeline import pipelined_prefill
from dwarfstar.distributed.protocol import DistError
from dwarfstar.distributed.route import ReplayNeeded, Route
from dwarfstar.distributed.route_state import RouteState
from dwarfstar.model.forward import Batch, forward_then_sample
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler, sample_batch


class RouteFront(ABC):
    """What a route backend of either family shows the session layer: states the route made and
    tracks, one sequence's call as a batch of one, the checks before any pass, and sampling on the
    coordinator (the last stage sends the head's logits back). `state_type`: the family's route state."""

    state_type: type = RouteState

    def __init__(self, route: Route) -> None:
        self.route, self.local = route, route.local
        self.args = route.local.args
        self.max_seq_len = route.local.max_seq_len

    def new_state(self) -> Any:
        state = self.state_type(self.route)
        self.route.live.add(state)
        return state

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: Any,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        return self.forward_batch([tokens], [state], all_logits, None if images is None else [images])[0]

    @abstractmethod
    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[Any],
        all_logits: bool = False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Each sequence's logits through the route (the family's passes)."""

    def check_call(self, states: Sequence[Any], images: Sequence[Sequence[ImageSpan]] | None) -> None:
        if images is not None and any(images):
            # the stages' messages carry token ids, and a stage rebuilds a lost session by replaying them
            raise DistError("image spans do not run over a distributed route (issue 34): run them on one machine")
        if any(not isinstance(s, self.state_type) or s.route is not self.route for s in states):
            raise DistError("a route runs only the states it made (backend.new_state())")

    # the sampling rules on the logits the last stage sent back (the generic sampler: the reference's
    # and MLX's own, and the one whose draws the Triton kernel's equal)
    sample_batch = staticmethod(sample_batch)

    def decode_sample(self, tokens: Sequence[int], states: Sequence[Any], samplers: Sequence[Sampler]) -> list[int]:
        """A decode step through the route, then the coordinator samples (the head's logits came back)."""
        return forward_then_sample(self, tokens, states, samplers)


class RouteBackend(RouteFront):
    """A route as the session layer's `Backend`: sessions, `decode_batch`, `run` and `serve` unchanged."""

    def __init__(self, route: Route) -> None:
        super().__init__(route)
        self._runner = None

    # speculation (`dwarfstar.speculative`): the draft on the last stage, the target through the route
    def mtp_draft(self):
        """The route's MTP draft (`load_draft` on a route); a clear error when the last stage has none."""
        from dwarfstar.distributed.speculation import RouteDraft

        head = self.route.drafting_stage()
        if head.dspark:
            raise DistError(
                f"the route's last stage (worker {head.worker} at {head.host}) drafts with DSpark, not the MTP "
                "block: give the coordinator the same --dspark FILE, or start that worker with --mtp FILE"
            )
        return RouteDraft(self.route)

    def dspark_draft(self, model: ModelFile, path: str | os.PathLike, confidence: float):
        """The route's DSpark drafter (`decode.load_speculation` on a route), its settings read from the
        support file `path` of `model` (the coordinator's --dspark FILE, checked as one process checks
        it); a clear error when the last stage has none or does not hold its target layers."""
        from dwarfstar.distributed.drafting import check_target_layers
        from dwarfstar.distributed.speculation import RouteDSpark
        from dwarfstar.speculative.dspark import open_dspark
        from dwarfstar.speculative.mtp_options import check_confidence

        check_confidence(confidence)
        d, gguf, _ = open_dspark(model, path)
        gguf.close()
        head = self.route.drafting_stage()
        if not head.dspark:
            raise DistError(
                f"the route's last stage (worker {head.worker} at {head.host}) drafts with the MTP block, not "
                "DSpark: start it with --dspark FILE"
            )
        check_target_layers(d.target_layers, head.layers)
        return RouteDSpark(self.route, d, confidence)

    def speculation_runner(self):
        from dwarfstar.distributed.speculation import RouteRunner

        if self._runner is None:
            self._runner = RouteRunner(self, self.route)
        return self._runner

    @torch.inference_mode()
    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits: bool = False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        self.check_call(states, images)
        with self.route.lock:
            self.route.check_complete()
            for state in states:
                self.route.sync(state)
            batch = self.local.batch(token_lists, states)
            out: dict[int, torch.Tensor] = {}
            if batch.seqs:
                for seq, logits in zip(batch.seqs, self._chunked(batch, all_logits), strict=True):
                    out[id(seq.state)] = logits
        empty = torch.empty(0, self.args.vocab_size)
        return [out.get(id(s), empty) for s in states]

    def _chunked(self, batch: Batch, all_logits: bool) -> list[torch.Tensor]:
        """One pass for a decode step or a short batch; a long single-sequence prefill in chunks of
        `prefill_chunk` tokens, so no stage holds a whole prompt's activations at once."""
        step = self.route.options.prefill_chunk
        if len(batch.seqs) > 1 or batch.n_rows <= step:
            return self.route.forward([seq.tokens for seq in batch.seqs], [seq.state for seq in batch.seqs], all_logits)
        (seq,) = batch.seqs
        parts = None
        if self.route.options.prefill_window > 1:
            try:
                parts = pipelined_prefill(self.route, seq.state, seq.tokens, all_logits)
            except ReplayNeeded as why:  # the state is back where it was, marked for replay
                self.route.mismatches += 1
                self.route.log(f"[dist] {why}: replaying the session, then prefilling chunk by chunk")
                self.route.rebuild(seq.state)
        if parts is None:
            chunks = [seq.tokens[at : at + step] for at in range(0, seq.length, step)]
            parts = [self.route.forward([chunk], [seq.state], all_logits)[0] for chunk in chunks]
        return [torch.cat(parts) if all_logits else parts[-1]]
