"""Open a DeepSeek V4 GGUF: parse it, derive the config from its metadata, validate every tensor.

A model is one file or a split set (`dwarfstar.gguf.split`: ds4's `…-Layers00-30.gguf` and
`…-Layers-31-output.gguf`), opened from any of its parts. A pipeline stage asks for its layers only,
`open_model(path, layers=(first, end))`, and maps only the parts that hold them; one machine opens
every part. `write_split` writes any model as such a set.

A DeepSeek V4.1 file or split set (`deepseek41`) is validated as one (`file_v41`) and then refused: only
the engine runs it (`engine.load.load_engine` opens it with `file_v41.open_model41` when `is_v41`), and
`dwarfstar inspect` describes it; every other V4 command refuses it here. `write_split` writes either
family as a set.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from dwarfstar.errors import ConfigError, ModelFileError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.split import (
    GGUFSet,
    PartName,
    check_not_llama_split,
    layer_of,
    layer_span,
    open_parts,
    part_file_name,
    write_parts,
)
from dwarfstar.model.config import ARCH, ModelArgs
from dwarfstar.model.config_v41 import ARCH41
from dwarfstar.model.file_v41 import FAMILY41, NOT_YET, ModelFile41, family_problem, open_model41
from dwarfstar.model.tensors import EMBED, MTP_NEXTN_PROJ, OUTPUT, layer_tensor, validate_tensors
from dwarfstar.model.tensors_v41 import engram_table


@dataclass
class ModelFile:
    """A validated model; its tensors stay memory-mapped until a backend reads them."""

    path: Path  # the file it was opened from (for a split set, the part named)
    gguf: GGUFFile | GGUFSet
    args: ModelArgs  # the whole model's config, also when only some layers are mapped
    layers: range | None = None  # the layers a pipeline stage mapped; None: every layer
    parts: tuple[Path, ...] = ()  # the files mapped, in layer order

    @property
    def layer_range(self) -> range:
        return range(self.args.n_layers) if self.layers is None else self.layers

    @property
    def has_embedding(self) -> bool:
        return self.layer_range.start == 0

    @property
    def has_head(self) -> bool:
        return self.layer_range.stop == self.args.n_layers

    def holds(self, tensor_name: str) -> bool:
        """Whether a backend loading this model reads the tensor: every one when all layers are
        mapped, else those of its layers, the embedding on the first stage and the head on the last."""
        if self.layers is None:
            return True
        il = layer_of(tensor_name)
        if il is None:
            return self.has_embedding if tensor_name == EMBED else self.has_head
        return il in self.layers

    def close(self) -> None:
        self.gguf.close()


def open_model(path: str | os.PathLike, layers: tuple[int, int] | None = None) -> ModelFile:
    """Open a model file or split set. `layers=(first, end)` (end exclusive, as in `run_layers`) maps and
    validates only those layers, with the embedding when `first` is 0 and the head when `end` is the
    last layer; from a split set it maps only the parts holding them."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; give the GGUF model file in it")
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    part = PartName.of(path)
    if part is None:
        gguf = GGUFFile(path)
        try:
            check_not_llama_split(gguf)
            if gguf.metadata.get("general.architecture") == ARCH41:
                gguf.close()
                _refuse_v41(path)
            args = _trunk_config(gguf, path)
            span = layer_span(args.n_layers, layers, path)
            _validate(args, gguf.tensors, span, path)
        except BaseException:
            gguf.close()
            raise
        return ModelFile(path, gguf, args, None if layers is None else span, (path,))
    return _open_parts(path, part, layers)


def is_v41(path: str | os.PathLike) -> bool:
    """Whether `path` is a DeepSeek V4.1 file, or a part of a V4.1 split set (`general.architecture` says
    so; `file_v41.open_model41` opens either)."""
    path = Path(path)
    if not path.is_file():
        return False
    gguf = GGUFFile(path)
    try:
        return gguf.metadata.get("general.architecture") == ARCH41
    finally:
        gguf.close()


