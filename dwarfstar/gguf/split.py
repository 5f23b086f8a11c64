"""Split GGUF sets: one logical model in several files, each holding a contiguous range of layers.

ds4 publishes DeepSeek V4 PRO Q4 (about 840 GB) as two files, `DeepSeek-V4-Pro-Q4K-Layers00-30.gguf`
and `DeepSeek-V4-Pro-Q4K-Layers-31-output.gguf`, so that each machine of a two-stage pipeline
downloads and maps only its half (ds4 then picks the slice with `--layers 0:30` / `--layers 31:output`).
Each part is an ordinary GGUF: the model's metadata and the tensors of its layers, the first part also
the embedding and the last also the output head.

The set is found by name, as ds4 names it: a part is `<stem>-Layers<first>-<last>.gguf` for the first
and `<stem>-Layers-<first>-<last>.gguf` or `<stem>-Layers-<first>-output.gguf` for the others (ranges
inclusive, like `--layers`), and its siblings are the files of the same directory and stem. Names are
only the index: what each part really holds (its `blk.N.` layers, its architecture keys) is checked
when it is opened, so a renamed or foreign file is named in the error instead of mixing two models.

DeepSeek V4.1 sets (`deepseek41`) are named and checked the same way (`file_v41.open_model41` opens
them, through `open_parts` as V4's loader does); each Engram table lies in the part holding its layer,
after that part's other tensors (`write_parts`' `last`).

llama.cpp's gguf-split sets (`split.no` / `split.count` keys, `-00001-of-00003.gguf` names) are another
scheme; a file carrying them under any other name is refused with a clear error (`check_not_llama_split`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.gguf.reader import GGUFFile, TensorInfo
from dwarfstar.gguf.writer import GGUFWriter

_PART_NAME = re.compile(r"(?P<stem>.+)-Layers-?(?P<first>\d+)-(?P<last>\d+|output)\.gguf")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")
_MAX_LINK_HOPS = 40  # Linux's SYMLOOP_MAX: a longer chain is a loop
LLAMA_SPLIT_COUNT = "split.count"  # llama.cpp gguf-split: how many files the set has (u16)
LLAMA_SPLIT_NO = "split.no"  # this file's index in it, from 0 (u16)


@dataclass(frozen=True)
class PartName:
    """What a part's file name says it holds."""

    path: Path
    stem: str
    first: int
    last: int | None  # inclusive; None: through the last layer, with the output head

    @classmethod
    def parse(cls, path: Path) -> PartName | None:
        match = _PART_NAME.fullmatch(path.name)
        if match is None:
            return None
        last = None if match["last"] == "output" else int(match["last"])
        return cls(path, match["stem"], int(match["first"]), last)

    @classmethod
    def of(cls, path: Path) -> PartName | None:
        """The part `path` names, following links whose own name is not a part's (`./ds4flash.gguf` or
        `-m model.gguf` pointing at one); the set is then looked for next to the part, not the link."""
        for _ in range(_MAX_LINK_HOPS):
            part = cls.parse(path)
            if part is not None or not path.is_symlink():
                return part
            path = path.parent / os.readlink(path)
        return None

    def end(self, n_layers: int) -> int:
        """One past its last layer."""
        return n_layers if self.last is None else self.last + 1

    @property
    def has_head(self) -> bool:
        return self.last is None

    def describe(self) -> str:
        return f"layers {self.first}-{'output' if self.last is None else self.last}"


def part_file_name(stem: str, first: int, last: int | None) -> str:
    """ds4's spelling: `Layers00-30` for the first part, `Layers-31-output` for the ones after it."""
    span = f"{first:02d}-{'output' if last is None else f'{last:02d}'}"
    return f"{stem}-Layers{'' if first == 0 else '-'}{span}.gguf"


def find_parts(part: PartName) -> list[PartName]:
    """The parts of `part`'s set present next to it, in layer order."""
    found = []
    for path in part.path.parent.iterdir():
        name = PartName.parse(path)
        if name is not None and name.stem == part.stem and path.is_file():
            found.append(name)
    return sorted(found, key=lambda p: p.first)


