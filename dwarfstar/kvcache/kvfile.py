"""One disk KV cache file: ds4's KVC v1 layout (DS4_SURFACE §4.2) plus a DwarfStar identity section.

    offset size
    0      3    "KVC"
    3      u8   version 1
    4      u8   routed-expert quant bits: 2 (IQ2_XXS/Q2_K), 4 (Q4_K/MXFP4), 8 (Q8_0), 16 (F16/BF16), 32 (F32)
    5      u8   save reason (kvpolicy.SaveReason)
    6      u8   ext flags: bit0 KTM section, bit1 Responses-visible key, bit2 thinking-visible key,
                bit7 DwarfStar identity section (bit3 is ds4's session-title section, so not that one)
    7      u8   0
    8      u32  cached token count
    12     u32  hit count                       mutable
    16     u32  context the file was written for
    20     u32  CRC32 (reserved in ds4)
    24     u64  created, unix seconds
    32     u64  last used, unix seconds         mutable
    40     u64  payload bytes
    48     u32  key length L
    52     L    key: the decoded text of the cached tokens (or the visible transcript, bits 1/2)
    52+L        DSV4 session payload (payload.py)
                KTM if bit0: "KTM", u8 1, u32 count, per entry u32 id_len, u32 dsml_len, id, DSML
                identity if bit7, always last: "DWS", u8 1, u8[32] model fingerprint, u32 CRC32 of
                the 36 bytes before it

The CRC32 covers the whole file with the two mutable fields and the CRC itself zeroed: any flipped,
missing or extra byte fails it, while counting a hit in place keeps the file valid. A directory scan
reads only the head and the identity section, whose own CRC tells a damaged fingerprint (removed)
from another model's file (kept) without reading the payload. The fingerprint
tells apart models of the same shape (two random test models, two fine-tunes) yet matches every
quantization of one model, so cross-quant reuse works: SHA-256 of the hyperparameters and the raw
bytes of every F32-only tensor (norms, HC scales and bases, sinks, router biases), which
quantization never touches. ds4 ignores the reserved bytes and anything after the KTM section, so
it can read these files (when the quant bits are 2 or 4); ds4's own files carry no identity and are
refused here, since nothing in them says which model wrote them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.kvcache.payload import PayloadError
from dwarfstar.kvcache.payloads import HEADER_BYTES, AnyHeader, read_header
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.tensors import EXPERTS, NORM, expected_tensors, layer_tensor
from dwarfstar.model.tensors_v41 import expected_tensors41

MAGIC = b"KVC"
VERSION = 1
FIXED = struct.Struct("<3sBBBBBIIIIQQQI")  # the 48-byte header and the key length
EXT_TOOL_MAP = 0x01
EXT_RESPONSES_VISIBLE = 0x02
EXT_THINKING_VISIBLE = 0x04
EXT_IDENTITY = 0x80
KTM = struct.Struct("<3sBI")
KTM_ENTRY = struct.Struct("<II")
IDENTITY = struct.Struct("<3sB32sI")
MAX_TOOL_ID = 256  # ds4's loader caps
MAX_DSML = 512 << 20

_QUANT_BITS = {
    GGMLType.IQ2_XXS: 2,
    GGMLType.Q2_K: 2,
    GGMLType.Q4_K: 4,
    GGMLType.MXFP4: 4,
    GGMLType.Q8_0: 8,
    GGMLType.F16: 16,
    GGMLType.BF16: 16,
    GGMLType.F32: 32,
}


class KVFileError(DwarfStarError):
    """A cache file that cannot be used."""


class CorruptFile(KVFileError):
    """Damaged or truncated: it can never load, so the cache removes it."""


class ForeignFile(KVFileError):
    """Intact but not ours to load (another model, context, chunk size, quant, or engine); kept."""


@dataclass(frozen=True)
class ModelIdentity:
    quant_bits: int
    fingerprint: bytes  # 32 bytes

    @classmethod
    def of(cls, model: ModelFile | ModelFile41) -> ModelIdentity:
        """A V4 or V4.1 model's identity (the two families' hyperparameters have different fields, so
        they never share a fingerprint)."""
        args = model.args
        # the KV state does not depend on these: a context limit, and the MTP head ds4 never saves
        fields = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("max_seq_len", "n_mtp_layers")}
        h = hashlib.sha256(repr(sorted(fields.items())).encode())
        specs = expected_tensors41(args) if isinstance(model, ModelFile41) else expected_tensors(args)
        for spec in specs:
            if spec.types == NORM:
                h.update(spec.name.encode())
                h.update(model.gguf.raw(spec.name))
        gates = Counter(model.gguf.tensors[layer_tensor(il, EXPERTS[0])].ggml_type for il in range(args.n_layers))
        return cls(quant_bits=_QUANT_BITS[gates.most_common(1)[0][0]], fingerprint=h.digest())


@dataclass
class FileHeader:
    quant_bits: int
    reason: int
    ext_flags: int
    tokens: int
    hits: int
    ctx: int
    crc: int
    created: int
    last_used: int
    payload_bytes: int
    key_len: int

    def pack(self) -> bytes:
        return FIXED.pack(
            MAGIC, VERSION, self.quant_bits, self.reason, self.ext_flags, 0, self.tokens, self.hits, self.ctx,
            self.crc, self.created, self.last_used, self.payload_bytes, self.key_len,
        )  # fmt: skip

    def checksummed(self) -> bytes:
        """The header as the CRC sees it: hits, CRC and last-used zeroed."""
        return dataclasses.replace(self, hits=0, crc=0, last_used=0).pack()

    @classmethod
    def unpack(cls, data: bytes) -> FileHeader:
        if len(data) < FIXED.size:
            raise CorruptFile(f"truncated header: {len(data)} of {FIXED.size} bytes")
        magic, version, *fields = FIXED.unpack_from(data)
        if magic != MAGIC:
            raise CorruptFile(f"not a KVC file (magic {magic!r})")
        if version != VERSION:
            raise ForeignFile(f"KVC version {version} (this engine reads {VERSION})")
        quant, reason, ext, _reserved, tokens, hits, ctx, crc, created, last_used, payload, key_len = fields
        if tokens == 0:
            raise CorruptFile("header claims 0 cached tokens")
        return cls(quant, reason, ext, tokens, hits, ctx, crc, created, last_used, payload, key_len)

    @property
    def payload_offset(self) -> int:
        return FIXED.size + self.key_len

    @property
    def payload_end(self) -> int:
        return self.payload_offset + self.payload_bytes


@dataclass
class Head:
    """What a directory scan reads: header, key, payload header and identity, not the payload."""

    header: FileHeader
    key: bytes
    payload: AnyHeader  # either family's (payloads.py)
    fingerprint: bytes | None  # None: no identity section (ds4's files)
    file_size: int


@dataclass
class Checkpoint:
    header: FileHeader
    key: bytes
    payload: memoryview
    tool_map: dict[str, str]


def encode_tool_map(tool_map: Mapping[str, str]) -> bytes:
    if not tool_map:
        return b""
    parts = [KTM.pack(b"KTM", 1, len(tool_map))]
    for tool_id, dsml in tool_map.items():
        raw_id, raw_dsml = tool_id.encode("utf-8", "surrogateescape"), dsml.encode("utf-8", "surrogateescape")
        parts += [KTM_ENTRY.pack(len(raw_id), len(raw_dsml)), raw_id, raw_dsml]
    return b"".join(parts)


def decode_tool_map(data: memoryview) -> dict[str, str]:
    if len(data) < KTM.size:
        raise CorruptFile("truncated tool-id map")
    magic, version, count = KTM.unpack_from(data)
    if magic != b"KTM" or version != 1:
        raise CorruptFile(f"bad tool-id map header {bytes(data[:4])!r}")
    out, at = {}, KTM.size
    for _ in range(count):
        if at + KTM_ENTRY.size > len(data):
            raise CorruptFile("truncated tool-id map")
        id_len, dsml_len = KTM_ENTRY.unpack_from(data, at)
        at += KTM_ENTRY.size
        if id_len > MAX_TOOL_ID or dsml_len > MAX_DSML or at + id_len + dsml_len > len(data):
            raise CorruptFile(f"tool-id map entry of {id_len} + {dsml_len} bytes is out of bounds")
        tool_id = bytes(data[at : at + id_len]).decode("utf-8", "surrogateescape")
        out[tool_id] = bytes(data[at + id_len : at + id_len + dsml_len]).decode("utf-8", "surrogateescape")
        at += id_len + dsml_len
    if at != len(data):
        raise CorruptFile(f"{len(data) - at} stray bytes after the tool-id map")
    return out


class _Checksummed:
    """A write-only file wrapper that keeps a running CRC32 of what goes through it."""

    def __init__(self, out: BinaryIO, crc: int) -> None:
        self.out, self.crc, self.written = out, crc, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        n = self.out.write(data)
        self.written += n
        return n


def write_checkpoint(
    out: BinaryIO,
    header: FileHeader,
    key: bytes,
    write_payload: Callable[[BinaryIO], int],
    tool_map: bytes,
    fingerprint: bytes,
) -> int:
    """Write a whole file into `out` (seekable, at offset 0), CRC last; returns the file size."""
    header.ext_flags |= EXT_IDENTITY | (EXT_TOOL_MAP if tool_map else 0)
    header.key_len, header.crc = len(key), 0
    out.write(header.pack())
    body = _Checksummed(out, zlib.crc32(header.checksummed()))
    body.write(key)
    if write_payload(body) != header.payload_bytes:
        raise PayloadError("payload size does not match the header")
    body.write(tool_map)
    body.write(_identity_section(fingerprint))
    out.seek(20)
    out.write(struct.pack("<I", body.crc))
    out.seek(0, 2)
    return FIXED.size + body.written


def _identity_section(fingerprint: bytes) -> bytes:
    start = IDENTITY.pack(b"DWS", 1, fingerprint, 0)[:-4]
    return start + struct.pack("<I", zlib.crc32(start))


def read_head(path: Path) -> Head:
    """Header, key, payload header and identity, with plain reads of just those bytes."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        header = FileHeader.unpack(f.read(FIXED.size))
        if size < header.payload_end:
            raise CorruptFile(f"truncated: {size} bytes, the key and payload alone need {header.payload_end}")
        key = f.read(header.key_len)
        try:
            payload = read_header(f.read(min(HEADER_BYTES, header.payload_bytes)))
        except PayloadError as exc:
            raise CorruptFile(str(exc)) from exc
        fingerprint = None
        if header.ext_flags & EXT_IDENTITY:
            if size < header.payload_end + IDENTITY.size:
                raise CorruptFile("truncated: the identity section is missing")
            f.seek(size - IDENTITY.size)
            section = f.read(IDENTITY.size)
            if section != _identity_section(section[4:36]):
                raise CorruptFile("truncated or damaged: no intact identity section at the end")
            fingerprint = section[4:36]
    if hashlib.sha1(key).hexdigest() + ".kv" != path.name:
        raise CorruptFile("the key does not hash to the file name")
    if payload.n_tokens != header.tokens:
        raise CorruptFile(f"header says {header.tokens} tokens, the payload {payload.n_tokens}")
    return Head(header, key, payload, fingerprint, size)


