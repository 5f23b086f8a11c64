"""Routed experts kept in host memory and computed on the CPU kernels beside a GPU backend (`--cpu-moe N`).

The routed experts of the first N layers (or all) stay in the file, memory-mapped, as the cpu backend
reads them; everything else is on the device. A layer's MoE sends its input rows, expert ids and
router weights to the host once and its routed sum back once: [T, dim] float32 each way, plus the
[T, k] ids and weights. The backend launches the shared expert first, so the device computes it
while the host computes the routed ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dwarfstar.backends.cpu.matrix import KERNEL_TYPES
from dwarfstar.backends.cpu.products import KernelProducts
from dwarfstar.backends.reference import ops
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import ModelArgs


class HostExperts:
    """The routed experts of `layers`, computed on the host's CPU kernels."""

    def __init__(self, gguf: GGUFFile, args: ModelArgs, layers: range, threads: int | None) -> None:
        self.args, self.layers = args, layers
        self.products = KernelProducts(gguf, threads)
        self.names = {il: [tt.layer_tensor(il, name) for name in tt.EXPERTS] for il in layers}
        for name in (n for names in self.names.values() for n in names):
            if gguf.tensors[name].ggml_type not in KERNEL_TYPES:
                raise DwarfStarError(f"--cpu-moe: the CPU kernels have no {gguf.tensors[name].ggml_type.name} ({name})")
        self.crossed = 0  # bytes sent to the host and back, over every call (rows, ids and weights)

    def __contains__(self, il: int) -> bool:
        return il in self.layers

    def send(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Sent:
        """Start copying a layer's MoE inputs to the host (asynchronous from a GPU: launch the shared
        expert after this and the device computes it while the host computes the routed experts)."""
        parts = [x.detach().float(), weights.detach().float(), ids.detach().long()]
        if x.device.type != "cuda":
            return Sent(*(p.cpu() for p in parts), None, x.device, x.dtype)
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
        for h, p in zip(host, parts, strict=True):
            h.copy_(p, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return Sent(*host, copied, x.device, x.dtype)

    def receive(self, il: int, sent: Sent) -> torch.Tensor:
        """The routed sum of layer il for the sent rows [T, dim], on their device."""
        if sent.copied is not None:
            sent.copied.synchronize()
        names = self.names[il]
        out = ops.routed_ffn(
            sent.x,
            sent.ids,
            sent.ids,
            sent.weights,
            lambda e: tuple(self.products.file_expert(name, e) for name in names),
            self.products,
            self.args.swiglu_limit,
        )
        self.crossed += 2 * out.numel() * 4 + sent.ids.numel() * (8 + 4)
        return out.to(sent.device, sent.dtype)


@dataclass(frozen=True)
class Sent:
    """A layer's MoE inputs on their way to the host: rows [T, dim], router weights and ids [T, k]."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    copied: torch.cuda.Event | None  # recorded after the copies (None: already on the host)
    device: torch.device
    dtype: torch.dtype
