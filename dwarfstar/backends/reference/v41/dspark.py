"""The torch reference's DSpark stages for V4.1 (`model.dspark_v41.DSparkOps41`): the reference's V4.1 steps
over the support file's stage layers, and the drafter's two own steps."""

from __future__ import annotations

import torch

from dwarfstar.backends.reference.v41 import mhc
from dwarfstar.backends.reference.v41.model import ReferenceOps41


class ReferenceDSparkOps41(ReferenceOps41):
    def block_keys(self, context: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.cat((context, block))
        n = block.shape[0]
        return rows.expand(n, -1, -1), torch.ones(n, rows.shape[0], dtype=torch.bool)

    def collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return mhc.collapse(h, pre)
