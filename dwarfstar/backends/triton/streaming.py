"""The Triton backend's view of streamed routed experts (`dwarfstar.experts`).

The cache lives in device memory: a pool of `capacity` expert slots per part (gate, up, down), in
the aligned layout the kernels read (`weights.repack`), numbered as the store numbers its slots. An
expert is uploaded once when it enters the store; after that the store's host copy is handed back
to the OS (`ExpertStore.release_bytes`), so the budget is held once, on the device, not twice
(which matters where the GPU shares the RAM: GB10, Strix Halo).

A MoE call gets a stack of its distinct experts (as the resident stack, indexed by the slot ids
`StreamingExperts` gives), gathered from the pool. When the call's experts all fit in the cache
they are pinned together and one gather per part builds the stack; a prefill chunk that uses more
experts than the cache holds loads them in a window, so each is copied out before its slot is
reused by a later one of the same call.

A miss reads from the file on the host, so a decode step cannot be captured in a CUDA graph: the
backend is built without graphs when streaming (`backends.triton.load_backend`).
"""

from __future__ import annotations

import torch

from dwarfstar.backends.triton.weights import QWeight, aligned_row_bytes
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.source import StreamingExperts
from dwarfstar.experts.store import ExpertBytes, ExpertStore


class TritonStreamedExperts:
    def __init__(self, store: ExpertStore, device: torch.device) -> None:
        layout = store.layout
        self.parts = layout.parts[0]
        for il in range(1, layout.n_layers):
            if [(p.ggml_type, p.shape) for p in layout.parts[il]] != [(p.ggml_type, p.shape) for p in self.parts]:
                # one pool slot holds any layer's expert only when they all have one shape and type
                raise DwarfStarError(f"layer {il}'s routed experts differ in type or shape from layer 0's")
        self.store, self.device = store, device
        self.pool = [
            torch.empty(store.capacity, p.shape[0], aligned_row_bytes(p.ggml_type, p.shape[1]), dtype=torch.uint8,
                        device=device)
            for p in self.parts
        ]  # fmt: skip
        self.holds = [-1] * store.capacity  # the key whose expert each pool slot holds
        self.source = StreamingExperts(store, self._upload)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.pool)

    def _upload(self, expert: ExpertBytes) -> int:
        """The pool slot holding the expert, uploaded and repacked there unless the slot still holds
        it (an expert evicted and read back into the same slot, with no other upload in between)."""
        key = self.store.key(expert.layer, expert.expert)
        slot = self.store.where[key]
        uploaded = self.holds[slot] != key
        if uploaded:
            for pool, part, data in zip(self.pool, expert.parts, expert.data, strict=True):
                pool[slot].copy_(QWeight.from_bytes(data, part.ggml_type, part.shape, self.device).data)
            self.holds[slot] = key
        if uploaded or expert.fresh:  # the host bytes are never read again
            self.store.release_bytes(expert.layer, expert.expert)
        return slot

    def experts(self, layer: int, ids: torch.Tensor) -> tuple[tuple[QWeight, ...], torch.Tensor]:
        loader, slots = self.source.experts(layer, ids)
        n = len(loader.order)
        stacks = [torch.empty(n, *pool.shape[1:], dtype=torch.uint8, device=self.device) for pool in self.pool]
        if n <= self.store.capacity:  # all pinned at once: their pool slots stay put for the whole call
            index = torch.tensor([loader(i) for i in range(n)], device=self.device)
            for stack, pool in zip(stacks, self.pool, strict=True):
                torch.index_select(pool, 0, index, out=stack)
        else:
            for i in range(n):
                slot = loader(i)
                for stack, pool in zip(stacks, self.pool, strict=True):
                    stack[i].copy_(pool[slot])
        weights = tuple(
            QWeight(stack.view(n * part.shape[0], -1), part.ggml_type, n * part.shape[0], part.shape[1], experts=n)
            for stack, part in zip(stacks, self.parts, strict=True)
        )
        return weights, slots.to(device=ids.device, dtype=ids.dtype)