def _open_parts(path: Path, named: PartName, layers: tuple[int, int] | None) -> ModelFile:
    head = GGUFFile(named.path)  # its header gives the config the set is checked against
    try:
        if head.metadata.get("general.architecture") == ARCH41:
            head.close()
            _refuse_v41(path)
        file_args = _config(head, named.path)
        n_file = file_args.n_layers  # counts an in-file MTP block, which is in the output part
        first, end = (0, n_file) if layers is None else layers
        layer_span(n_file, (first, end), named.path)
    except BaseException:
        head.close()
        raise
    gguf_set = open_parts(named, head, n_file, first, end)
    try:
        args = trunk_args(file_args, gguf_set)
        # past the trunk is an error: an in-file MTP block is no layer
        span = layer_span(args.n_layers, layers, named.path)
        _validate(args, gguf_set.tensors, span, named.path)
    except BaseException:
        gguf_set.close()
        raise
    parts = tuple(part.path for part in gguf_set.parts)
    return ModelFile(path, gguf_set, args, None if layers is None else span, parts)


def _refuse_v41(path: Path) -> NoReturn:
    """A V4.1 file or set is validated as such (its own errors first), then refused: nothing runs it yet."""
    model = open_model41(path)
    model.close()
    raise ModelFileError(f"{path}: {FAMILY41} loads ({model.summary()}) {NOT_YET}")


def _config(gguf: GGUFFile, path: Path) -> ModelArgs:
    meta = dict(gguf.metadata)
    if problem := family_problem(meta):
        raise ModelFileError(f"{path}: {problem}")
    # ds4 files may omit it; the embedding knows, or in a split set's later parts the output matrix
    vocab = gguf.tensors.get(EMBED) or gguf.tensors.get(OUTPUT)
    if f"{ARCH}.vocab_size" not in meta and vocab is not None:
        meta[f"{ARCH}.vocab_size"] = vocab.shape[0]
    try:
        return ModelArgs.from_gguf_metadata(meta)
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc


def _trunk_config(gguf: GGUFFile, path: Path) -> ModelArgs:
    return trunk_args(_config(gguf, path), gguf)


def trunk_args(args: ModelArgs, gguf: GGUFFile | GGUFSet) -> ModelArgs:
    """The trunk's config: llama.cpp counts an in-file MTP block (`blk.{n}.nextn.*`) in block_count,
    ds4 does not (its MTP block is a separate file), so the count is corrected when the block is there."""
    first_mtp = args.n_layers - args.n_mtp_layers
    if args.n_mtp_layers and layer_tensor(first_mtp, MTP_NEXTN_PROJ) in gguf.tensors:
        return args.with_(n_layers=first_mtp)
    return args


def _validate(args: ModelArgs, tensors, span: range, path: Path) -> None:
    try:
        validate_tensors(args, tensors, span)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc


def write_split(src: str | os.PathLike, split_at: Sequence[int], stem: str | os.PathLike) -> list[Path]:
    """Write the model `src` (DeepSeek V4 or V4.1, a file or a set) as a split set `<stem>-Layers00-…gguf`,
    …, `<stem>-Layers-…-output.gguf`, a new part starting at each layer of `split_at`; tensor bytes are
    copied unchanged. A V4.1 Engram table goes to the part holding its layer, after that part's other
    tensors (as ds4 stores them, and `file_v41` requires). Returns the parts."""
    model: ModelFile | ModelFile41 = open_model41(src) if is_v41(src) else open_model(src)
    try:
        n = model.args.n_layers
        starts = sorted(set(split_at))
        if not starts or starts[0] <= 0 or starts[-1] >= n:
            raise ModelFileError(f"split points {list(split_at)} must be layers between 1 and {n - 1}")
        bounds = [0, *starts, n]
        stem = Path(stem)
        paths = [
            stem.with_name(part_file_name(stem.name, a, None if b == n else b - 1))
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]

        def part_of(name: str) -> int:
            layer = layer_of(name)
            if layer is None:  # the embedding goes with layer 0, the output head with the last layer
                return 0 if name == EMBED else len(starts)
            return bisect.bisect_right(starts, layer)  # an in-file MTP block (index n) goes with the head

        last = {engram_table(il) for il in model.args.engram_layers} if isinstance(model, ModelFile41) else set()
        write_parts(model.gguf, paths, part_of, last)
    finally:
        model.close()
    return paths
