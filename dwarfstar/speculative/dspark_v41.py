"""DSpark speculation for DeepSeek V4.1 targets (`run --dspark FILE` with a V4.1 model): the drafter of
model/dspark_v41.py loaded from its support file onto the target's backend, and how the speculator runs a
V4.1 target (`LocalRunner41`).

The support file's stages are read through a renaming view (`mtp.DraftFile`) as the layers after the
target's (`dspark_v41.stage_args41`), by the backend's own steps (`Model41.dspark_ops`); the heads are V4's,
in torch float32. The target's passes record the target layers' inputs (`forward_v41.Capture41`), which
become main_x rows for the drafter once their positions are committed (`dspark.DSparkTrack`, as V4's).

Verification is the ordinary one (`verify.py`); its pass computes every verified position's logits as
the model computes `all_logits`, one token a call. A rejection truncates the state to the kept tokens
(`rollback_v41.py`: no second pass; the state is the one plain decoding builds, bit for bit) while the
pass fits the window; otherwise, or with `rollback="rerun"`, it goes back to the snapshot taken before
the pass (a V4.1 state's snapshot is a whole copy) and runs the kept tokens again (the V4.1 forward is
exact under any split of a sequence into calls). Either way greedy output is plain greedy's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model.dspark import ARCH41, check_support_arch
from dwarfstar.model.dspark_v41 import (
    SHARED,
    DSparkArgs41,
    DSparkForward41,
    DSparkState41,
    dspark_tensors41,
    stage_args41,
    stage_names41,
)
from dwarfstar.model.file_v41 import FAMILY41, ModelFile41
from dwarfstar.model.forward_v41 import Capture41
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.model_v41 import Model41
from dwarfstar.speculative.dspark import DSparkDrafter, DSparkTrack, load_heads
from dwarfstar.speculative.mtp import DraftFile
from dwarfstar.speculative.mtp_options import check_confidence
from dwarfstar.speculative.rollback_v41 import can_truncate41, frontiers, truncate41


def open_dspark41(model: ModelFile41, path: str | os.PathLike) -> tuple[DSparkArgs41, GGUFFile, DraftFile]:
    """A V4.1 support file for `model`: its settings, the file, and the stages' tensors under the stage
    layers' names (with the target's shared ones). A clear error when it is missing, is not one, or was
    made for another model."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"DSpark support file not found: {path}")
    gguf = GGUFFile(path)
    try:
        check_support_arch(gguf.metadata, ARCH41, str(path), str(model.path))
        d = DSparkArgs41.from_metadata(gguf.metadata, model.args, str(path))
        for spec in dspark_tensors41(model.args, d):
            try:
                tt.check_tensor(spec, gguf.tensors.get(spec.name))
            except ModelFileError as exc:
                raise ModelFileError(f"{path}: the DSpark drafter does not fit {model.path}: {exc}") from exc
        sources = {own: (gguf, name) for own, name in stage_names41(model.args, d).items()}
        sources.update({name: (model.gguf, name) for name in SHARED})
        return d, gguf, DraftFile(sources, dict(gguf.metadata))
    except BaseException:
        gguf.close()
        raise


class DSparkDraft41(DSparkDrafter):
    """The V4.1 drafter on the target's backend: its stages' steps, their forward, the heads."""

    def __init__(self, target: Model41, model: ModelFile41, path: str | os.PathLike, confidence: float = 0.0) -> None:
        check_confidence(confidence)
        if not isinstance(target, Model41):
            raise DwarfStarError(f"a V4.1 DSpark drafter runs beside a V4.1 model, not {target!r}")
        self.confidence = confidence
        d41, self.gguf, view = open_dspark41(model, path)
        try:
            self.d = d41.d
            ops = target.dspark_ops(stage_args41(model.args, d41), view)  # type: ignore[arg-type]
            self.forward = DSparkForward41(ops, model.args, d41)
            self.heads = load_heads(self.gguf, self.d, model.args.norm_eps)
            self.arrays = target.new_state()  # host values to and from the backend's arrays
        except BaseException:
            self.gguf.close()
            raise

    def new_state(self) -> DSparkState41:
        return self.forward.new_state()

    def _torch(self, a: Any) -> torch.Tensor:
        return a if isinstance(a, torch.Tensor) and a.device.type == "cpu" else torch.from_numpy(self.arrays.host(a))

    def context(self, main_x: torch.Tensor, state: DSparkState41) -> None:
        self.forward.context(self.arrays.array(main_x.cpu().numpy()), state)

    def _block(self, anchor: int, state: DSparkState41) -> tuple[Any, Any]:
        return self.forward.block(anchor, state)

    def close(self) -> None:
        self.gguf.close()


