"""What travels between the coordinator and a stage: a fixed header, segment records, token ids and a payload.

A message is up to four sends on one link, in this order: the header (`HEADER`, always), the segment
table (int64 [n_segments, 5]: session, start, count, hash before, hash after), the token ids (int64
[n_rows], which hash routing needs in every stage), and the payload (`payload_bytes` bytes: an
activation, logits, or an npz of layer tensors). The header's counts say how big each later send is,
so a receiver never guesses, and a count that disagrees with the payload is a `ProtocolError`.

`PROTOCOL` numbers the message set; a worker registers with it and the coordinator refuses another.
Version 2 added MTP drafting on the last stage: the DRAFT and TRUNCATE ops and the FORWARD flags
FLAG_DRAFT and FLAG_VERIFY (the header's layout is version 1's). Version 3 added DSpark drafting:
a registration says whether its draft is DSpark's, and a DRAFT that starts a track its confidence cut.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import asdict, dataclass, field
from enum import IntEnum

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError

MAGIC = b"DSTG"
PROTOCOL = 3
HEADER = struct.Struct(
    "<4sBBBBQIIQI"
)  # magic, op, status, flags, bits, request, n_segments, n_rows, payload bytes, compute us
SEGMENT_FIELDS = 5
ACTIVATION_BITS = (32, 16, 8)
FLAG_ALL_LOGITS = 1  # the last stage returns logits for every row, not only each sequence's last
FLAG_LOGITS = 2  # a reply whose payload is float32 logits [rows, vocab], not an activation
FLAG_DRAFT = 4  # the last stage keeps each session's final streams (DSpark: its target layers') for its draft track
FLAG_VERIFY = 8  # each stage snapshots the sessions (under the request id) and records the pass's
# compressor projections, so that a TRUNCATE naming the request cuts them back without a pass


class DistError(DwarfStarError):
    """A distributed route that cannot serve a request: the message says which stage and why."""


class ProtocolError(DistError):
    """A message that is truncated, of another protocol, or whose counts disagree with its contents."""


class RouteIncompleteError(DistError):
    """Some layers have no live worker; requests fail until a compatible worker registers."""


class RegistrationError(DistError):
    """A worker the coordinator refuses (another model, overlapping layers, a wrong secret)."""


class Op(IntEnum):
    FORWARD = 1  # run the stage's layers over the activation (the last stage: and the head)
    SNAPSHOT = 2  # keep a copy of each session's small state under the request id
    RESTORE = 3  # return each session to the snapshot named by the request id (truncation)
    RESET = 4  # forget the sessions
    FORK = 5  # segment 0's session copied into segment 1's id
    EXPORT = 6  # the stage's layer tensors of a session, for a payload
    IMPORT = 7  # a session rebuilt from layer tensors (a payload's slice)
    SHUTDOWN = 8  # the worker exits
    REGISTER = 9  # an MLX ring member's registration (torch workers register through the store)
    DRAFT = 10  # the last stage's draft (MTP or DSpark): start a track, feed it held rows, propose (a `DraftRequest`)
    TRUNCATE = 11  # each session cut back to the first tokens of the FLAG_VERIFY pass the request id names


class Status(IntEnum):
    OK = 0
    MISMATCH = 1  # a session's position or token-prefix hash differs from the stage's: replay it
    MISSING = 2  # a snapshot (or a draft track) the stage no longer has: replay the session (restart the track)
    ERROR = 3  # the stage refused the message; the payload is the reason in UTF-8


@dataclass(frozen=True)
class Header:
    op: Op
    request: int = 0
    n_segments: int = 0
    n_rows: int = 0
    payload_bytes: int = 0
    bits: int = 32
    flags: int = 0
    status: Status = Status.OK
    compute_us: int = 0  # a reply's time in the stage's compute, for the per-hop telemetry

    def pack(self) -> torch.Tensor:
        raw = HEADER.pack(
            MAGIC,
            self.op,
            self.status,
            self.flags,
            self.bits,
            self.request,
            self.n_segments,
            self.n_rows,
            self.payload_bytes,
            min(self.compute_us, 2**32 - 1),
        )
        return as_bytes(raw)

    @classmethod
    def unpack(cls, data: torch.Tensor | bytes) -> Header:
        raw = bytes(data.numpy().tobytes() if isinstance(data, torch.Tensor) else data)
        if len(raw) != HEADER.size:
            raise ProtocolError(f"truncated header: {len(raw)} bytes, a header is {HEADER.size}")
        magic, op, status, flags, bits, request, n_segments, n_rows, payload_bytes, compute_us = HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"not a DwarfStar stage message (magic {magic!r})")
        try:
            return cls(Op(op), request, n_segments, n_rows, payload_bytes, bits, flags, Status(status), compute_us)
        except ValueError as exc:
            raise ProtocolError(f"bad header: {exc}") from None


@dataclass(frozen=True)
class SegmentRecord:
    """One sequence's span in a message: the stage checks `hash_before` against its own state."""

    session: int
    start: int
    count: int
    hash_before: int
    hash_after: int

    def row(self) -> list[int]:
        return [self.session, self.start, self.count, _signed(self.hash_before), _signed(self.hash_after)]


def pack_segments(segments: list[SegmentRecord]) -> torch.Tensor:
    return torch.tensor([s.row() for s in segments], dtype=torch.int64).reshape(-1, SEGMENT_FIELDS)


