"""An index over a directory of `*.safetensors` files, read one tensor at a time.

Keys are indexed under their official names (either dialect is accepted, see `names.canonical_name`),
and a block-quantized weight `X.weight` is paired with its scale sibling `X.scale` (official) or
`X.weight_scale_inv` (DeepSeek V3 style). Reading keeps at most one file open: `safe_open` memory-maps
the whole file, and the pages it touched count against the process until the mapping goes away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from dwarfstar.convert.fp8_fp4 import dequantize_scaled, fp8_block
from dwarfstar.convert.names import canonical_name
from dwarfstar.errors import ModelFileError

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
ALL_ROWS = slice(None)
# safetensors dtypes that hold packed FP4 as bytes, two values per stored element. (Native "F4"
# storage already reports its shape in values.)
_FP4_BYTE_STORAGE = {"I8", "U8"}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    key: str
    dtype: str  # safetensors dtype name, e.g. "BF16", "F8_E4M3", "I8"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointTensor:
    """One logical checkpoint tensor: its stored data plus the block scale when it is FP8/FP4."""

    name: str  # official spelling
    data: StoredTensor
    scale: StoredTensor | None

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the values (packed FP4 stores two values per element of the last dim)."""
        if self.scale is not None and self.data.dtype in _FP4_BYTE_STORAGE:
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return self.data.shape

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def is_integer(self) -> bool:
        return self.scale is None and self.data.dtype.startswith(("I", "U"))


class Checkpoint:
    """The tensors of every `*.safetensors` file in a directory, by official name."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.files = sorted(self.directory.glob("*.safetensors"))
        if not self.files:
            raise ModelFileError(f"no *.safetensors files in {self.directory}")
        stored: dict[str, StoredTensor] = {}
        for path in self.files:
            for entry in _list_file(path):
                name = canonical_name(entry.key)
                if name in stored:
                    first = stored[name]
                    raise ModelFileError(
                        f"tensor {name!r} is stored twice: {first.key!r} in {first.file.name} "
                        f"and {entry.key!r} in {path.name}"
                    )
                stored[name] = entry
        self.tensors = _pair_scales(stored)
        self._open_path: Path | None = None
        self._open_file = None

    def read(self, tensor: CheckpointTensor, rows: slice = ALL_ROWS) -> torch.Tensor:
        """Values of `rows` (a range of the first axis) of a tensor: float32 for floating-point data,
        dequantized if scaled, and integers as stored.

        Only the rows asked for are read. For an FP8 weight a range must start on one of its blocks (128
        rows in V4's checkpoints, 32 in V4.1's), so the scale rows it needs are whole.
        """
        data = self._load(tensor.data, rows)
        if tensor.scale is None:
            return data if tensor.is_integer else data.float()
        scale_rows, block = rows, None
        if tensor.data.dtype == "F8_E4M3":
            block = fp8_block(tensor.data.shape, tensor.scale.shape, tensor.name)
            if rows != ALL_ROWS:
                if rows.start % block:
                    raise ValueError(f"FP8 rows must start on a {block}-row block, got {rows.start}")
                scale_rows = slice(rows.start // block, -(-rows.stop // block))
        return dequantize_scaled(data, self._load(tensor.scale, scale_rows), tensor.name, block)

    def read_row_bytes(self, tensor: CheckpointTensor, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        """The stored bytes of `rows` of a row-scaled FP8 table (V4.1's Engram embedding: e4m3 values
        [n, width] and their E8M0 scales [n, width / 32]), as uint8 arrays, without decoding them."""
        if tensor.scale is None or tensor.data.dtype != "F8_E4M3" or tensor.scale.dtype != "F8_E8M0":
            kinds = f"{tensor.data.dtype} with {'no scale' if tensor.scale is None else tensor.scale.dtype + ' scales'}"
            raise ModelFileError(f"{tensor.name} is {kinds}; an FP8 row table is F8_E4M3 with F8_E8M0 scales")
        values, scales = self._load(tensor.data, rows), self._load(tensor.scale, rows)
        return values.view(torch.uint8).numpy(), scales.view(torch.uint8).numpy()

    def read_stored(self, tensor: CheckpointTensor) -> torch.Tensor:
        """All of an unscaled tensor's values as stored (bf16 stays bf16): for copying them unchanged."""
        if tensor.scale is not None:
            raise ValueError(f"{tensor.name} is block-scaled; read() dequantizes it")
        return self._load(tensor.data, ALL_ROWS)

    def close(self) -> None:
        self._open_file = self._open_path = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self, stored: StoredTensor, rows: slice) -> torch.Tensor:
        if self._open_path != stored.file:
            self.close()  # drop the previous mapping before opening the next file
            self._open_file = safe_open(str(stored.file), framework="pt")
            self._open_path = stored.file
        try:
            return self._open_file.get_slice(stored.key)[rows]
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise ModelFileError(f"cannot read {stored.key!r} from {stored.file}: {exc}") from exc


def _list_file(path: Path) -> list[StoredTensor]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            entries = []
            for key in handle.keys():
                info = handle.get_slice(key)
                entries.append(StoredTensor(path, key, info.get_dtype(), tuple(info.get_shape())))
            return entries
    except Exception as exc:  # a header safetensors cannot parse
        raise ModelFileError(f"cannot read safetensors file {path}: {exc}") from exc


def _pair_scales(stored: dict[str, StoredTensor]) -> dict[str, CheckpointTensor]:
    scales: dict[str, StoredTensor] = {}
    for name in list(stored):
        for suffix in _SCALE_SUFFIXES:
            weight_name = name.removesuffix(suffix) + ".weight"
            if name.endswith(suffix) and weight_name in stored:
                scales[weight_name] = stored.pop(name)
    return {name: CheckpointTensor(name, data, scales.get(name)) for name, data in stored.items()}
