"""The sequence state of the MLX backend: MLX arrays behind `SequenceState`'s interface.

Design choice. The session layer (snapshots, restores, checkpoints), the DSV4 payload writer and the
KV cache all work on a torch `SequenceState` and read its layers' `raw_kv`, `frontier_kv`,
`frontier_gate` and `rows.rows` as torch tensors. Converting a whole torch state to MLX and back on
every call would copy every compressed row per decoded token (about 1.3 GB per token for Flash at
100k tokens), so the state is held in MLX instead and presented through the same interface:

* The container is the ordinary `SequenceState` (pos, tokens, torch logits, snapshot/restore/nbytes
  unchanged); its layers are `MLXLayerState`s whose compressors are `MLXCompressorState`s with
  `MLXRowBuffer`s. The model reads and writes their MLX arrays (`mx_raw_kv`, `mx_frontier_kv`,
  `mx_frontier_gate`, `mx_rows`) directly, so a forward pass converts nothing.
* The torch-named attributes are zero-copy torch views of those arrays (through the buffer
  protocol, which MLX supports on CPU and on Apple's unified memory), valid until the next forward
  on the state. Their setters copy torch data in, which is what `SequenceState.restore` does with
  the clones a snapshot kept. So snapshots, restores and payload writes work unchanged.
* A state built elsewhere from torch tensors (a payload read back from disk) is adopted in place on
  its first forward: each layer is replaced by an MLX one (`MLXLayerState.adopt`) when the forward
  first touches it, one copy, and the session keeps the same `SequenceState` object.

Frontier and raw-window arrays are never modified in place (the model builds new arrays), so a
view or a snapshot clone can never observe a later step. Row buffers grow by in-place slice
updates, which MLX performs without copying because the buffer has a single owner.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.model.config import ModelArgs
from dwarfstar.model.state import CompressorState, LayerState, RowBuffer, SequenceState


def torch_view(a: mx.array) -> torch.Tensor:
    """A torch tensor sharing the memory of `a` (evaluated first), with no copy."""
    with warnings.catch_warnings():  # MLX exports its buffers writable; silence torch's check anyway
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.array(a, copy=False))


def to_mx(value: mx.array | torch.Tensor) -> mx.array:
    """An MLX float32 array holding `value`; torch data is copied, MLX arrays pass through."""
    if isinstance(value, mx.array):
        return value
    return mx.array(value.detach().to("cpu", torch.float32).numpy())


class MLXRowBuffer(RowBuffer):
    """`RowBuffer` over an MLX array; the snapshot marks and rewind checks are RowBuffer's own."""

    def __init__(self, dim: int, capacity: int = 16) -> None:
        self.data = mx.zeros((capacity, dim), dtype=mx.float32)
        self.n = 0
        self.rewinds: list[int] = []

    @classmethod
    def adopt(cls, rows: RowBuffer) -> MLXRowBuffer:
        """An MLX copy of a torch row buffer, keeping its rewind history so existing marks stay valid."""
        buffer = cls(rows.data.shape[1], max(16, rows.n))
        buffer.append(rows.rows)
        buffer.rewinds = list(rows.rewinds)
        return buffer

    @property
    def mx_rows(self) -> mx.array:
        return self.data[: self.n]

    @property
    def rows(self) -> torch.Tensor:
        return torch_view(self.mx_rows)

    def append(self, rows: mx.array | torch.Tensor) -> None:
        rows = to_mx(rows)
        need = self.n + rows.shape[0]
        capacity, dim = self.data.shape
        if need > capacity:
            grown = mx.zeros((max(need, 2 * capacity), dim), dtype=mx.float32)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : need] = rows
        self.n = need

    def nbytes(self) -> int:
        return self.n * self.data.shape[1] * self.data.itemsize


class MLXCompressorState(CompressorState):
    """`CompressorState` whose frontiers live in `mx_frontier_kv` / `mx_frontier_gate`."""

    mx_frontier_kv: mx.array
    mx_frontier_gate: mx.array

    @classmethod
    def empty(cls, ratio: int, dim: int) -> MLXCompressorState:
        coff = 2 if ratio == 4 else 1
        shape = (coff * ratio, coff * dim)
        return cls(ratio, dim, mx.zeros(shape), mx.full(shape, -mx.inf), MLXRowBuffer(dim))

    @classmethod
    def adopt(cls, comp: CompressorState) -> MLXCompressorState:
        return cls(comp.ratio, comp.dim, comp.frontier_kv, comp.frontier_gate, MLXRowBuffer.adopt(comp.rows))

    @property
    def frontier_kv(self) -> torch.Tensor:
        return torch_view(self.mx_frontier_kv)

    @frontier_kv.setter
    def frontier_kv(self, value: mx.array | torch.Tensor) -> None:
        self.mx_frontier_kv = to_mx(value)

    @property
    def frontier_gate(self) -> torch.Tensor:
        return torch_view(self.mx_frontier_gate)

    @frontier_gate.setter
    def frontier_gate(self, value: mx.array | torch.Tensor) -> None:
        self.mx_frontier_gate = to_mx(value)


class MLXLayerState(LayerState):
    """`LayerState` whose raw window lives in `mx_raw_kv`."""

    mx_raw_kv: mx.array

    @classmethod
    def adopt(cls, layer: LayerState) -> MLXLayerState:
        if isinstance(layer, MLXLayerState):
            return layer
        comps = [None if c is None else MLXCompressorState.adopt(c) for c in (layer.compressor, layer.indexer)]
        return cls(layer.raw_kv, *comps)

    @property
    def raw_kv(self) -> torch.Tensor:
        return torch_view(self.mx_raw_kv)

    @raw_kv.setter
    def raw_kv(self, value: mx.array | torch.Tensor) -> None:
        self.mx_raw_kv = to_mx(value)


def new_state(args: ModelArgs) -> SequenceState:
    """An empty sequence whose layers hold MLX arrays."""
    layers = []
    for layer in args.layers:
        r = layer.compress_ratio
        layers.append(
            MLXLayerState(
                raw_kv=mx.zeros((0, args.head_dim)),
                compressor=MLXCompressorState.empty(r, args.head_dim) if r else None,
                indexer=MLXCompressorState.empty(r, args.index_head_dim) if layer.has_indexer else None,
            )
        )
    return SequenceState(layers=layers)


def lazy_arrays(state: SequenceState) -> list[mx.array]:
    """The arrays a forward pass left lazy in `state`, to evaluate together with its outputs."""
    arrays = []
    for layer in state.layers:
        arrays.append(layer.mx_raw_kv)
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                arrays += [comp.mx_frontier_kv, comp.mx_frontier_gate, comp.rows.data]
    return arrays
