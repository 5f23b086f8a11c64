"""The DS41 session payload: a DeepSeek V4.1 sequence state (`model.state_v41.PayloadState41`) as bytes.

V4's DSV4 layout (payload.py) holds per-layer compressor rows; a V4.1 state holds its compressed rows
and index keys once per kv-source layer (reuse and reindex layers read their source's), so it has a
layout of its own, told apart by its magic: a DSV4 payload never reads as DS41, nor the reverse.

Header: 12 little-endian u32 (magic "DS41", version 1, ctx, prefill chunk, token count T, layers,
window, head dim, indexer head dim, vocab, kv sources S, window rows W = min(T, window - 1)). Body:
u32[T] tokens, f32[vocab] next-token logits, u32[S] kv-source layers, u32[S] their compress ratios,
then per layer its W window rows (oldest first), then per kv source its T // ratio compressed rows and
as many index keys, and at ratio 2 its frontier (2 slots of kv, then 2 of score, -inf where empty).
All rows f32 of head dim, the index keys of indexer head dim.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from dwarfstar.kvcache.payload import PayloadError
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import FAMILY41
from dwarfstar.model.state_v41 import PayloadState41

MAGIC41 = int.from_bytes(b"DS41", "little")
VERSION41 = 1
HEADER41 = struct.Struct("<12I")
FRONTIER_SLOTS = 2  # a ratio-2 compressor's unfinished group
FRONTIER_KV, FRONTIER_SCORE = "frontier kv", "frontier score"  # the two halves of `frontiers[il]`


@dataclass(frozen=True)
class PayloadHeader41:
    ctx: int
    chunk: int
    n_tokens: int
    n_layers: int
    window: int
    head_dim: int
    index_head_dim: int
    vocab: int
    n_sources: int
    window_rows: int

    def pack(self) -> bytes:
        return HEADER41.pack(
            MAGIC41, VERSION41, self.ctx, self.chunk, self.n_tokens, self.n_layers, self.window, self.head_dim,
            self.index_head_dim, self.vocab, self.n_sources, self.window_rows,
        )  # fmt: skip

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> PayloadHeader41:
        if len(data) < HEADER41.size:
            raise PayloadError(f"DS41 payload truncated: {len(data)} bytes, the header alone needs {HEADER41.size}")
        magic, version, *fields = HEADER41.unpack_from(data)
        if magic != MAGIC41:
            raise PayloadError(f"not a DS41 session payload (magic {magic:#010x})")
        if version != VERSION41:
            raise PayloadError(f"DS41 payload version {version} is not supported (expected {VERSION41})")
        return cls(*fields)


def header41_for(args: ModelArgs41, n_tokens: int, ctx: int, chunk: int) -> PayloadHeader41:
    return PayloadHeader41(
        ctx=ctx,
        chunk=chunk,
        n_tokens=n_tokens,
        n_layers=args.n_layers,
        window=args.window,
        head_dim=args.head_dim,
        index_head_dim=args.index_head_dim,
        vocab=args.vocab_size,
        n_sources=len(args.kv_source_layers),
        window_rows=min(n_tokens, args.window - 1),
    )


def _ratios(args: ModelArgs41) -> list[int]:
    return [args.compress_ratios[il] for il in args.kv_source_layers]


def payload41_nbytes(args: ModelArgs41, n_tokens: int) -> int:
    """The exact payload size of a state of `n_tokens`."""
    size = HEADER41.size + 4 * n_tokens + 4 * args.vocab_size + 8 * len(args.kv_source_layers)
    size += 4 * args.head_dim * min(n_tokens, args.window - 1) * args.n_layers
    for ratio in _ratios(args):
        size += 4 * (args.head_dim + args.index_head_dim) * (n_tokens // ratio)
        if ratio == FRONTIER_SLOTS:
            size += 2 * 4 * FRONTIER_SLOTS * args.head_dim
    return size


def _shapes(args: ModelArgs41, n_tokens: int) -> Iterator[tuple[str, int, tuple[int, int]]]:
    """Every tensor of the body after the source table, in order: (the state's field, layer, shape)."""
    for il in range(args.n_layers):
        yield "windows", il, (min(n_tokens, args.window - 1), args.head_dim)
    for il, ratio in zip(args.kv_source_layers, _ratios(args), strict=True):
        yield "rows", il, (n_tokens // ratio, args.head_dim)
        yield "index_keys", il, (n_tokens // ratio, args.index_head_dim)
        if ratio == FRONTIER_SLOTS:
            yield FRONTIER_KV, il, (FRONTIER_SLOTS, args.head_dim)
            yield FRONTIER_SCORE, il, (FRONTIER_SLOTS, args.head_dim)


def _tensor(state: PayloadState41, field: str, il: int) -> torch.Tensor | None:
    if field in (FRONTIER_KV, FRONTIER_SCORE):
        pair = state.frontiers.get(il)
        return None if pair is None else pair[field == FRONTIER_SCORE]
    return getattr(state, field).get(il)


def _f32(values: np.ndarray) -> memoryview:
    flat = np.ascontiguousarray(values, "<f4").reshape(-1)
    return memoryview(flat).cast("B")


def write_payload41(out: BinaryIO, state: PayloadState41, args: ModelArgs41, ctx: int, chunk: int) -> int:
    """Write the state's payload into `out`; returns the bytes written. A state whose tensors do not
    have the layout's shapes is refused before anything is written."""
    if not state.tokens or state.logits is None:
        raise PayloadError("cannot save an empty session")
    n = len(state.tokens)
    body = []
    for field, il, shape in _shapes(args, n):
        tensor = _tensor(state, field, il)
        if tensor is None or tuple(tensor.shape) != shape:
            got = None if tensor is None else tuple(tensor.shape)
            raise PayloadError(f"layer {il}'s {field} is {got}, the DS41 layout for {n} tokens needs {shape}")
        body.append(tensor)
    pieces = [
        header41_for(args, n, ctx, chunk).pack(),
        np.asarray(state.tokens, dtype="<u4").tobytes(),
        _f32(state.logits.reshape(-1).detach().cpu().numpy()),
        np.asarray([*args.kv_source_layers, *_ratios(args)], dtype="<u4").tobytes(),
        *(_f32(state.host(t)) for t in body),
    ]
    written = sum(out.write(piece) for piece in pieces)
    expected = payload41_nbytes(args, n)
    if written != expected:  # a logits row of another width: never let it reach the disk as a valid file
        raise PayloadError(f"payload size {written} does not match the DS41 layout ({expected} bytes)")
    return written


def check_compatible41(header: PayloadHeader41, args: ModelArgs41, ctx: int, chunk: int) -> None:
    """Refuse, with the reason, a payload written for another model shape, context or chunk size."""
    mine = header41_for(args, header.n_tokens, ctx, chunk)
    for name in ("n_layers", "window", "head_dim", "index_head_dim", "vocab", "n_sources"):
        if getattr(header, name) != getattr(mine, name):
            raise PayloadError(
                f"written for another {FAMILY41} model: {name} {getattr(header, name)} != {getattr(mine, name)}"
            )
    if header.chunk != chunk:
        raise PayloadError(f"written with prefill chunk {header.chunk}, this session uses {chunk}")
    if header.ctx > ctx or header.n_tokens >= ctx:
        raise PayloadError(f"written for context {header.ctx} with {header.n_tokens} tokens; this session holds {ctx}")
    if header.n_tokens == 0 or header.window_rows != mine.window_rows:
        raise PayloadError(f"inconsistent header: {header.n_tokens} tokens with {header.window_rows} window rows")


def read_payload41(
    data: bytes | memoryview, args: ModelArgs41, ctx: int, chunk: int, new_state: Callable[[], PayloadState41]
) -> PayloadState41:
    """Rebuild a V4.1 sequence state from payload bytes into `new_state()` (the backend's empty state),
    validating the header, the source table, every token id and the exact size."""
    header = PayloadHeader41.unpack(data)
    check_compatible41(header, args, ctx, chunk)
    n = header.n_tokens
    expected = payload41_nbytes(args, n)
    if len(data) != expected:
        raise PayloadError(f"DS41 payload is {len(data)} bytes, the layout for {n} tokens needs {expected}")
    at = HEADER41.size

    def take(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal at
        arr = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=at)
        at += arr.nbytes
        return arr.reshape(shape)

    tokens = take("<u4", (n,)).astype(np.int64).tolist()
    if max(tokens) >= args.vocab_size:
        raise PayloadError(f"payload holds token id {max(tokens)}, outside the vocabulary of {args.vocab_size}")
    logits = torch.from_numpy(take("<f4", (args.vocab_size,)).copy())
    sources = take("<u4", (2, header.n_sources)).tolist()
    if sources != [list(args.kv_source_layers), _ratios(args)]:
        raise PayloadError(
            f"written for another {FAMILY41} layer plan: kv sources {sources[0]} at ratios {sources[1]}, this "
            f"model's are {list(args.kv_source_layers)} at {_ratios(args)}"
        )
    state = new_state()
    state.tokens, state.logits = tokens, logits
    for field, il, shape in _shapes(args, n):
        tensor = state.array(take("<f4", shape).copy())
        if field == FRONTIER_KV:
            kv = tensor
        elif field == FRONTIER_SCORE:
            state.frontiers[il] = (kv, tensor)
        else:
            getattr(state, field)[il] = tensor
    return state