class LocalRunner41:
    """How a speculator runs a V4.1 target in its own process (`decode.LocalRunner`'s calls): passes that
    record the drafter's target layers, whole-copy snapshots, and rollback by truncation
    (`rollback_v41`) or by restore and rerun."""

    def __init__(self, model: Model41) -> None:
        self.target = model

    def track(self, draft: Any, state: Any, shift: int) -> DSparkTrack:
        if not isinstance(draft, DSparkDraft41):
            raise DwarfStarError(f"{FAMILY41} speculates with its DSpark drafter (--dspark FILE), not {draft!r}")
        return DSparkTrack(draft, state.pos, draft.confidence)

    def run(
        self, tokens: Sequence[int], state: Any, all_logits: bool, track: DSparkTrack, images: Sequence[ImageSpan] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of a pass (with its image blocks) and what it leaves for the drafter: main_x rows."""
        capture: Capture41 = Capture41(track.layers)
        logits = self.target.forward(tokens, state, all_logits, list(images) or None, capture)
        return logits, _main_rows(state, track, capture, len(tokens))

    def snapshot(self, state: Any) -> Any:
        return state.snapshot()

    def verify(
        self, token_lists: Sequence[Sequence[int]], states: Sequence[Any], tracks: Sequence[DSparkTrack]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, slice]], list[dict[int, tuple[Any, Any]]]]:
        """Each sequence's verified tokens one a call, as the model's `all_logits` runs them (sequences one by
        one): every position's logits, and the compressor frontiers after each call (`rollback_v41`'s
        truncation reads them: a sequence's are at its slice of the list)."""
        out: list[tuple[torch.Tensor, torch.Tensor, slice]] = []
        after: list[dict[int, tuple[Any, Any]]] = []
        ops = self.target.transformer.ops
        for tokens, state, track in zip(token_lists, states, tracks, strict=True):
            capture: Capture41 = Capture41(track.layers)
            mine, logits = slice(len(after), len(after) + len(tokens)), []
            for token in tokens:
                logits.append(self.target.forward([token], state, False, None, capture)[0])
                after.append(frontiers(ops, state))
            out.append((torch.stack(logits), _main_rows(state, track, capture, len(tokens)), mine))
        return out, after

    def can_truncate(self, verified: int, after: list[dict[int, tuple[Any, Any]]]) -> bool:
        return can_truncate41(self.target.args.window, verified)

    def truncate(
        self,
        state: Any,
        snap: Any,
        after: list[dict[int, tuple[Any, Any]]],
        rows: slice,
        kept: list[int],
        logits: torch.Tensor,
    ) -> None:
        truncate41(self.target.transformer.ops, state, snap, after[rows], len(kept), logits)

    def restore(self, state: Any, snap: Any) -> None:
        state.restore(snap)


def _main_rows(state: Any, track: DSparkTrack, capture: Capture41, n: int) -> torch.Tensor:
    """The drafter's main_x rows of a pass's `n` tokens from the target layers' inputs it captured."""
    captured = {
        il: torch.cat([torch.from_numpy(state.host(call[i])) for call in capture.calls])
        for i, il in enumerate(track.layers)
    }
    return track.rows(None, captured, slice(0, n))