def unpack_segments(table: torch.Tensor, n_rows: int) -> list[SegmentRecord]:
    out = [SegmentRecord(s, a, c, hb % 2**64, ha % 2**64) for s, a, c, hb, ha in table.tolist()]
    if any(s.count < 0 or s.start < 0 for s in out):
        raise ProtocolError("a segment with a negative start or count")
    if out and sum(s.count for s in out) != n_rows:
        raise ProtocolError(f"segments cover {sum(s.count for s in out)} rows, the header says {n_rows}")
    return out


def _signed(value: int) -> int:
    """A u64 as the int64 with the same bits (torch has no uint64 tensors to send)."""
    return value - 2**64 if value >= 2**63 else value


@dataclass
class DraftRequest:
    """A DRAFT's payload (JSON): what the last stage does with one session's draft track, in order."""

    track: int  # the coordinator's id of the track (a new speculator on a session starts a new one)
    start: int | None = None  # (re)start the track at this target position
    shift: int = 1  # the alignment: a held row's paired token is this many positions after it (DSpark: 0)
    confidence: float = 0.0  # DSpark: a block is cut at its first row below this (`--dspark-confidence`)
    feeds: list[list[int]] = field(default_factory=list)  # each: one draft call's paired tokens
    pending: int = -1  # the token after the target's, which the drafts continue
    n: int = 0  # drafts to propose (0: only start and feed)
    margin: float = 0.0  # MTP: ds4's top-1 / top-2 gate (`--mtp-margin`)
    sampling: dict | None = None  # SamplingParams fields and the sampler's seed and step; None: greedy

    def pack(self) -> torch.Tensor:
        return as_bytes(json.dumps(asdict(self)).encode())

    @classmethod
    def unpack(cls, data: torch.Tensor) -> DraftRequest:
        try:
            return cls(**json.loads(data.numpy().tobytes()))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"unreadable draft request: {exc}") from None


# -- the token-prefix hash --------------------------------------------------------------------------------
# FNV-1a over the ids' 4 little-endian bytes: a rolling hash, so a stage extends its own value by the
# span it computes and compares the coordinator's, without keeping or resending the whole history.
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = 2**64 - 1


def extend_hash(value: int, tokens: list[int]) -> int:
    for token in tokens:
        for byte in token.to_bytes(4, "little"):
            value = ((value ^ byte) * FNV_PRIME) & MASK64
    return value


def prefix_hash(tokens: list[int]) -> int:
    return extend_hash(FNV_OFFSET, tokens)


# -- activations --------------------------------------------------------------------------------------------
def activation_nbytes(n_rows: int, row_width: int, bits: int) -> int:
    """Bytes of an encoded [n_rows, row_width] float activation (16 and 8 bits add a float32 scale per row)."""
    if bits == 32:
        return 4 * n_rows * row_width
    if bits in (16, 8):
        return bits // 8 * n_rows * row_width + 4 * n_rows
    raise DistError(f"activation bits must be one of {', '.join(map(str, ACTIVATION_BITS))}, got {bits}")


def encode_activation(h: torch.Tensor, bits: int) -> torch.Tensor:
    """The [N, n, dim] streams as bytes: float32 as is (bit-exact); 16 and 8 bits scale each [dim] row
    by its absmax into float16 (its 10-bit mantissa: a third of bfloat16's logit error on the test
    models, and the scale keeps any magnitude in range) or into int8."""
    rows = h.detach().to(torch.float32).reshape(-1, h.shape[-1])
    activation_nbytes(0, 0, bits)  # refuses an unknown width
    if bits == 32:
        return rows.contiguous().view(torch.uint8).reshape(-1)
    absmax = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    if bits == 16:
        scale = absmax
        q = (rows / scale[:, None]).to(torch.float16)
    else:
        scale = absmax / 127.0
        q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return torch.cat((q.contiguous().view(torch.uint8).reshape(-1), scale.contiguous().view(torch.uint8)))


def decode_activation(data: torch.Tensor, shape: tuple[int, ...], bits: int) -> torch.Tensor:
    """The float32 [N, n, dim] activation from `encode_activation`'s bytes."""
    width, n_rows = shape[-1], int(np.prod(shape[:-1]))
    expected = activation_nbytes(n_rows, width, bits)
    if data.numel() != expected:
        raise ProtocolError(f"activation of {data.numel()} bytes; {shape} at {bits} bits needs {expected}")
    if bits == 32:
        return data.view(torch.float32).reshape(shape)
    body = bits // 8 * n_rows * width
    q = data[:body].view(torch.float16 if bits == 16 else torch.int8).reshape(n_rows, width)
    scale = data[body:].view(torch.float32)
    return (q.to(torch.float32) * scale[:, None]).reshape(shape)


# -- layer tensors and text ----------------------------------------------------------------------------------
def pack_arrays(arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """Named float32 arrays as npz bytes (no pickles), for EXPORT and IMPORT."""
    buf = io.BytesIO()
    np.savez(buf, **{name: np.ascontiguousarray(a, dtype=np.float32) for name, a in arrays.items()})
    return as_bytes(buf.getvalue())


def unpack_arrays(data: torch.Tensor) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data.numpy().tobytes()), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"unreadable layer tensors ({data.numel()} bytes): {exc}") from None


def as_bytes(raw: bytes) -> torch.Tensor:
    """A uint8 tensor of the bytes (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
