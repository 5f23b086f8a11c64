"""The MTP draft: DeepSeek V4's next-token-prediction block, found in either file layout and run as
a one-layer V4 model on the target's own backend (spec §2.6, §4.4, §8 item 9).

The block is one more V4 block (window-only attention, learned routing) with its own HC head and
output norm, sharing the trunk's embedding and output matrix. It is loaded by giving the backend's
ordinary loader a `DraftFile`: a view that names the block's tensors as a one-layer model's
(`blk.0.*`, `output_hc_*`, `output_norm`) and takes `token_embd` and `output` from the model file.
So every backend that loads a model file loads the draft, and the draft's own KV (its raw window
ring) lives in the draft model's cache like any layer's.

What the one-layer model does not have is the MTP input (`MTPInput`): the embedding of a token and
the hidden streams of the position before it, each RMS-normed, projected and summed, replacing the
embedding as the first layer's input (`Transformer.forward_streams(inputs=...)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.backends.registry import entry_of
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.reader import GGUFFile, TensorInfo
from dwarfstar.gguf.split import PartName, find_parts
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import ARCH
from dwarfstar.model.forward import Transformer
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import SequenceState


class DraftFile:
    """A GGUF-like view over the files holding a draft model's tensors, under the draft's own names.

    It answers what the backends' loaders ask of a `GGUFFile`: `tensors`, `tensor`, `raw`, `release`."""

    def __init__(self, sources: dict[str, tuple[GGUFFile, str]], metadata: dict[str, Any]) -> None:
        self.sources = sources
        self.metadata = metadata
        self.tensors: dict[str, TensorInfo] = {own: gguf.tensors[name] for own, (gguf, name) in sources.items()}

    def _source(self, name: str) -> tuple[GGUFFile, str]:
        if name not in self.sources:
            raise ModelFileError(f"the MTP draft has no tensor named {name!r}")
        return self.sources[name]

    def tensor(self, name: str) -> torch.Tensor:
        gguf, file_name = self._source(name)
        return gguf.tensor(file_name)

    def raw(self, name: str) -> np.ndarray:
        gguf, file_name = self._source(name)
        return gguf.raw(file_name)

    def release(self, name: str) -> None:
        gguf, file_name = self._source(name)
        gguf.release(file_name)

    def close(self) -> None:
        """The files belong to their opener (the model file, the MTP file); nothing of its own to close."""


@dataclass
class MTPFile:
    """Where a model's MTP block is: the file holding it, its layout, and the draft model's view."""

    layout: str  # "ds4" (a separate file) or "nextn" (in the model file)
    gguf: GGUFFile
    draft: ModelFile  # the block as a one-layer model, for a backend's loader

    def close(self) -> None:
        if self.layout == "ds4":
            self.gguf.close()


def open_mtp(model: ModelFile, mtp_path: str | os.PathLike | None = None) -> MTPFile:
    """The model's MTP block: from ds4's separate file when `mtp_path` is given, else from the model
    file's own `blk.{n}.nextn.*` tensors; a clear error when it is missing or belongs to another model."""
    if mtp_path is None:
        if tt.layer_tensor(model.args.n_layers, tt.MTP_NEXTN_PROJ) not in model.gguf.tensors:
            raise ModelFileError(
                f"{model.path} has no MTP block (no blk.{model.args.n_layers}.nextn.* tensors); "
                "pass --mtp FILE with ds4's separate MTP GGUF (dwarfstar pull mtp)"
            )
        return MTPFile("nextn", model.gguf, _draft_view(model, model.gguf, "nextn", model.path))
    path = Path(mtp_path)
    if not path.is_file():
        raise ModelFileError(f"MTP file not found: {path}")
    gguf = GGUFFile(path)
    try:
        if not any(name.startswith(tt.MTP_PREFIX) for name in gguf.tensors):
            raise ModelFileError(f"{path} is not an MTP file: it has no {tt.MTP_PREFIX}* tensors")
        dim = gguf.metadata.get(f"{ARCH}.embedding_length")
        if dim is not None and dim != model.args.dim:
            raise ModelFileError(
                f"{path} is the MTP block of another model: embedding_length {dim}, {model.path} has {model.args.dim}"
            )
        return MTPFile("ds4", gguf, _draft_view(model, gguf, "ds4", path))
    except BaseException:
        gguf.close()
        raise


def _draft_view(model: ModelFile, gguf: GGUFFile, layout: str, path: Path) -> ModelFile:
    for spec in tt.mtp_tensors(model.args, layout):
        try:
            tt.check_tensor(spec, gguf.tensors.get(spec.name))
        except ModelFileError as exc:
            raise ModelFileError(f"{path}: the MTP block does not fit {model.path}: {exc}") from exc
    sources = {own: (gguf, name) for own, name in tt.mtp_block_names(model.args, layout).items()}
    for shared in (tt.EMBED, tt.OUTPUT):
        sources[shared] = (model.gguf if shared in model.gguf.tensors else _set_part_holding(model, shared), shared)
    return ModelFile(path, DraftFile(sources, dict(gguf.metadata)), tt.mtp_block_args(model.args))  # type: ignore[arg-type]


