"""Memory accounting of the sequence state: what a token costs and what every state costs up front.

A token adds, once its compression windows close, head_dim/r compressed-KV elements on each ratio-r
layer and index_head_dim/4 indexer elements on each ratio-4 layer. For Flash that is
21 * (512 + 128) / 4 + 20 * 512 / 128 = 3440 elements: 6,880 B at bf16, 13,760 B at f32; ds4's
payload adds the u32 token id, so 13,764 B per token on disk (ARCHITECTURE §3.3, DS4_SURFACE §4.1).
A compact cache (Triton with QAT) holds the 448 FP8-rounded dims of a KV row in bf16 and its 64 RoPE
dims in f32, and the FP4-rounded indexer rows in bf16: 21 * (1152 + 256) / 4 + 20 * 1152 / 128 =
7,572 B per token, exactly.
The fixed part does not grow with the sequence: the full raw windows, the compressor frontiers, the
next-token logits, and the payload header and row counts (23,995,788 B for Flash).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dwarfstar.kvcache.payload import payload_nbytes
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.state import KVCache, SequenceState, TorchStorage, layer_compressors


@dataclass(frozen=True)
class StateFootprint:
    kv_elements_per_token: float  # compressed KV + indexer elements a token adds
    payload_bytes_per_token: float  # the same in ds4's f32 payload, plus the u32 token id
    payload_fixed_bytes: int  # header, counts, logits, full raw windows, frontiers
    compact_bytes_per_token: float  # the rows in a compact cache (`TorchStorage(compact=True)`)

    def kv_bytes_per_token(self, element_bytes: int) -> float:
        """Bytes per token when the rows are held at `element_bytes` each (2 for bf16, 4 for f32)."""
        return self.kv_elements_per_token * element_bytes

    def payload_bytes(self, n_tokens: int) -> int:
        """Payload size, exact when n_tokens fills the raw window and is a multiple of every ratio."""
        return self.payload_fixed_bytes + round(self.payload_bytes_per_token * n_tokens)


def state_footprint(args: ModelArgs) -> StateFootprint:
    elements = 0.0
    for layer in args.layers:
        r = layer.compress_ratio
        if r:
            elements += args.head_dim / r + (args.index_head_dim / r if layer.has_indexer else 0)
    compact = TorchStorage(compact=True)
    compact_bytes = sum(
        compact.row_nbytes(spec.dim, spec.exact_dims) / spec.ratio
        for specs in layer_compressors(args)
        for spec in specs.values()
    )
    per_token = 4 + 4 * elements
    # at a length that fills the window and closes every window, the payload is exactly fixed + T * per_token
    n = max(128, math.ceil(args.window / 128) * 128)
    return StateFootprint(
        kv_elements_per_token=elements,
        payload_bytes_per_token=per_token,
        payload_fixed_bytes=payload_nbytes(args, n) - round(per_token * n),
        compact_bytes_per_token=compact_bytes,
    )


def random_state(args: ModelArgs, n_tokens: int, seed: int = 0, block_slots: int = 1) -> SequenceState:
    """A state with the exact row counts of n_tokens and random contents (benches and cache tests),
    in a host float32 cache of its own (`block_slots` sequences to a block).

    No model runs, so a 100k-token Flash-shaped state takes a fraction of a second to build.
    """
    gen = torch.Generator().manual_seed(seed)
    state = KVCache(args, n_tokens + 1, TorchStorage(), block_slots).new_state()
    state.tokens = torch.randint(0, args.vocab_size, (n_tokens,), generator=gen).tolist()
    state.pos = n_tokens
    state.logits = torch.randn(args.vocab_size, generator=gen)
    for il, specs in enumerate(state.cache.compressors):
        state.store_window(il, torch.randn(min(n_tokens, args.window), args.head_dim, generator=gen), n_tokens)
        for kind, spec in specs.items():
            state.write(il, f"{kind}_rows", torch.randn(n_tokens // spec.ratio, spec.dim, generator=gen))
            state.write(il, f"{kind}_kv", torch.randn(spec.frontier_shape, generator=gen))
            state.write(il, f"{kind}_gate", torch.randn(spec.frontier_shape, generator=gen))
    return state
