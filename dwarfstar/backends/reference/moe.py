"""DeepSeek V4 mixture of experts in torch: sqrt-softplus routing, hash routing, shared expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dwarfstar.backends.reference import ops
from dwarfstar.model.config import LayerSpec, ModelArgs

WeightGetter = Callable[[str], torch.Tensor]
ExpertGetter = Callable[[str, int], torch.Tensor]
# (layer index, expert tensor name, expert id, the rows that expert matrix multiplies): imatrix collection
ExpertObserver = Callable[[int, str, int, torch.Tensor], None]
# observer(layer index, chosen expert ids [T, k]): lets training balance the experts' load by moving
# the router bias (tools/train_nano.py).
RouteObserver = Callable[[int, torch.Tensor], None]


def route(
    scores_logits: torch.Tensor, k: int, route_scale: float, bias: torch.Tensor | None, fixed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts and their weights: (ids [T, k], weights [T, k]).

    Scores are sqrt(softplus(logit)). The bias only steers selection; hash layers take the ids from
    the token table instead. Weights are the un-biased scores of the chosen experts, renormalised
    and multiplied by the routed scale.
    """
    scores = F.softplus(scores_logits).sqrt()
    ids = fixed if fixed is not None else (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * route_scale


class MoE:
    def __init__(self, args: ModelArgs, layer: LayerSpec, w: WeightGetter, expert: ExpertGetter) -> None:
        self.args, self.layer, self.expert = args, layer, expert
        self.router = w("ffn_gate_inp.weight")
        self.bias = None if layer.hash_routed else w("exp_probs_b.bias")
        self.tid2eid = w("ffn_gate_tid2eid.weight").long() if layer.hash_routed else None
        self.shared = (w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight"))
        self.observer: RouteObserver | None = None
        self.expert_observer: ExpertObserver | None = None

    def __call__(self, f: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        args = self.args
        fixed = self.tid2eid[tokens] if self.tid2eid is not None else None
        ids, weights = route(f @ self.router.T, args.n_activated_experts, args.route_scale, self.bias, fixed)
        if self.observer is not None:
            self.observer(self.layer.index, ids)
        out = torch.zeros_like(f)
        for e in ids.unique().tolist():
            rows, slots = (ids == e).nonzero(as_tuple=True)
            gate, up, down = (self.expert(f"ffn_{k}_exps.weight", e) for k in ("gate", "up", "down"))
            x = f[rows]
            # the router weight scales the SwiGLU output before the down projection, as ds4 does
            hidden = ops.swiglu_clamped(x @ gate.T, x @ up.T, args.swiglu_limit) * weights[rows, slots, None]
            if self.expert_observer is not None:
                for name, inputs in (
                    ("ffn_gate_exps.weight", x),
                    ("ffn_up_exps.weight", x),
                    ("ffn_down_exps.weight", hidden),
                ):
                    self.expert_observer(self.layer.index, name, e, inputs)
            out.index_add_(0, rows, hidden @ down.T)
        gate, up, down = self.shared
        return out + ops.swiglu_clamped(f @ gate.T, f @ up.T, args.swiglu_limit) @ down.T
