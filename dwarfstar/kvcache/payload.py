"""The DSV4 session payload: ds4's byte layout of a sequence state (DS4_SURFACE §4.1).

Header: 13 little-endian u32 (magic "DSV4", version 1, ctx, prefill chunk, raw ring capacity, raw
window, compressed-row capacity, token count T, layers, head dim, indexer head dim, vocab,
raw_live = min(T, window)). Body: u32[T] tokens, f32[vocab] next-token logits, u32[layers]
compressed-row counts, u32[layers] indexer-row counts, then per layer: raw rows oldest first; for
compressed layers the rows and the frontier kv then gate; for ratio-4 layers the indexer rows and
frontier. All f32. For Flash this is exactly 23,995,788 + 13,764 * T bytes when 128 | T.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.image_spans import IMAGE_IDS
from dwarfstar.model.state import SequenceState
from dwarfstar.model.tensors import COMPRESSORS

MAGIC = 0x34565344  # "DSV4" little-endian
VERSION = 1
HEADER = struct.Struct("<13I")


class PayloadError(DwarfStarError):
    """A payload that is corrupt, truncated, or written for another model, context or chunk size."""


@dataclass(frozen=True)
class PayloadHeader:
    ctx: int
    chunk: int
    raw_ring_cap: int
    raw_window: int
    comp_cap: int
    n_tokens: int
    n_layers: int
    head_dim: int
    index_head_dim: int
    vocab: int
    raw_live: int

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            VERSION,
            self.ctx,
            self.chunk,
            self.raw_ring_cap,
            self.raw_window,
            self.comp_cap,
            self.n_tokens,
            self.n_layers,
            self.head_dim,
            self.index_head_dim,
            self.vocab,
            self.raw_live,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> PayloadHeader:
        if len(data) < HEADER.size:
            raise PayloadError(f"payload truncated: {len(data)} bytes, the header alone needs {HEADER.size}")
        magic, version, *fields = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise PayloadError(f"not a DSV4 session payload (magic {magic:#010x})")
        if version != VERSION:
            raise PayloadError(f"DSV4 payload version {version} is not supported (expected {VERSION})")
        return cls(*fields)


def header_for(args: ModelArgs, n_tokens: int, ctx: int, chunk: int) -> PayloadHeader:
    return PayloadHeader(
        ctx=ctx,
        chunk=chunk,
        raw_ring_cap=args.window,
        raw_window=args.window,
        comp_cap=ctx // 4 + 2,
        n_tokens=n_tokens,
        n_layers=args.n_layers,
        head_dim=args.head_dim,
        index_head_dim=args.index_head_dim,
        vocab=args.vocab_size,
        raw_live=min(n_tokens, args.window),
    )


def payload_nbytes(args: ModelArgs, n_tokens: int) -> int:
    """Exact payload size for a state of n_tokens (what ds4's speed-bench reports as kvcache_bytes)."""
    size = HEADER.size + 4 * n_tokens + 4 * args.vocab_size + 8 * args.n_layers
    size += 4 * args.head_dim * min(n_tokens, args.window) * args.n_layers
    for layer in args.layers:
        r = layer.compress_ratio
        if r:
            coff = layer.compressor_overlap
            size += 4 * args.head_dim * (n_tokens // r) + 2 * 4 * coff * r * coff * args.head_dim
        if layer.has_indexer:
            size += 4 * args.index_head_dim * (n_tokens // r) + 2 * 4 * 2 * r * 2 * args.index_head_dim
    return size


def _f32(state: SequenceState, part) -> memoryview:
    # flatten first: memoryview cannot cast a multi-dimensional view with a zero dimension (no rows yet)
    return memoryview(np.ascontiguousarray(state.cache.storage.to_numpy(part), dtype="<f4").reshape(-1)).cast("B")


def _pieces(state: SequenceState, header: PayloadHeader) -> Iterator[bytes | memoryview]:
    yield header.pack()
    yield np.asarray(state.tokens, dtype="<u4").tobytes()
    yield memoryview(state.logits.detach().to("cpu", torch.float32).numpy().astype("<f4")).cast("B")
    for kind in COMPRESSORS:
        counts = [len(state.rows(il, kind)) if state.compressor(il, kind) else 0 for il in range(header.n_layers)]
        yield np.asarray(counts, dtype="<u4").tobytes()
    for il in range(header.n_layers):
        yield _f32(state, state.raw_window(il))
        for kind in COMPRESSORS:
            if state.compressor(il, kind) is not None:
                yield _f32(state, state.rows(il, kind))
                yield _f32(state, state.part(il, f"{kind}_kv"))
                yield _f32(state, state.part(il, f"{kind}_gate"))


def write_payload(out: BinaryIO, state: SequenceState, args: ModelArgs, ctx: int, chunk: int) -> int:
    """Stream the payload into `out` (no copy of the whole state in memory); returns bytes written."""
    if not state.tokens or state.logits is None:
        raise PayloadError("cannot save an empty session")
    header = header_for(args, len(state.tokens), ctx, chunk)
    written = 0
    for piece in _pieces(state, header):
        written += out.write(piece)
    expected = payload_nbytes(args, len(state.tokens))
    if written != expected:  # a state that does not follow the layout must never reach the disk
        raise PayloadError(f"payload size {written} does not match the layout ({expected} bytes)")
    return written


def check_compatible(header: PayloadHeader, args: ModelArgs, ctx: int, chunk: int) -> None:
    """Refuse, with the reason, a payload written for another model shape, context or chunk size."""
    mine = header_for(args, header.n_tokens, ctx, chunk)
    for name in ("n_layers", "head_dim", "index_head_dim", "vocab", "raw_window"):
        if getattr(header, name) != getattr(mine, name):
            raise PayloadError(f"written for another model: {name} {getattr(header, name)} != {getattr(mine, name)}")
    if header.chunk != chunk:
        raise PayloadError(f"written with prefill chunk {header.chunk}, this session uses {chunk}")
    if header.ctx > ctx or header.n_tokens >= ctx:
        raise PayloadError(f"written for context {header.ctx} with {header.n_tokens} tokens; this session holds {ctx}")
    if header.n_tokens == 0 or header.raw_live != min(header.n_tokens, args.window):
        raise PayloadError(f"inconsistent header: {header.n_tokens} tokens with {header.raw_live} raw rows")


def read_payload(
    data: bytes | memoryview, args: ModelArgs, ctx: int, chunk: int, new_state: Callable[[], SequenceState]
) -> SequenceState:
    """Rebuild a sequence state from payload bytes into a slot of `new_state()` (the backend's cache),
    validating every count and the exact size."""
    header = PayloadHeader.unpack(data)
    check_compatible(header, args, ctx, chunk)
    expected = payload_nbytes(args, header.n_tokens)
    if len(data) != expected:
        raise PayloadError(f"payload is {len(data)} bytes, the layout for {header.n_tokens} tokens needs {expected}")
    reader = _Reader(memoryview(data), HEADER.size)
    tokens = reader.array("<u4", header.n_tokens).astype(np.int64).tolist()
    if any(t >= IMAGE_IDS for t in tokens):  # ids past the vocabulary are an image block's (model/image_spans.py)
        raise PayloadError("payload holds a token id outside the vocabulary and the image ids")
    logits = torch.from_numpy(reader.array("<f4", args.vocab_size).copy())
    counts = dict(zip(COMPRESSORS, (reader.array("<u4", args.n_layers).tolist() for _ in COMPRESSORS), strict=True))
    state = new_state()
    if header.n_tokens > state.cache.ctx:
        raise PayloadError(f"payload holds {header.n_tokens} tokens; this backend's cache holds {state.cache.ctx}")
    state.pos, state.tokens = header.n_tokens, tokens
    for il in range(args.n_layers):
        state.store_window(il, state.cache.storage.from_numpy(reader.rows(header.raw_live, args.head_dim)), state.pos)
        for kind in COMPRESSORS:
            spec, n_rows = state.compressor(il, kind), counts[kind][il]
            if spec is None:
                if n_rows:
                    raise PayloadError(f"layer {il} has {n_rows} compressed rows but no compressor of that kind")
                continue
            if n_rows != header.n_tokens // spec.ratio:
                raise PayloadError(
                    f"layer {il}: {n_rows} compressed rows for {header.n_tokens} tokens at ratio {spec.ratio}"
                )
            for name, shape in (
                (f"{kind}_rows", (n_rows, spec.dim)),
                (f"{kind}_kv", spec.frontier_shape),
                (f"{kind}_gate", spec.frontier_shape),
            ):
                state.write(il, name, state.cache.storage.from_numpy(reader.rows(*shape)))
    state.logits = logits.to(state.cache.storage.device)
    return state


class _Reader:
    def __init__(self, buf: memoryview, offset: int) -> None:
        self.buf, self.offset = buf, offset

    def array(self, dtype: str, count: int) -> np.ndarray:
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
        self.offset += arr.nbytes
        return arr

    def rows(self, n: int, width: int) -> np.ndarray:
        return self.array("<f4", n * width).reshape(n, width)
