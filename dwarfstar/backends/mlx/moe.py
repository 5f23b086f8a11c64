"""DeepSeek V4 mixture of experts in MLX: sqrt-softplus routing, hash routing, shared expert.

Port of `dwarfstar.backends.reference.moe`. The routed experts run as gathered products over the
stacked expert weights (one launch per projection for all tokens), not a loop over experts.
"""

from __future__ import annotations

import mlx.core as mx

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.mlx.weights import LayerWeights
from dwarfstar.model.config import LayerSpec, ModelArgs


def route(
    logits: mx.array, k: int, route_scale: float, bias: mx.array | None, fixed: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Pick experts and their weights: (ids [T, k], weights [T, k]).

    Scores are sqrt(softplus(logit)). The bias only steers selection; hash layers take the ids from
    the token table instead. Weights are the un-biased scores of the chosen experts, renormalised
    and multiplied by the routed scale.
    """
    scores = mx.sqrt(mx.logaddexp(logits, 0.0))
    ids = fixed if fixed is not None else mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[:, :k]
    weights = mx.take_along_axis(scores, ids, axis=1)
    return ids, weights / weights.sum(-1, keepdims=True) * route_scale


class MoE:
    def __init__(self, args: ModelArgs, layer: LayerSpec, w: LayerWeights, fused: ops.Fused) -> None:
        self.args, self.swiglu = args, fused.swiglu
        self.router = w.matrix("ffn_gate_inp.weight")
        self.bias = None if layer.hash_routed else w.dense("exp_probs_b.bias")
        self.tid2eid = w.dense("ffn_gate_tid2eid.weight") if layer.hash_routed else None
        self.gate, self.up, self.down = (w.experts(f"ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
        self.shared = tuple(w.matrix(f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down"))

    def __call__(self, f: mx.array, tokens: mx.array) -> mx.array:
        args = self.args
        fixed = self.tid2eid[tokens] if self.tid2eid is not None else None
        ids, weights = route(self.router.matmul(f), args.n_activated_experts, args.route_scale, self.bias, fixed)
        x = f[:, None, None, :]
        # the router weight scales the SwiGLU output before the down projection, as ds4 does
        hidden = self.swiglu(self.gate.gather(x, ids), self.up.gather(x, ids))
        routed = self.down.gather(hidden * weights[..., None, None], ids).sum(axis=(1, 2))
        gate, up, down = self.shared
        return routed + down.matmul(self.swiglu(gate.matmul(f), up.matmul(f)))
