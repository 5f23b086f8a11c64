"""MLX's view of streamed routed experts (`dwarfstar.experts`): per MoE call, one stack of the call's
distinct experts, so the gathered products index it exactly as they index a resident layer.

Each expert is packed once when it enters the store (the packing of the resident weights, so the
products are the same) and the packed copy lives as long as the expert stays cached. MLX arrays
cannot be written in place, so a call's stack is a concatenation of its experts: k experts per layer
in decode, the chunk's distinct experts in prefill (transient, ds4's prefill headroom).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx.model import ExpertStack
from dwarfstar.backends.mlx.weights import Matrix, concat_experts, pack_matrix
from dwarfstar.experts.source import ChunkLoader
from dwarfstar.experts.store import ExpertBytes, ExpertCache


class MLXStreamedExperts:
    def __init__(self, store: ExpertCache, packing: str) -> None:
        self.store, self.packing = store, packing
        self.packed: dict[int, tuple[Matrix, ...]] = {}
        self._last_layer = store.n_layers

    def _pack(self, expert: ExpertBytes) -> tuple[Matrix, ...]:
        key = self.store.key(expert.layer, expert.expert)
        if key not in self.packed:
            self.packed[key] = tuple(
                pack_matrix(data, part.ggml_type, (1, *part.shape), self.packing)
                for part, data in zip(expert.parts, expert.data, strict=True)
            )
        return self.packed[key]

    def experts(self, layer: int, ids: mx.array) -> tuple[ExpertStack, mx.array]:
        host = np.array(ids)
        if layer <= self._last_layer:  # back at the first layer: a new forward call
            self.store.begin_step(host.shape[0])
        self._last_layer = layer
        unique, slots = np.unique(host, return_inverse=True)
        loader = ChunkLoader(self.store, layer, unique.tolist(), self._pack)
        experts = [loader(i) for i in range(len(unique))]
        for key in [k for k in self.packed if k not in self.store.where]:  # evicted: its copy goes too
            del self.packed[key]
        stack = ExpertStack(*(concat_experts([e[i] for e in experts]) for i in range(3)))
        return stack, mx.array(slots.reshape(host.shape)).astype(ids.dtype)
