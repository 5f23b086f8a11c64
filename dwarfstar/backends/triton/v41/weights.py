"""A V4.1 file's weights on the device (`tensors_v41`'s table), as the V4 upload keeps them
(`triton.weights`): matrices as `QWeight` blocks in the aligned layout, decoded only inside kernels;
the F32-only tensors (norms, sinks, biases, mHC scales and bases, the Engram gate norms) as float32.
The Engram tables stay in the file (an `EngramStore` reads their rows). Tensor by tensor, each one's
mapped pages released after its copy, as `weights.upload` does.

Without some layers' routed experts (`routed_layers`) those stay in the file: streamed through a cache
(`--ssd-streaming`, every layer) or computed by the CPU kernels (`--cpu-moe`, the first layers).

Two tensors are combined at upload: a ratio-2 compressor's kv and gate projections, concatenated
row-wise (one product; the pooling kernel reads the two as column slices of it, `compressor`), and
an Engram layer's q and k gate norms, multiplied (the gate reads only their product).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model import tensors_v41 as tt41
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.tensors import TensorSpec

COMPRESSOR_KV_GATE = "attn_compressor_kv_gate.weight"  # the combined name (not a file tensor)
ENGRAM_GATE = "engram_gate.weight"  # q_weight * k_weight


@dataclass
class Weights41:
    args: ModelArgs41
    matrices: dict[str, QWeight]  # by full tensor name
    vectors: dict[str, torch.Tensor]
    device: torch.device

    def routed(self) -> dict[int, tuple[QWeight, ...]]:
        """The routed experts (gate, up, down) of each layer whose experts were uploaded."""
        layers = {il: [tt.layer_tensor(il, name) for name in tt.EXPERTS] for il in range(self.args.n_layers)}
        return {il: tuple(self.matrices[n] for n in names) for il, names in layers.items() if names[0] in self.matrices}

    def matrix(self, il: int | None, name: str) -> QWeight:
        return self.matrices[name if il is None else tt.layer_tensor(il, name)]

    def vector(self, il: int | None, name: str) -> torch.Tensor:
        return self.vectors[name if il is None else tt.layer_tensor(il, name)]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.matrices.values()) + sum(v.nbytes for v in self.vectors.values())


def build_weights41(
    args: ModelArgs41,
    matrix: Callable[[TensorSpec], QWeight],
    vector: Callable[[TensorSpec], torch.Tensor],
    device: torch.device,
    routed_layers: Collection[int] | None = None,
    layers: range | None = None,
    stage: bool = False,
) -> Weights41:
    """Every tensor but the Engram tables from per-tensor sources (a file, or the meta device's shapes),
    in the file's order, with the two combinations made. `layers`: the layers built (None: all of them),
    beside the model's own tensors (the embedding, the output norm and matrix), or with `stage` those a
    pipeline stage holding them reads (`tensors.stage_needs`: the embedding only where they start at 0,
    the head only where they end last); of them, the routed experts of `routed_layers` only (default:
    every layer's)."""
    held = range(args.n_layers) if layers is None else layers
    routed = range(args.n_layers) if routed_layers is None else routed_layers
    left = {tt.layer_tensor(il, name) for il in range(args.n_layers) if il not in routed for name in tt.EXPERTS}
    matrices: dict[str, QWeight] = {}
    vectors: dict[str, torch.Tensor] = {}
    for spec in tt41.expected_tensors41(args):
        part = spec.name.split(".")
        if spec.types == tt41.ENGRAM_ROWS or spec.name in left or (part[0] == "blk" and int(part[1]) not in held):
            continue
        if stage and not tt.stage_needs(spec.name, args.n_layers, held):
            continue
        if spec.types == tt.NORM:
            vectors[spec.name] = vector(spec)
        else:
            matrices[spec.name] = matrix(spec)
    for layer in args.layers:
        il = layer.index
        if il not in held:
            continue
        if layer.has_gate:
            parts = [matrices.pop(tt.layer_tensor(il, role)) for role in (tt41.COMPRESSOR_KV, tt41.COMPRESSOR_GATE)]
            matrices[tt.layer_tensor(il, COMPRESSOR_KV_GATE)] = QWeight.concat(parts)
        if layer.engram:
            q, k = (vectors.pop(tt.layer_tensor(il, role)) for role in (tt41.ENGRAM_Q_NORM, tt41.ENGRAM_K_NORM))
            vectors[tt.layer_tensor(il, ENGRAM_GATE)] = q * k
    return Weights41(args, matrices, vectors, torch.device(device))


def upload41(
    gguf: GGUFFile,
    args: ModelArgs41,
    device: torch.device,
    routed_layers: Collection[int] | None = None,
    layers: range | None = None,
    shared: Mapping[str, QWeight] | None = None,
    stage: bool = False,
) -> Weights41:
    """Every tensor of a V4.1 file but the Engram tables on `device`, once: of `layers` (None: every
    layer) and the model's own (with `stage`, those a stage holding `layers` reads: `build_weights41`),
    the routed experts of `routed_layers` only (default: every layer's); `shared`: matrices already on
    the device, by name, taken as they are."""

    def matrix(spec: TensorSpec) -> QWeight:
        if shared and spec.name in shared:
            return shared[spec.name]
        info = gguf.tensors[spec.name]
        weight = QWeight.from_bytes(gguf.raw(spec.name), info.ggml_type, info.shape, device)
        gguf.release(spec.name)
        return weight

    def vector(spec: TensorSpec) -> torch.Tensor:
        values = gguf.tensor(spec.name).to(device)
        gguf.release(spec.name)
        return values

    return build_weights41(args, matrix, vector, device, routed_layers, layers, stage)
