"""Weights of a GGUF model as float32 torch tensors, dequantized from the memory map on demand."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dwarfstar.backends.reference import ops
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


class Products:
    """How the reference holds its product weights and multiplies with them: float32 tensors from the
    source, through `ops.linear`. The CPU backend passes its kernels' instead
    (`dwarfstar.backends.cpu.products.KernelProducts`): the weights in their file blocks, the inputs
    quantized once per product input (`input`) for every weight they meet."""

    def matrix(self, weights: WeightSource, name: str) -> Any:
        """The weight matrix `name`, as `linear` takes it."""
        return weights.dense(name)

    def table(self, weights: WeightSource, name: str) -> Any:
        """A table read by rows (the embedding): `table[ids]` is float32 [len(ids), dim]."""
        return weights.dense(name)

    def expert(self, weights: WeightSource, name: str, e: int) -> Any:
        """Expert e's matrix of the routed-expert tensor `name`."""
        return weights.expert(name, e)

    def input(self, x: torch.Tensor) -> Any:
        """x as the products of one input take it (once for several weights)."""
        return x

    def linear(self, x: Any, w: Any) -> torch.Tensor:
        """x @ w.T for an `input` (or a tensor) and a `matrix` or `expert`."""
        return ops.linear(x, w)


FLOAT32 = Products()