def read_checkpoint(path: Path) -> Checkpoint:
    """The whole file in one plain read (no mmap: the model already maps a huge file), verified."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        buf = bytearray(size)
        if f.readinto(buf) != size:
            raise CorruptFile("file shrank while reading")
    view = memoryview(buf)
    header = FileHeader.unpack(view[: FIXED.size])
    if not header.ext_flags & EXT_IDENTITY:
        raise ForeignFile("no DwarfStar identity section (written by ds4 or another engine)")
    end = size - IDENTITY.size
    if end < header.payload_end:
        raise CorruptFile(f"truncated: {size} bytes, the layout needs at least {header.payload_end + IDENTITY.size}")
    crc = zlib.crc32(view[FIXED.size :], zlib.crc32(header.checksummed()))
    if crc != header.crc:
        raise CorruptFile(f"checksum mismatch (stored {header.crc:#010x}, computed {crc:#010x})")
    has_map = bool(header.ext_flags & EXT_TOOL_MAP)
    if not has_map and end != header.payload_end:
        raise CorruptFile(f"{end - header.payload_end} stray bytes after the payload")
    tool_map = decode_tool_map(view[header.payload_end : end]) if has_map else {}
    key = bytes(view[FIXED.size : header.payload_offset])
    return Checkpoint(header, key, view[header.payload_offset : header.payload_end], tool_map)


def read_tool_map(path: Path) -> dict[str, str]:
    """Only the KTM section (unverified: for deciding whether a file needs rewriting, not for loading)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        header = FileHeader.unpack(f.read(FIXED.size))
        if not header.ext_flags & EXT_TOOL_MAP:
            return {}
        if header.payload_end > size - IDENTITY.size:  # a damaged length: seeking there is not even possible
            raise CorruptFile(f"truncated: {size} bytes, the layout needs {header.payload_end + IDENTITY.size}")
        f.seek(header.payload_end)
        return decode_tool_map(memoryview(f.read(max(0, size - IDENTITY.size - header.payload_end))))


def touch(path: Path, header: FileHeader) -> None:
    """Write the hit count and last-used time in place (outside the checksum)."""
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(struct.pack("<I", header.hits))
        f.seek(32)
        f.write(struct.pack("<Q", header.last_used))