def select_parts(parts: Sequence[PartName], n_layers: int, first: int, end: int) -> list[PartName]:
    """The parts that hold layers [first, end), and the output head when `end` is the last layer;
    a ModelFileError names the part that is missing, overlaps another, or runs past the model."""
    ordered = sorted(parts, key=lambda p: p.first)
    stem, where = ordered[0].stem, ordered[0].path.parent
    for part in ordered:
        if part.end(n_layers) > n_layers or part.first >= n_layers:
            raise ModelFileError(f"{part.path}: its name says {part.describe()}, but the model has {n_layers} layers")
    for before, after in zip(ordered, ordered[1:], strict=False):
        if before.end(n_layers) > after.first:
            raise ModelFileError(
                f"{before.path.name} ({before.describe()}) and {after.path.name} ({after.describe()}) "
                f"both claim layer {after.first}: remove the one that is not part of this set from {where}"
            )
    needed = [p for p in ordered if p.first < end and p.end(n_layers) > first]
    at = first
    for part in [*needed, None]:
        next_first = end if part is None else part.first
        if next_first > at:  # layers [at, next_first) are in no file: name the one that would hold them
            last = None if next_first >= n_layers else next_first - 1
            missing = PartName(where / part_file_name(stem, at, last), stem, at, last)
            raise ModelFileError(
                f"missing part for {missing.describe()}: no {stem}-Layers*.gguf in {where} holds them "
                f"(a part such as {missing.path.name})"
            )
        if part is not None:
            at = part.end(n_layers)
    if end == n_layers and not needed[-1].has_head:
        missing = part_file_name(stem, needed[-1].last + 1, None)
        raise ModelFileError(
            f"missing part for the output head: no {stem}-Layers*.gguf in {where} holds it (a part such as {missing})"
        )
    return needed


def layer_span(n_layers: int, layers: tuple[int, int] | None, path: Path) -> range:
    """The layers `layers=(first, end)` (end exclusive) of a model of `n_layers` in `path` (None: all of
    them); a ModelFileError for a range that is not a slice of them."""
    if layers is None:
        return range(n_layers)
    first, end = layers
    if not 0 <= first < end <= n_layers:
        raise ModelFileError(
            f"{path}: layers ({first}, {end}) are not a slice of its {n_layers} layers: "
            f"need 0 <= first < end <= {n_layers} (end exclusive)"
        )
    return range(first, end)


def layer_of(tensor_name: str) -> int | None:
    """N for a `blk.N.*` tensor, None for the others (embedding, output head)."""
    match = _LAYER_TENSOR.match(tensor_name)
    return None if match is None else int(match[1])


def layers_in(gguf: GGUFFile) -> set[int]:
    """The block indices whose `blk.N.*` tensors the file holds."""
    return {layer for name in gguf.tensors if (layer := layer_of(name)) is not None}


def check_same_model(reference: GGUFFile, part: GGUFFile) -> None:
    """Parts of one model carry the same architecture keys (`general.architecture`, `<arch>.*`); a part of
    another family (V4 in a V4.1 set, or the reverse) is named by its architecture first."""
    arch = reference.metadata.get("general.architecture")

    def model_keys(gguf: GGUFFile) -> dict[str, Any]:
        return {k: v for k, v in gguf.metadata.items() if k == "general.architecture" or k.startswith(f"{arch}.")}

    ours, theirs = model_keys(reference), model_keys(part)
    for key in sorted(ours.keys() | theirs.keys(), key=lambda k: (k != "general.architecture", k)):
        if ours.get(key) != theirs.get(key):
            raise ModelFileError(
                f"{part.path} is not a part of the same model as {reference.path}: "
                f"{key} is {theirs.get(key, 'absent')!r} there and {ours.get(key, 'absent')!r} here"
            )


def check_not_llama_split(gguf: GGUFFile) -> None:
    count = gguf.metadata.get(LLAMA_SPLIT_COUNT, 1)
    if count > 1:
        raise ModelFileError(
            f"{gguf.path} is file {gguf.metadata.get(LLAMA_SPLIT_NO, 0) + 1} of {count} of a llama.cpp gguf-split set, "
            "which is not supported: merge it with `llama-gguf-split --merge`, or split it ds4's way "
            "(`dwarfstar synth --split-at` shows the naming)"
        )


