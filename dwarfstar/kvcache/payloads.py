"""A session payload of either model family, chosen by the model: DeepSeek V4's DSV4 layout (payload.py)
or V4.1's DS41 (payload_v41.py). What saves and loads states (the disk cache, the agent's sessions,
the chat's /save and /load) calls these, never a family's functions directly.

A payload names its family by its magic (`read_header`): one written by the other family is refused
with a `PayloadError` that says so, before any of its bytes is read as rows.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import BinaryIO

from dwarfstar.kvcache import payload as v4
from dwarfstar.kvcache import payload_v41 as v41
from dwarfstar.kvcache.payload import PayloadError, PayloadHeader
from dwarfstar.kvcache.payload_v41 import PayloadHeader41
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import FAMILY41
from dwarfstar.model.state import KVCache, SequenceState, TorchStorage
from dwarfstar.model.state_v41 import SequenceState41, new_sequence41

FAMILY4 = "DeepSeek V4"
HEADER_BYTES = max(v4.HEADER.size, v41.HEADER41.size)  # enough of a payload's start to read its header

AnyArgs = ModelArgs | ModelArgs41
AnyHeader = PayloadHeader | PayloadHeader41
AnyState = SequenceState | SequenceState41


def family_of(args: AnyArgs) -> str:
    return FAMILY41 if isinstance(args, ModelArgs41) else FAMILY4


def suffix_of(args: AnyArgs) -> str:
    """A saved payload's file suffix: `.dsv4` (ds4's layout, V4) or `.ds41` (V4.1's)."""
    return ".ds41" if isinstance(args, ModelArgs41) else ".dsv4"


def read_header(data: bytes | memoryview) -> AnyHeader:
    """The header of a payload of either family, told by its magic."""
    if len(data) < 4:
        raise PayloadError(f"payload truncated: {len(data)} bytes, too few for a magic")
    magic = struct.unpack_from("<I", data)[0]
    if magic == v41.MAGIC41:
        return PayloadHeader41.unpack(data)
    if magic == v4.MAGIC:
        return PayloadHeader.unpack(data)
    raise PayloadError(f"not a session payload: magic {magic:#010x} is neither DSV4 ({FAMILY4}) nor DS41 ({FAMILY41})")


def check_compatible(header: AnyHeader, args: AnyArgs, ctx: int, chunk: int) -> None:
    """Refuse, with the reason, a payload of the other family or written for another model shape,
    context or chunk size."""
    written = FAMILY41 if isinstance(header, PayloadHeader41) else FAMILY4
    if written != family_of(args):
        raise PayloadError(f"a {written} payload cannot load into a {family_of(args)} model")
    if isinstance(header, PayloadHeader41):
        v41.check_compatible41(header, args, ctx, chunk)
    else:
        v4.check_compatible(header, args, ctx, chunk)


def payload_nbytes(args: AnyArgs, n_tokens: int) -> int:
    """The exact payload size of a state of `n_tokens` of this model."""
    if isinstance(args, ModelArgs41):
        return v41.payload41_nbytes(args, n_tokens)
    return v4.payload_nbytes(args, n_tokens)


def write_payload(out: BinaryIO, state: AnyState, args: AnyArgs, ctx: int, chunk: int) -> int:
    """Stream the state's payload into `out` in its model's layout; returns the bytes written."""
    if isinstance(args, ModelArgs41):
        return v41.write_payload41(out, state, args, ctx, chunk)
    return v4.write_payload(out, state, args, ctx, chunk)


def read_payload(
    data: bytes | memoryview, args: AnyArgs, ctx: int, chunk: int, new_state: Callable[[], AnyState]
) -> AnyState:
    """A state rebuilt from a payload of this model's family into `new_state()`, every count checked."""
    check_compatible(read_header(data), args, ctx, chunk)
    if isinstance(args, ModelArgs41):
        return v41.read_payload41(data, args, ctx, chunk, new_state)
    return v4.read_payload(data, args, ctx, chunk, new_state)


def host_states(args: AnyArgs, ctx: int) -> Callable[[], AnyState]:
    """Empty states in host memory for payloads read without a backend (a store's default)."""
    if isinstance(args, ModelArgs41):
        return lambda: new_sequence41(args)
    return KVCache(args, ctx, TorchStorage()).new_state
