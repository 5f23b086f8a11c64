"""The DSpark drafter of DeepSeek V4 Flash 0731, loaded from ds4's support GGUF (`--dspark FILE`) and run
on the target's backend (the model's description: dwarfstar/model/dspark.py).

The support file holds the stages (`mtp.{k}.*`, a V4 block each) and the heads; the embedding and the
output matrix are the target's. The stages are loaded as a model of `stage_args` through the
backend's own loader over a renaming view (`mtp.DraftFile`, as the MTP block is), so their rings live
in a KV cache like any layer's; the heads are read into torch float32.

`DSparkDraft` follows one sequence: `feed` writes the context rows of positions the target has
committed (from the streams its passes captured at the target layers), `propose` drafts a block after
an anchor token, the Markov head choosing each row's token after the one before, cut at the first row
whose confidence is below the threshold.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from dwarfstar.backends.registry import entry_of
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model.dspark import (
    ARCH,
    CONFIDENCE,
    MAIN,
    MARKOV,
    PREFIX,
    DSparkArgs,
    DSparkForward,
    DSparkHeads,
    check_support_arch,
    dspark_tensors,
    stage_args,
    stage_names,
)
from dwarfstar.model.forward import Transformer
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler
from dwarfstar.speculative.mtp import DraftFile
from dwarfstar.speculative.mtp_options import check_confidence
from dwarfstar.speculative.track import HeldRows
from dwarfstar.speculative.verify import draw, next_uniform, rule_probabilities

# the Ops a backend needs for the drafter's passes (the reference, MLX and Triton backends have them)
DSPARK_OPS = ("extend_window", "block_attention", "hc_collapse", "output_norm")


class DSparkConfidenceError(DwarfStarError):
    """The confidence head gave a value that is not a number: the drafter's weights are broken."""