class GGUFSet:
    """Parts of a split set read as one GGUF: the first part's metadata, every part's tensors.

    It answers what the backends' loaders ask of a `GGUFFile` (`metadata`, `tensors`, `tensor`, `raw`,
    `release`, `close`); tensor offsets stay those of the part holding the tensor (`part_of`)."""

    def __init__(self, parts: Sequence[GGUFFile]) -> None:
        self.parts = tuple(parts)
        self.metadata = self.parts[0].metadata
        self.metadata_types = self.parts[0].metadata_types
        self.alignment = self.parts[0].alignment
        self.tensors: dict[str, TensorInfo] = {}
        self._owner: dict[str, GGUFFile] = {}
        for part in self.parts:
            for name, info in part.tensors.items():
                if name in self._owner:
                    raise ModelFileError(f"tensor {name!r} is in both {self._owner[name].path} and {part.path}")
                self.tensors[name], self._owner[name] = info, part

    @property
    def path(self) -> Path:
        """The one file, for code that reads tensors by offset (expert streaming): only a set opened
        as a single part has one; offsets in two parts are not offsets in one file."""
        if len(self.parts) == 1:
            return self.parts[0].path
        raise ModelFileError(
            f"the split set {', '.join(p.path.name for p in self.parts)} spans {len(self.parts)} files, and this "
            "reads tensors by offset in one file; open a layer range held by one part, or use a single-file model"
        )

    def typed_metadata(self) -> dict[str, tuple[ValueType, Any]]:
        return self.parts[0].typed_metadata()

    def part_of(self, name: str) -> GGUFFile:
        try:
            return self._owner[name]
        except KeyError:
            paths = ", ".join(str(p.path) for p in self.parts)
            raise ModelFileError(f"no tensor named {name!r} in the parts opened ({paths})") from None

    def raw(self, name: str) -> np.ndarray:
        return self.part_of(name).raw(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.part_of(name).tensor(name)

    def release(self, name: str) -> None:
        self.part_of(name).release(name)

    def populate(self) -> bool:
        return all([part.populate() for part in self.parts])

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def __enter__(self) -> GGUFSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_all_parts(part: PartName) -> GGUFSet:
    """Every part of `part`'s set that is present, as one GGUFSet (for tools that read a whole set)."""
    opened: list[GGUFFile] = []
    try:
        for name in find_parts(part):
            opened.append(GGUFFile(name.path))
        return GGUFSet(opened)
    except BaseException:
        for gguf in opened:
            gguf.close()
        raise


def open_parts(named: PartName, head: GGUFFile, n_layers: int, first: int, end: int) -> GGUFSet:
    """The parts of `named`'s set that hold layers [first, end) (and the output head when `end` is
    `n_layers`), as one GGUFSet; `head` is `named`'s file, already open (its header gave the model's
    `n_layers`), and is closed here when the range does not need it. Each part must be of the same model
    as `head` (`check_same_model`) and hold exactly the layers its name says; a ModelFileError names the
    part that is missing, foreign, misnamed or overlapping. Every file, `head` included, is closed on error."""
    opened = [head]
    try:
        files = []
        for part in select_parts(find_parts(named), n_layers, first, end):
            gguf = head if part.path == named.path else GGUFFile(part.path)
            if gguf is not head:
                opened.append(gguf)
            check_same_model(head, gguf)
            found, claimed = layers_in(gguf), set(range(part.first, part.end(n_layers)))
            if found != claimed:
                raise ModelFileError(f"{part.path} holds {describe_layers(found)}, but its name says {part.describe()}")
            files.append(gguf)
        if head not in files:  # the part named is not one this range needs: unmap it
            opened.remove(head)
            head.close()
        return GGUFSet(files)
    except BaseException:
        for gguf in opened:
            gguf.close()
        raise


def describe_layers(layers: set[int]) -> str:
    """`layers 3-5`, `layers 0-4 with gaps`, or `no layers`."""
    if not layers:
        return "no layers"
    lo, hi = min(layers), max(layers)
    holes = "" if len(layers) == hi - lo + 1 else " with gaps"
    return f"layers {lo}-{hi}{holes}"


def set_problem(gguf_set: GGUFSet) -> str | None:
    """What keeps a whole set from opening as one model (a missing, overlapping or foreign part), or None."""
    names = [PartName.parse(p.path) for p in gguf_set.parts]
    arch = gguf_set.metadata.get("general.architecture")
    n_layers = gguf_set.metadata.get(f"{arch}.block_count")
    try:
        for part in gguf_set.parts[1:]:
            check_same_model(gguf_set.parts[0], part)
        if isinstance(n_layers, int):
            select_parts(names, n_layers, 0, n_layers)
    except ModelFileError as exc:
        return str(exc)
    return None


def write_parts(
    src: GGUFFile | GGUFSet, paths: Sequence[Path], part_of: Callable[[str], int], last: Collection[str] = ()
) -> None:
    """Copy `src` into the files `paths`, tensor `name` into `paths[part_of(name)]`, bytes unchanged and
    in the source's order but for the tensors named in `last`, which go after every other of their part
    (V4.1's Engram tables); each file with the whole metadata (what makes a part openable alone)."""
    metadata = src.typed_metadata()
    groups: list[list[TensorInfo]] = [[] for _ in paths]
    for info in sorted(src.tensors.values(), key=lambda info: info.name in last):  # stable: the order kept
        groups[part_of(info.name)].append(info)
    for path, infos in zip(paths, groups, strict=True):
        with GGUFWriter(path, metadata, alignment=src.alignment) as writer:
            for info in infos:
                writer.add_tensor(info.name, info.shape, info.ggml_type)
            for info in infos:
                writer.write_tensor(info.name, src.raw(info.name))
