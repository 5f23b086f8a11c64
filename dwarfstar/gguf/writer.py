"""Streaming GGUF v3 writer.

A converted DeepSeek V4 is far larger than RAM, so nothing is buffered: all tensors are declared first
(their offsets depend only on shapes and types), the header, metadata and tensor infos go out on the first
`write_tensor`, and each tensor's bytes are streamed straight to disk, possibly chunk by chunk (one expert
at a time), or left as a hole (`skip_tensor`). Each tensor's data is zero-padded to the alignment, so the
next one starts aligned, as ggml's loader requires.

The output goes to "<path>.tmp" and is renamed over `path` only after a successful `close()` (after fsync),
so a crash or an exception never leaves a half-written model where a loader would pick it up.

Metadata values are typed explicitly, because llama.cpp rejects e.g. an i32 where it expects a u32:
    scalars: (ValueType.UINT32, 7), (ValueType.STRING, "deepseek4"), (ValueType.BOOL, True)
    arrays:  (ValueType.ARRAY, (ValueType.FLOAT32, [1.0, 2.0]))
    nested:  (ValueType.ARRAY, (ValueType.ARRAY, [(ValueType.INT8, [1]), (ValueType.STRING, ["a"])]))
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.gguf.constants import (
    BLOCK_GEOMETRY,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    VALUE_FORMAT,
    GGMLType,
    ValueType,
    tensor_nbytes,
)

# Element dtypes that a typed array may have for each tensor type, besides raw uint8 bytes. A float64
# array handed to an F32 tensor is a bug, not data; catching it here beats a wrong byte count later.
_TYPED_DTYPES: dict[GGMLType, tuple[str, ...]] = {
    GGMLType.F32: ("float32",),
    GGMLType.F16: ("float16",),
    GGMLType.BF16: ("bfloat16", "int16", "uint16"),
    GGMLType.I32: ("int32",),
}
_CHUNK_TYPES = (bytes, bytearray, memoryview, np.ndarray, torch.Tensor)


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(vtype: ValueType, value: Any) -> bytes:
    """Value bytes, without the leading type tag."""
    if vtype == ValueType.STRING:
        if not isinstance(value, str):
            raise TypeError(f"STRING value must be str, got {type(value).__name__}")
        return _string(value)
    if vtype == ValueType.ARRAY:
        item_type, items = value
        item_type = ValueType(item_type)
        items = list(items)
        head = struct.pack("<IQ", item_type, len(items))
        return head + b"".join(_encode_value(item_type, v) for v in items)
    return struct.pack(VALUE_FORMAT[vtype], value)


def _chunk_bytes(chunk: Any, ggml_type: GGMLType) -> memoryview:
    """A contiguous byte view of one chunk, checking typed arrays against the tensor type."""
    if isinstance(chunk, torch.Tensor):
        dtype = str(chunk.dtype).removeprefix("torch.")
        chunk = chunk.detach().cpu().contiguous()
        # numpy has no bfloat16: hand the bytes over as uint8 (a 0-d tensor cannot be viewed as bytes)
        array = chunk.reshape(-1).view(torch.uint8).numpy()
    elif isinstance(chunk, np.ndarray):
        dtype = chunk.dtype.name
        array = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    else:
        return memoryview(chunk).cast("B")
    if dtype not in ("uint8", "int8") + _TYPED_DTYPES.get(ggml_type, ()):
        raise TypeError(f"{dtype} data cannot be raw {ggml_type.name} bytes")
    return memoryview(array)


class GGUFWriter:
    """Streaming writer: declare all tensors, then write their data in declaration order."""

    def __init__(
        self,
        path: str | os.PathLike,
        metadata: dict[str, tuple[ValueType, Any]],
        alignment: int = GGUF_DEFAULT_ALIGNMENT,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.alignment = alignment
        self._metadata = dict(metadata)
        declared = self._metadata.get("general.alignment")
        if declared is not None and declared[1] != alignment:
            raise ValueError(f"metadata general.alignment={declared[1]} contradicts alignment={alignment}")
        if declared is None and alignment != GGUF_DEFAULT_ALIGNMENT:
            self._metadata["general.alignment"] = (ValueType.UINT32, alignment)
        self._kv_bytes = self._encode_metadata()
        self._infos: list[tuple[str, tuple[int, ...], GGMLType, int, int]] = []  # name, shape, type, offset, nbytes
        self._data_size = 0
        self._next = 0  # index of the next tensor to write
        self._header_written = False
        self._done = False
        self._file = open(self.tmp_path, "wb")  # closed by close() or abort()

    def _encode_metadata(self) -> bytes:
        parts = []
        for key, (vtype, value) in self._metadata.items():
            try:
                vtype = ValueType(vtype)
                parts.append(_string(key) + struct.pack("<I", vtype) + _encode_value(vtype, value))
            except (struct.error, TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"metadata key {key!r}: cannot encode {value!r} as {vtype!r}: {e}") from None
        return b"".join(parts)

    def add_tensor(self, name: str, shape: tuple[int, ...], ggml_type: GGMLType) -> None:
        """Declare a tensor; `shape` is in torch order (its last axis is ggml's contiguous ne0)."""
        if self._header_written:
            raise ValueError(f"cannot add tensor {name!r}: tensor data is already being written")
        if any(name == info[0] for info in self._infos):
            raise ValueError(f"tensor {name!r} declared twice")
        ggml_type = GGMLType(ggml_type)
        if ggml_type not in BLOCK_GEOMETRY:
            raise ValueError(f"tensor {name!r}: ggml type {ggml_type.name} is not supported")
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= 4 or any(d <= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape} must have 1 to 4 positive dimensions")
        n_elements = 1
        for d in shape:
            n_elements *= d
        nbytes = tensor_nbytes(ggml_type, n_elements, shape[-1])
        self._infos.append((name, shape, ggml_type, self._data_size, nbytes))
        self._data_size += -(-nbytes // self.alignment) * self.alignment

    def _write_header(self) -> None:
        f = self._file
        f.write(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self._infos), len(self._metadata)))
        f.write(self._kv_bytes)
        for name, shape, ggml_type, offset, _ in self._infos:
            dims = tuple(reversed(shape))  # GGUF stores ne0 (the contiguous axis) first
            f.write(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset))
        self._pad()
        self._header_written = True

    def _pad(self) -> None:
        self._file.write(b"\0" * (-self._file.tell() % self.alignment))

    def write_tensor(self, name: str, data: Any) -> None:
        """Write the next declared tensor's raw ggml bytes: one buffer/array/tensor, or an iterable of them.

        Any error here (wrong order, wrong size, wrong dtype) aborts the whole file: the tmp file is removed.
        """
        try:
            self._check_open()
            if self._next >= len(self._infos):
                raise ValueError(f"cannot write tensor {name!r}: all {len(self._infos)} declared tensors are written")
            expected, _, ggml_type, _, nbytes = self._infos[self._next]
            if name != expected:
                raise ValueError(f"tensors must be written in declaration order: expected {expected!r}, got {name!r}")
            if not self._header_written:
                self._write_header()
            chunks = (data,) if isinstance(data, _CHUNK_TYPES) else data
            if not isinstance(chunks, Iterable):
                raise TypeError(f"tensor {name!r}: cannot write {type(data).__name__} data")
            written = 0
            for chunk in chunks:
                view = _chunk_bytes(chunk, ggml_type)
                written += view.nbytes
                if written > nbytes:
                    break
                self._file.write(view)
            if written != nbytes:
                got = f"more than {nbytes}" if written > nbytes else str(written)
                raise ValueError(f"tensor {name!r} ({ggml_type.name}) needs {nbytes} bytes, got {got}")
            self._pad()
            self._next += 1
        except BaseException:
            self.abort()
            raise

    def skip_tensor(self, name: str) -> None:
        """Leave the next declared tensor's bytes as a hole: a sparse region that reads as zeros and
        takes no disk (a synthetic table of 100 GB); the file gets its full size all the same."""
        try:
            self._check_open()
            if self._next >= len(self._infos) or self._infos[self._next][0] != name:
                expected = self._infos[self._next][0] if self._next < len(self._infos) else None
                raise ValueError(f"tensors must be written in declaration order: expected {expected!r}, got {name!r}")
            if not self._header_written:
                self._write_header()
            nbytes = self._infos[self._next][4]
            end = self._file.tell() + -(-nbytes // self.alignment) * self.alignment
            self._file.seek(end)
            self._file.truncate(end)  # a hole at the end of the file still counts in its size
            self._next += 1
        except BaseException:
            self.abort()
            raise

    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"GGUF writer for {self.path} is already closed or aborted")

    def close(self) -> None:
        """Check every declared tensor was written, then fsync and atomically move the file into place."""
        self._check_open()
        try:
            if self._next != len(self._infos):
                missing = [info[0] for info in self._infos[self._next :]]
                raise ValueError(f"{len(missing)} declared tensors were never written, first {missing[0]!r}")
            if not self._header_written:
                self._write_header()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp_path, self.path)
            self._done = True
        except BaseException:
            self.abort()
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:  # make the rename itself durable
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        """Discard the partial file. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        self._file.close()
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._done:  # already closed explicitly (or aborted by a failed write)
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()
