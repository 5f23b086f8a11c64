"""The DSpark stages for V4.1 in MLX (`model.dspark_v41.DSparkOps41`): `MLXOps41`'s steps over the stage
layers' weights, read from the support file's view in the target's packing beside the target's embedding
and output matrix (shared, not loaded twice), and the drafter's two own steps.

As the target's, each step only records MLX's lazy graph: the context rows a drafter keeps are
evaluated by the next block's `head`, which evaluates the rows written since the last one."""

from __future__ import annotations

import mlx.core as mx

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.mlx.v41.model import MLXOps41
from dwarfstar.backends.mlx.weights import Weights
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41


class MLXDSparkOps41(MLXOps41):
    @classmethod
    def load(cls, target: MLXOps41, args: ModelArgs41, weights: GGUFFile) -> MLXDSparkOps41:
        """The stage layers of `args` (`dspark_v41.stage_args41`: those after the target's) from `weights`,
        a view of the support file; their args name no Engram layer of theirs, so the target's Engram
        hash and store are handed on unread."""
        stages = range(target.args.n_layers, args.n_layers)
        view = Weights(weights, target.packing)
        return cls(args, view, target.hash, target.store, target.fused, layers=stages, shares=target)

    def block_keys(self, context: mx.array, block: mx.array) -> tuple[mx.array, mx.array]:
        rows = mx.concatenate((context, block))
        n, width = block.shape[0], rows.shape[0]
        return mx.broadcast_to(rows[None], (n, *rows.shape)), mx.ones((n, width), dtype=mx.bool_)

    def collapse(self, h: mx.array, pre: mx.array) -> mx.array:
        return ops.collapse(h, pre)
