"""Weights of a GGUF model as float32 torch tensors, dequantized from the memory map on demand."""

from __future__ import annotations

from typing import Protocol

import torch

from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.reader import GGUFFile

# Routed experts below this many float32 bytes are expanded once; larger sets (Flash-shaped files:
# 25 GB per layer) are dequantized expert by expert as the router picks them.
EXPERT_CACHE_BYTES = 1 << 30


class WeightSource(Protocol):
    """Where the model's float32 tensors come from: a GGUF file, or trainable parameters."""

    def dense(self, name: str) -> torch.Tensor: ...

    def expert(self, name: str, e: int) -> torch.Tensor: ...


class GGUFWeights:
    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self._experts: dict[str, torch.Tensor] = {}

    def dense(self, name: str) -> torch.Tensor:
        return self.gguf.tensor(name)

    def expert(self, name: str, e: int) -> torch.Tensor:
        """Expert e of a [n_expert, out, in] tensor; each expert is a contiguous slab of the file."""
        cached = self._experts.get(name)
        if cached is not None:
            return cached[e]
        info = self.gguf.tensors[name]
        n_expert, out_dim, in_dim = info.shape
        if info.n_elements * 4 <= EXPERT_CACHE_BYTES:
            self._experts[name] = self.gguf.tensor(name)
            return self._experts[name][e]
        slab = info.nbytes // n_expert
        raw = self.gguf.raw(name)[e * slab : (e + 1) * slab]
        return dequantize(raw, info.ggml_type, out_dim * in_dim).view(out_dim, in_dim)
