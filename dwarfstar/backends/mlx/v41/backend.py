"""A V4.1 model on MLX as the session layer drives it: `model_v41.Model41`'s calls (input checks, one
sequence after another, `all_logits` one token per call) over `MLXOps41`, each sequence's arrays in an
`MLXState41`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.backends.mlx import default_packing, metal_available, ops
from dwarfstar.backends.mlx.v41.dspark import MLXDSparkOps41
from dwarfstar.backends.mlx.v41.model import MLXOps41
from dwarfstar.backends.mlx.weights import Weights
from dwarfstar.engram.store import EngramStore
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.model_v41 import Model41


@dataclass
class MLXState41:
    """A V4.1 sequence between calls (`forward_v41.State41` over MLX arrays), with the session's
    `logits`, `snapshot` and `restore`. MLX arrays are never written in place (each call makes new
    ones), so a snapshot shares them: it copies only the dicts and the token list."""

    window: int
    tokens: list[int] = field(default_factory=list)
    windows: dict[int, mx.array] = field(default_factory=dict)  # layer -> [<= window - 1, head_dim]
    rows: dict[int, mx.array] = field(default_factory=dict)  # kv source -> compressed rows [G, head_dim]
    index_keys: dict[int, mx.array] = field(default_factory=dict)  # kv source -> [G, index_head_dim]
    frontiers: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)  # ratio-2 source
    logits: torch.Tensor | None = None  # [vocab]: the next token's after the last call; None before one

    @classmethod
    def empty(cls, args: ModelArgs41) -> MLXState41:
        return cls(
            args.window,
            windows={il: mx.zeros((0, args.head_dim)) for il in range(args.n_layers)},
            rows={il: mx.zeros((0, args.head_dim)) for il in args.kv_source_layers},
            index_keys={il: mx.zeros((0, args.index_head_dim)) for il in args.kv_source_layers},
        )

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> MLXState41:
        return MLXState41(
            self.window, list(self.tokens), dict(self.windows), dict(self.rows), dict(self.index_keys),
            dict(self.frontiers), None if self.logits is None else self.logits.clone(),
        )  # fmt: skip

    def can_restore(self, snap: MLXState41) -> bool:
        return snap.window == self.window

    def restore(self, snap: MLXState41) -> None:
        if not self.can_restore(snap):
            raise ValueError(f"a snapshot of window {snap.window} cannot restore a state of window {self.window}")
        copy = snap.snapshot()
        self.tokens, self.windows, self.rows = copy.tokens, copy.windows, copy.rows
        self.index_keys, self.frontiers, self.logits = copy.index_keys, copy.frontiers, copy.logits

    def array(self, values: np.ndarray) -> mx.array:
        """Host float32 values as one of its rows arrays (a payload's rows coming in)."""
        return mx.array(values)

    def host(self, rows: mx.array) -> np.ndarray:
        """One of its rows arrays as host float32 values (going out to a payload)."""
        return np.array(rows.astype(mx.float32))

    def nbytes(self) -> int:
        arrays = [*self.windows.values(), *self.rows.values(), *self.index_keys.values()]
        arrays += [a for pair in self.frontiers.values() for a in pair]
        return sum(int(a.nbytes) for a in arrays) + (0 if self.logits is None else int(self.logits.nbytes))


class MLXModel41(Model41):
    """The V4.1 forward over `MLXOps41`; the calls are `Model41`'s, the states `MLXState41`."""

    @property
    def packing(self) -> str:
        """The weights' (`weights.PACKINGS`), which streamed experts are packed in too."""
        return self.transformer.ops.packing

    @classmethod
    def from_file(
        cls,
        model: ModelFile41,
        engram_cache_bytes: int,
        max_seq_len: int | None = None,
        packing: str | None = None,
        fuse: bool | None = None,
        routed_experts: bool = True,
        cpu_moe: range = range(0),
        threads: int | None = None,
    ) -> MLXModel41:
        """The model over `model`'s weights in `packing` (default: `default_packing()`), its Engram rows
        read through a cache of `engram_cache_bytes`. `fuse` compiles the op-heavy primitives
        (`ops.Fused`); by default only where Metal runs them. Without `routed_experts` the routed
        experts are not packed: they stream (`--ssd-streaming`). The routed experts of the `cpu_moe`
        layers stay in the file, computed by the CPU kernels on `threads` threads (`--cpu-moe`)."""
        packing = packing or default_packing()
        weights = Weights(model.gguf, packing)
        fused = ops.Fused(model.args, metal_available() if fuse is None else fuse)
        store = EngramStore(model.engram, engram_cache_bytes)
        host = None
        if cpu_moe:
            from dwarfstar.backends.cpu.experts import HostExperts

            host = HostExperts(model.gguf, model.args, cpu_moe, threads)
        operations = MLXOps41(
            model.args, weights, model.engram_hash, store, fused, routed_experts, host, model.layers, stage=True
        )  # a stage's model (`model.layers`) loads what its slice reads
        return cls(operations, max_seq_len)

    def new_state(self) -> MLXState41:
        return MLXState41.empty(self.args)

    def dspark_ops(self, args: ModelArgs41, weights: GGUFFile) -> MLXDSparkOps41:
        """The stages in this model's packing, sharing its embedding and output matrix."""
        return MLXDSparkOps41.load(self.transformer.ops, args, weights)  # type: ignore[arg-type]
