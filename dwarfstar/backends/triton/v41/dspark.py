"""The DSpark stages for V4.1 on the Triton kernels (`model.dspark_v41.DSparkOps41`): `TritonOps41`'s steps
over the stage layers' weights, uploaded from the support file's view beside the target's embedding and
output matrix (shared, not uploaded twice), and the drafter's two own steps in torch on the device."""

from __future__ import annotations

import torch

from dwarfstar.backends.reference.v41 import mhc
from dwarfstar.backends.triton.v41.ops import TritonOps41
from dwarfstar.backends.triton.v41.weights import upload41
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark_v41 import SHARED


class TritonDSparkOps41(TritonOps41):
    @classmethod
    def load(cls, target: TritonOps41, args: ModelArgs41, weights: GGUFFile) -> TritonDSparkOps41:
        """The stage layers of `args` (`dspark_v41.stage_args41`: those after the target's) from `weights`,
        a view of the support file, with the target's embedding and output matrix; their args name no
        Engram layer of theirs, so the target's Engram hash and store are handed on unread."""
        stages = range(target.args.n_layers, args.n_layers)
        shared = {name: target.w.matrices[name] for name in SHARED}
        return cls(upload41(weights, args, target.device, layers=stages, shared=shared), target.hash, target.store)

    def block_keys(self, context: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.cat((context, block))
        n = block.shape[0]
        return rows.expand(n, -1, -1), torch.ones(n, rows.shape[0], dtype=torch.bool, device=rows.device)

    def collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return mhc.collapse(h, pre)
