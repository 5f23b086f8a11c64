"""Triton's MTP draft model (`speculative.mtp`): the block's tensors uploaded, the embedding and
output matrix the target's own (a second copy of each would be the largest part of the block by far)."""

from __future__ import annotations

import torch

from dwarfstar.backends.triton.model import TritonModel
from dwarfstar.backends.triton.weights import QWeight, build_weights
from dwarfstar.model import tensors as tt
from dwarfstar.model.loader import ModelFile


def draft_model(target: TritonModel, draft: ModelFile) -> TritonModel:
    """The one-layer model of `draft` (the MTP block's `DraftFile` view) on `target`'s device and settings."""
    view, device = draft.gguf, target.device
    shared = {tt.EMBED: target.w.embed, tt.OUTPUT: target.w.output}

    def matrix(name: str) -> QWeight:
        if name in shared:
            return shared[name]
        info = view.tensors[name]
        return QWeight.from_bytes(view.raw(name), info.ggml_type, info.shape, device)

    def vector(name: str) -> torch.Tensor:
        return view.tensor(name).to(device)

    weights = build_weights(draft.args, matrix, vector)
    return TritonModel(weights, qat=target.qat, precision=target.precision, max_seq_len=target.max_seq_len, kv_slots=1)
