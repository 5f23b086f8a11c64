"""The `ExpertSource` the forward pass reads streamed experts from.

`experts(layer, ids)` returns a loader over the call's distinct experts (ascending) and the ids as
indices into them. Prefill: a chunk's tokens are grouped by expert (the MoE already runs one
product per distinct expert), so each expert is read at most once per chunk, even when the chunk
uses more experts than the cache holds: the loader keeps a window of at most `capacity` experts
in flight ahead of the MoE, and releases each one as soon as the backend has its own copy.
Decode: the window is the token's k experts, all read at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from dwarfstar.experts.store import ExpertBytes, ExpertCache

W = TypeVar("W")  # one expert as the backend computes with it
# materialize(the expert's file bytes) -> the backend's copy; the bytes are only valid during the call
Materialize = Callable[[ExpertBytes], W]


class ChunkLoader(Generic[W]):
    """One MoE call's experts, read ahead in a window; called with slot indices in ascending order."""

    def __init__(self, store: ExpertCache, layer: int, experts: list[int], materialize: Materialize) -> None:
        self.store, self.layer, self.order, self.materialize = store, layer, experts, materialize
        self.window = min(len(experts), store.capacity)
        self.requested = 0
        self._ahead(0)

    def _ahead(self, first: int) -> None:
        while self.requested < min(len(self.order), first + self.window):
            self.store.request(self.layer, self.order[self.requested])
            self.requested += 1

    def __call__(self, slot: int) -> W:
        if slot >= self.requested:
            raise RuntimeError(f"streamed experts must be read in ascending order (slot {slot} before its window)")
        e = self.order[slot]
        weights = self.materialize(self.store.get(self.layer, e))
        self.store.unpin(self.layer, e)
        self._ahead(slot + 1)
        return weights


class StreamingExperts(Generic[W]):
    """Routed experts from an `ExpertStore`, for a backend whose MoE takes an `id -> weights` getter."""

    def __init__(self, store: ExpertCache, materialize: Materialize) -> None:
        self.store, self.materialize = store, materialize
        self._last_layer = store.n_layers  # the first call opens a step

    def experts(self, layer: int, ids: torch.Tensor) -> tuple[ChunkLoader[W], torch.Tensor]:
        if layer <= self._last_layer:  # back at the first layer: a new forward call
            self.store.begin_step(int(ids.shape[0]))
        self._last_layer = layer
        unique, slots = torch.unique(ids, sorted=True, return_inverse=True)
        loader = ChunkLoader(self.store, layer, unique.tolist(), self.materialize)
        return loader, slots.view_as(ids)