def open_dspark(model: ModelFile, path: str | os.PathLike) -> tuple[DSparkArgs, GGUFFile, ModelFile]:
    """ds4's support file for `model`: its settings, the file, and the stages as a model for a backend's
    loader. A clear error when it is missing, is not a support file or belongs to another model."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"DSpark support file not found: {path}")
    gguf = GGUFFile(path)
    try:
        check_support_arch(gguf.metadata, ARCH, str(path), str(model.path))
        d = DSparkArgs.from_metadata(gguf.metadata, model.args, str(path))
        stages = {int(name.split(".")[1]) for name in gguf.tensors if name.startswith("mtp.")}
        missing = sorted(set(range(d.stages)) - stages)
        if missing:
            raise ModelFileError(f"{path} has {d.stages} stages in its metadata but no tensors of stage {missing}")
        for spec in dspark_tensors(model.args, d):
            try:
                tt.check_tensor(spec, gguf.tensors.get(spec.name))
            except ModelFileError as exc:
                raise ModelFileError(f"{path}: the DSpark drafter does not fit {model.path}: {exc}") from exc
        sources = {own: (gguf, name) for own, name in stage_names(model.args, d).items()}
        for shared in (tt.EMBED, tt.OUTPUT):
            sources[shared] = (model.gguf, shared)
        view = DraftFile(sources, dict(gguf.metadata))
        return d, gguf, ModelFile(path, view, stage_args(model.args, d))  # type: ignore[arg-type]
    except BaseException:
        gguf.close()
        raise


def load_heads(gguf: GGUFFile, d: DSparkArgs, eps: float) -> DSparkHeads:
    first, last = PREFIX.format(0), PREFIX.format(d.stages - 1)

    def read(name: str) -> torch.Tensor:
        return gguf.tensor(name).float()

    return DSparkHeads(
        read(first + MAIN[0]),
        read(first + MAIN[1]),
        read(last + MARKOV[0]),
        read(last + MARKOV[1]),
        read(last + CONFIDENCE),
        eps,
    )


class DSparkDrafter(ABC):
    """What V4's and V4.1's drafters share (V4.1's: `speculative.dspark_v41`): the settings, the heads, the
    confidence cut, and drafting a block's tokens from its rows. `_block` is the family's pass."""

    d: DSparkArgs
    heads: DSparkHeads
    confidence: float  # a block is cut at its first row whose confidence is below this

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.d.target_layers

    @abstractmethod
    def new_state(self) -> Any:
        """An empty context (its `pos`: the context positions written)."""

    @abstractmethod
    def _torch(self, a: Any) -> torch.Tensor:
        """A backend array as a host torch tensor."""

    @abstractmethod
    def context(self, main_x: torch.Tensor, state: Any) -> None:
        """main_x rows [N, dim] (torch float32) into the stages' context at positions state.pos.."""

    @abstractmethod
    def _block(self, anchor: int, state: Any) -> tuple[Any, Any]:
        """The block after `anchor`: its collapsed rows before the output norm and its logits before the
        Markov bias, in the backend's arrays or torch; the state is left as it was."""

    def feed(self, captured: list[Any], state: Any) -> None:
        """Context rows of the positions after state.pos from the target layers' streams [N, n, dim]."""
        self.context(self.heads.main_x([self._torch(h) for h in captured]), state)

    def propose(
        self, anchor: int, state: Any, n: int, sampler: Sampler, threshold: float = 0.0
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Up to n drafts after `anchor` (the token at the context's end), with their draft logits: the
        block's rows in order, each row's Markov bias from the token before, cut at the first row whose
        confidence is below `threshold` (0: none). The state is left as it was."""
        collapsed, logits = self._block(anchor, state)
        collapsed, logits = self._torch(collapsed).float(), self._torch(logits).float()
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        previous = anchor
        for i in range(min(n, self.d.block_size)):
            e, bias = self.heads.markov(previous)
            if threshold:
                confidence = self.heads.confidence_of(collapsed[i], e)
                if not math.isfinite(confidence):
                    raise DSparkConfidenceError(f"the DSpark confidence head gave {confidence} at block row {i}")
                if confidence < threshold:
                    break
            row = logits[i] + bias
            if sampler.params.greedy:
                token = int(row.argmax())
            else:
                token = draw(rule_probabilities(row, sampler.params), next_uniform(sampler))
            drafts.append(token)
            rows.append(row)
            previous = token
        return drafts, rows

    @abstractmethod
    def close(self) -> None: ...


class DSparkDraft(DSparkDrafter):
    """The V4 drafter on the target's backend: the stages' model, their forward, the heads."""

    def __init__(self, target: Transformer, model: ModelFile, path: str | os.PathLike, confidence: float = 0.0) -> None:
        check_confidence(confidence)
        self.confidence = confidence
        self.d, self.gguf, stages = open_dspark(model, path)
        try:
            entry = entry_of(target)
            if entry is None:
                raise DwarfStarError(f"DSpark drafting needs a backend of the shared forward pass, not {target!r}")
            self.stages = entry.draft_model(target, stages)
            if not all(callable(getattr(self.stages.ops, name, None)) for name in DSPARK_OPS):
                raise DwarfStarError(
                    f"DSpark drafting runs on the reference, MLX and Triton backends; the {entry.name} backend "
                    "has no block attention for its stages yet"
                )
            self.forward = DSparkForward(self.stages, self.d)
            self.heads = load_heads(self.gguf, self.d, model.args.norm_eps)
        except BaseException:
            self.gguf.close()
            raise

    def new_state(self) -> SequenceState:
        return self.forward.new_state()

    def _torch(self, a: Any) -> torch.Tensor:
        return a if isinstance(a, torch.Tensor) else torch.from_numpy(self.stages.cache.storage.to_numpy(a))

    def context(self, main_x: torch.Tensor, state: SequenceState) -> None:
        self.forward.context(self.stages.cache.storage.from_numpy(main_x.cpu().numpy()), state)

    def _block(self, anchor: int, state: SequenceState) -> tuple[Any, Any]:
        return self.forward.block(anchor, state)

    def close(self) -> None:
        self.gguf.close()


class DSparkTrack(HeldRows):
    """The drafter's side of one speculating sequence, as `track.DraftTrack` is the MTP block's: its
    state following the target, and the main_x rows of target positions not yet written into it
    (every held row is committed: the speculator holds only accepted rows)."""

    def __init__(self, draft: DSparkDrafter, base: int, confidence: float) -> None:
        super().__init__(draft.new_state(), base)
        self.draft, self.confidence = draft, confidence
        self.layers = draft.target_layers  # the target layers whose streams a pass captures for it

    @property
    def ready(self) -> bool:
        return self.state.pos > 0  # a block drafts after the context the rings hold

    def rows(self, streams: Any, captured: dict[int, Any], rows: slice) -> torch.Tensor:
        """What a pass leaves for the drafter: main_x of the rows `rows` of the captured layers."""
        return self.draft.heads.main_x([self.draft._torch(captured[il][rows]) for il in self.layers])

    def hold(self, rows: torch.Tensor) -> None:
        self.hidden = rows if self.hidden is None else torch.cat((self.hidden, rows))

    def feed(self, known: list[int], target_pos: int) -> None:
        """Every held row into the stages' rings (their positions are committed)."""
        if self.hidden is not None:
            self._write(self.held)

    def feed_rows(self, tokens: list[int]) -> None:
        """The first len(tokens) held rows into the stages' rings (`tokens`: their positions' tokens,
        which the drafter does not read: a route's last stage is told the rows by them, as for MTP)."""
        self._write(len(tokens))

    def _write(self, count: int) -> None:
        self.draft.context(self.hidden[:count], self.state)
        self.hidden = self.hidden[count:] if count < self.held else None

    def propose(
        self, sequence: list[int], n: int, sampler: Sampler, margin: float
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Up to n drafts after the sequence's last token (the pending one, at the context's end); the
        confidence threshold is the drafter's own (`margin` is the MTP block's gate)."""
        return self.draft.propose(sequence[-1], self.state, n, sampler, self.confidence)