def _set_part_holding(model: ModelFile, name: str) -> GGUFFile:
    """The part of `model`'s split set holding a tensor the stage did not map: a route's last stage
    maps only the output part, but its draft shares the embedding, which is in the first. Mapping that
    part pages in only the embedding rows the draft looks up; it stays mapped as long as the draft."""
    named = PartName.of(model.path)
    for part in find_parts(named) if named is not None else []:
        if part.path not in model.parts:
            held = GGUFFile(part.path)
            if name in held.tensors:
                return held
            held.close()
    raise ModelFileError(
        f"the MTP draft shares the model's {name}, which neither {model.path} nor another part of its set holds"
    )


class MTPInput:
    """hin[s] = e_proj @ RMSNorm(embedding; enorm) + h_proj @ RMSNorm(hidden[s]; hnorm), per stream s.

    Computed in torch float32 (on the hidden's device for a torch backend, through the host for
    another), then handed back as the backend's array: it is two [D, D] products per draft row."""

    def __init__(
        self, norms: tuple[torch.Tensor, torch.Tensor], proj: tuple[torch.Tensor, torch.Tensor], eps: float, storage
    ) -> None:
        (self.enorm, self.hnorm), (self.e_proj, self.h_proj) = norms, proj
        self.eps, self.storage = eps, storage

    @classmethod
    def from_file(cls, mtp: MTPFile, args, storage) -> MTPInput:
        prefix = tt.mtp_prefix(args, mtp.layout)
        norms = prefix + ("nextn." if mtp.layout == "nextn" else "")
        enorm, hnorm = (mtp.gguf.tensor(norms + name) for name in tt.MTP_INPUT_NORMS)
        if mtp.layout == "ds4":
            proj = tuple(mtp.gguf.tensor(prefix + name) for name in tt.MTP_DS4_PROJ)
        else:  # one projection of the concatenated [embedding, hidden]
            proj = tuple(mtp.gguf.tensor(prefix + tt.MTP_NEXTN_PROJ).split(args.dim, dim=1))
        return cls((enorm, hnorm), proj, args.norm_eps, storage)

    def _torch(self, a: Any) -> torch.Tensor:
        return a.float() if isinstance(a, torch.Tensor) else torch.from_numpy(self.storage.to_numpy(a))

    def __call__(self, embedded: Any, hidden: Any) -> Any:
        """embedded [N, n, D] (the embedding copied into the streams), hidden [N, n, D] -> [N, n, D]."""
        e, h = self._torch(embedded)[:, :1], self._torch(hidden)
        weights = [w.to(h.device) for w in (self.enorm, self.hnorm, self.e_proj, self.h_proj)]
        enorm, hnorm, e_proj, h_proj = weights
        out = _rms_norm(e, enorm, self.eps) @ e_proj.T + _rms_norm(h, hnorm, self.eps) @ h_proj.T
        if isinstance(hidden, torch.Tensor):
            return out.to(hidden.dtype)
        return self.storage.from_numpy(out.numpy())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


class MTPDraft:
    """The draft model and its input: rows pairing a hidden state with a token, each predicting the
    token two positions after its hidden state's."""

    def __init__(self, model: Transformer, mix: MTPInput, mtp: MTPFile) -> None:
        self.model, self.mix = model, mix
        self.mtp = mtp  # keeps the block's file open while the draft reads its experts

    def new_state(self) -> SequenceState:
        return self.model.new_state()

    def rows(self, hidden: Any, tokens: list[int], state: SequenceState) -> tuple[torch.Tensor, Any]:
        """Feed rows at positions state.pos..: the last row's logits [vocab] and output streams [1, n, D].
        An image position's token (an id past the vocabulary) is fed as token 0: the draft has no
        image rows, and a draft is only ever checked after text."""
        vocab = self.model.args.vocab_size
        tokens = [t if t < vocab else 0 for t in tokens]
        logits, streams = self.model.forward_streams(
            tokens, state, inputs=lambda embedded: self.mix(embedded, hidden), all_logits=False
        )
        return logits[-1], streams[-1:]


def forward_of(backend: Any) -> Transformer:
    """The shared forward pass a backend runs: the backend itself (every backend is one), or the one
    a steering wrapper hooks (`SteeredBackend.model`)."""
    for candidate in (backend, getattr(backend, "model", None)):
        if isinstance(candidate, Transformer):
            return candidate
    raise DwarfStarError(f"speculative decoding needs a backend built on the shared forward pass, not {backend!r}")


def load_draft(backend: Any, model: ModelFile, mtp_path: str | os.PathLike | None = None) -> MTPDraft:
    """The MTP draft of `model` on the backend `backend` runs on (reference, MLX or Triton); on a
    route, the route's own (its last stage holds the block, loaded from that worker's --mtp)."""
    remote = getattr(backend, "mtp_draft", None)
    if remote is not None:
        return remote()
    target = forward_of(backend)
    mtp = open_mtp(model, mtp_path)
    return MTPDraft(_draft_model(target, mtp), MTPInput.from_file(mtp, model.args, target.cache.storage), mtp)


def _draft_model(target: Transformer, mtp: MTPFile) -> Transformer:
    """The block as a one-layer model of the target's backend, with the target's settings."""
    entry = entry_of(target)
    if entry is None:
        raise DwarfStarError(
            f"MTP speculation runs on the reference, MLX and Triton backends; not on {type(target).__name__}"
        )
    return entry.draft_model(target, mtp.draft)
