"""Open a DeepSeek V4 GGUF: parse it, derive the config from its metadata, validate every tensor."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import ConfigError, ModelFileError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ARCH, ModelArgs
from dwarfstar.model.tensors import MTP_NEXTN_PROJ, layer_tensor, validate_tensors


@dataclass
class ModelFile:
    """A validated model file; its tensors stay memory-mapped until a backend reads them."""

    path: Path
    gguf: GGUFFile
    args: ModelArgs

    def close(self) -> None:
        self.gguf.close()


def open_model(path: str | os.PathLike) -> ModelFile:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    gguf = GGUFFile(path)
    try:
        meta = dict(gguf.metadata)
        embd = gguf.tensors.get("token_embd.weight")
        if f"{ARCH}.vocab_size" not in meta and embd is not None:
            meta[f"{ARCH}.vocab_size"] = embd.shape[0]  # ds4 files may omit it; the embedding knows
        try:
            args = ModelArgs.from_gguf_metadata(meta)
        except ConfigError as exc:
            raise ModelFileError(f"{path}: {exc}") from exc
        args = trunk_args(args, gguf)
        try:
            validate_tensors(args, gguf.tensors)
        except ModelFileError as exc:
            raise ModelFileError(f"{path}: {exc}") from exc
    except BaseException:
        gguf.close()
        raise
    return ModelFile(path, gguf, args)


def trunk_args(args: ModelArgs, gguf: GGUFFile) -> ModelArgs:
    """The trunk's config: llama.cpp counts an in-file MTP block (`blk.{n}.nextn.*`) in block_count,
    ds4 does not (its MTP block is a separate file), so the count is corrected when the block is there."""
    first_mtp = args.n_layers - args.n_mtp_layers
    if args.n_mtp_layers and layer_tensor(first_mtp, MTP_NEXTN_PROJ) in gguf.tensors:
        return args.with_(n_layers=first_mtp)
    return args
