"""Read-only, zero-copy GGUF reader.

Layout (GGUF v2/v3, little-endian; v2 and v3 differ only in v3 allowing big-endian files, which we refuse):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)            string = u64 byte length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (ne0 first), u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to the data start and a multiple of the alignment

The file is memory-mapped once; `raw()` hands out views into that mapping, so opening a 150 GB model costs
only the header parse, and tensor bytes are paged in by the OS when a tensor is first touched.

Every way a file can be malformed ends in `ModelFileError` naming what is wrong and where: users point this
at arbitrary downloads, and a struct.error from byte 7 of a truncated file helps nobody.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import (
    BLOCK_GEOMETRY,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    VALUE_FORMAT,
    GGMLType,
    ValueType,
    tensor_nbytes,
)
from dwarfstar.gguf.dequant import dequantize

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 16  # model files never nest arrays; this only bounds recursion on corrupt input

# Smallest encoding of one value of each type, used to reject corrupt counts before looping over them.
_MIN_VALUE_BYTES: dict[ValueType, int] = {t: struct.calcsize(f) for t, f in VALUE_FORMAT.items()}
_MIN_VALUE_BYTES[ValueType.STRING] = 8  # u64 length (an empty string has no bytes after it)
_MIN_VALUE_BYTES[ValueType.ARRAY] = 12  # u32 item type + u64 count
_MIN_KV_BYTES = 8 + 4 + 1  # empty key + value type + a u8 value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name + n_dims + type + offset, zero dims

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11 has no name for it

T = TypeVar("T")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the reverse of the GGUF dims (ne0 is the last, contiguous axis)
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; `where` names the section for error messages."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.path, self.pos, self.where = buf, path, 0, "header"

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {problem}")

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise self.fail(
                f"file truncated inside the {self.where}: needs {n} bytes at offset {self.pos}, "
                f"file is {len(self.buf)} bytes"
            )

    def check_count(self, count: int, min_bytes: int, what: str) -> None:
        """A count whose items cannot fit in the rest of the file is corruption, not a reason to allocate."""
        remaining = len(self.buf) - self.pos
        if count * min_bytes > remaining:
            raise self.fail(
                f"implausible {what} {count} in the {self.where} at offset {self.pos}: needs at least "
                f"{count * min_bytes} bytes, only {remaining} remain (file corrupt or truncated)"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.check_count(length, 1, "string length")
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"invalid UTF-8 string in the {self.where} at offset {self.pos - length}: {e}") from None

    def value_type(self) -> ValueType:
        at, raw = self.pos, self.scalar("<I")
        try:
            return ValueType(raw)
        except ValueError:
            raise self.fail(f"unknown metadata value type {raw} in the {self.where} at offset {at}") from None

    def value(self, vtype: ValueType, depth: int = 0) -> Any:
        if vtype == ValueType.STRING:
            return self.string()
        if vtype == ValueType.ARRAY:
            return self.array(depth)[1]
        return self.scalar(VALUE_FORMAT[vtype])

    def array(self, depth: int = 0) -> tuple[ValueType, list]:
        if depth >= MAX_ARRAY_NESTING:  # a recursion bomb would otherwise end in RecursionError
            raise self.fail(f"arrays nested more than {MAX_ARRAY_NESTING} deep in the {self.where}")
        item_type = self.value_type()
        count = self.scalar("<Q")
        self.check_count(count, _MIN_VALUE_BYTES[item_type], "array length")
        if item_type in VALUE_FORMAT:  # fixed-size items: one vectorised read instead of `count` unpacks
            dtype = np.dtype(VALUE_FORMAT[item_type])
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if item_type == ValueType.BOOL:  # any non-zero byte is true, as for scalar bools
                items = items.view(np.uint8) != 0
            return item_type, items.tolist()
        return item_type, [self.value(item_type, depth + 1) for _ in range(count)]


class GGUFFile:
    """A parsed GGUF file: metadata as Python values, tensor directory, and lazy zero-copy tensor access."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open model file: {e.strerror or e}") from None
        if size == 0:
            raise ModelFileError(f"{self.path}: empty file, not a GGUF model")
        try:
            self._data: np.memmap | None = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot map model file: {e.strerror or e}") from None
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[ValueType, ValueType | None]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse(_Cursor(memoryview(self._data), self.path))

    # -- parsing ---------------------------------------------------------------------------------------
    def _parse(self, cur: _Cursor) -> None:
        cur.need(4)
        magic = bytes(cur.buf[:4])
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version >= 1 << 16 else ""
            raise cur.fail(f"unsupported GGUF version {self.version}{hint}; supported: 2, 3")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        cur.check_count(n_kv, _MIN_KV_BYTES, "metadata count")
        for i in range(n_kv):
            cur.where = f"metadata entry #{i}"
            key = cur.string()
            cur.where = f"metadata entry #{i} ({key!r})"
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            vtype = cur.value_type()
            if vtype == ValueType.ARRAY:
                item_type, value = cur.array()
                self.metadata_types[key] = (vtype, item_type)
            else:
                value = cur.value(vtype)
                self.metadata_types[key] = (vtype, None)
            self.metadata[key] = value
        self.alignment = self._alignment(cur)

        cur.where = "tensor infos"
        cur.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count")
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
        data_start = -(-cur.pos // self.alignment) * self.alignment
        for name, shape, ggml_type, rel_offset in infos:
            self.tensors[name] = self._place(cur, name, shape, ggml_type, rel_offset, data_start)

    def _alignment(self, cur: _Cursor) -> int:
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise cur.fail(f"general.alignment must be a positive integer, got {alignment!r}")
        if alignment & (alignment - 1):
            raise cur.fail(f"general.alignment must be a power of two, got {alignment}")
        return alignment

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
        cur.where = f"tensor info #{i}"
        name = cur.string()
        cur.where = f"tensor info #{i} ({name!r})"
        n_dims = cur.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        type_id = cur.scalar("<I")
        rel_offset = cur.scalar("<Q")
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown ggml type id {type_id}") from None
        if ggml_type not in BLOCK_GEOMETRY:
            supported = ", ".join(t.name for t in BLOCK_GEOMETRY)
            raise cur.fail(f"tensor {name!r} has ggml type {ggml_type.name}, which is not supported ({supported})")
        return name, tuple(reversed(dims)), ggml_type, rel_offset

    def _place(
        self, cur: _Cursor, name: str, shape: tuple[int, ...], ggml_type: GGMLType, rel_offset: int, data_start: int
    ) -> TensorInfo:
        if name in self.tensors:
            raise cur.fail(f"duplicate tensor name {name!r}")
        if rel_offset % self.alignment:
            raise cur.fail(
                f"tensor {name!r} data offset {rel_offset} is misaligned: not a multiple of {self.alignment} bytes"
            )
        n_elements = 1
        for d in shape:
            n_elements *= d
        try:
            nbytes = tensor_nbytes(ggml_type, n_elements, shape[-1])
        except ValueError as e:
            raise cur.fail(f"tensor {name!r} of shape {shape}: {e}") from None
        offset = data_start + rel_offset
        missing = offset + nbytes - len(cur.buf)
        if missing > 0:
            raise cur.fail(
                f"tensor {name!r} data runs past the end of the file: {nbytes} bytes at offset {offset}, "
                f"{missing} bytes missing (file truncated?)"
            )
        return TensorInfo(name, shape, ggml_type, offset, nbytes)

    def typed_metadata(self) -> dict[str, tuple[ValueType, Any]]:
        """The metadata with its value types, as `GGUFWriter` takes it (arrays as (item type, items))."""
        out: dict[str, tuple[ValueType, Any]] = {}
        for key, value in self.metadata.items():
            vtype, item_type = self.metadata_types[key]
            if vtype == ValueType.ARRAY:
                if item_type == ValueType.ARRAY:
                    raise ModelFileError(f"{self.path}: metadata key {key!r} is an array of arrays, cannot copy it")
                value = (item_type, value)
            out[key] = (vtype, value)
        return out

    # -- tensor access ---------------------------------------------------------------------------------
    def _info(self, name: str) -> TensorInfo:
        if self._data is None:
            raise ValueError(f"{self.path} is closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the mapping (no copy, nothing read yet)."""
        info = self._info(name)
        assert self._data is not None
        return self._data[info.offset : info.offset + info.nbytes]

    def release(self, name: str) -> None:
        """Drop the tensor's pages from memory once it has been copied elsewhere.

        On GPUs that share RAM with the CPU (DGX Spark, Strix Halo) the mapped file would otherwise
        stay resident next to its device copy, twice the model at peak. The pages leave this
        process's mapping (MADV_DONTNEED) and the page cache (POSIX_FADV_DONTNEED); reading the
        tensor again reads the file. Pages shared with a neighbouring tensor go too, harmlessly.
        """
        info = self._info(name)
        assert self._data is not None
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        length = info.offset + info.nbytes - start
        self._data._mmap.madvise(mmap.MADV_DONTNEED, start, length)
        if not hasattr(os, "posix_fadvise"):  # macOS: the unified-memory case there is MLX's
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def populate(self) -> bool:
        """Map every page of the file into this process now, reading what the page cache lacks (as
        llama.cpp's MAP_POPULATE): a product's first read of a page then takes no page fault (a Flash
        routed expert's first product: 1.06 ms unmapped, 0.50 mapped). Linux 5.14 and later (False
        elsewhere); only worth it where the file fits in memory."""
        assert self._data is not None
        if not sys.platform.startswith("linux"):
            return False
        try:
            self._data._mmap.madvise(MADV_POPULATE_READ)
        except OSError:
            return False
        return True

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantized copy: float32 for float and quant types, int32 for I32 and I8, in `TensorInfo.shape`."""
        info = self._info(name)
        return dequantize(self.raw(name), info.ggml_type, info.n_elements).reshape(info.shape)

    def close(self) -> None:
        """Drop the mapping. Views from `raw()` keep their pages mapped until they are garbage collected."""
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)


def read_gguf(path: str | os.PathLike, read: Callable[[GGUFFile], T]) -> T:
    """What `read` makes of the GGUF at `path` (a model, an encoder), the file closed again when `read`
    refuses it."""
    gguf = GGUFFile(path)
    try:
        return read(gguf)
    except BaseException:
        gguf.close()
        raise
