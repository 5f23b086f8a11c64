"""Training-time observers of the reference model (tools/train_nano.py): the indexer's KL loss and
the routers' load balancing, each fed by a hook of `ReferenceOps` during the forward pass."""

from __future__ import annotations

import torch

from dwarfstar.model.config import ModelArgs


class IndexerLoss:
    """Collects the KL(attention mass || indexer distribution) of every indexer layer in one forward."""

    def __init__(self) -> None:
        self.terms: list[torch.Tensor] = []

    def __call__(self, layer: int, probs: torch.Tensor, scores: torch.Tensor) -> None:
        target = probs.detach().sum(1)  # [T, N]: mass of all heads on each compressed row
        attended = target > 0  # visible and selected
        mass = target.sum(-1, keepdim=True)
        live = attended.any(-1)
        if not live.any():
            return
        p, attended = (target / mass.clamp_min(1e-30))[live], attended[live]
        log_q = scores[live].masked_fill(~attended, float("-inf")).log_softmax(-1).masked_fill(~attended, 0.0)
        log_p = p.clamp_min(1e-30).log()
        self.terms.append(torch.where(attended, p * (log_p - log_q), 0.0).sum(-1).mean())

    def pop(self) -> torch.Tensor:
        loss = torch.stack(self.terms).mean() if self.terms else torch.zeros(())
        self.terms = []
        return loss


class RouterBalance:
    """DeepSeek's auxiliary-loss-free balancing: after each step, bias += gamma * sign(mean load - load)."""

    def __init__(self, params: dict[str, torch.Tensor], args: ModelArgs, gamma: float) -> None:
        self.params, self.gamma, self.n = params, gamma, args.n_routed_experts
        self.learned = {layer.index for layer in args.layers if not layer.hash_routed}  # those with a bias
        self.load: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, ids: torch.Tensor) -> None:
        if layer not in self.learned:
            return
        counts = torch.bincount(ids.flatten(), minlength=self.n).float()
        self.load[layer] = self.load.get(layer, torch.zeros(self.n)) + counts

    def update(self) -> float:
        """Apply the step; returns the worst max/mean load ratio over the layers (1 is perfect balance)."""
        worst = 1.0
        with torch.no_grad():
            for layer, load in self.load.items():
                self.params[f"blk.{layer}.exp_probs_b.bias"] += self.gamma * torch.sign(load.mean() - load)
                worst = max(worst, float(load.max() / load.mean()))
        self.load = {}
        return worst
