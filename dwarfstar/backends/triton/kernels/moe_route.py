"""MoE routing: sqrt-softplus scores, biased top-k or hash selection, renormalised scaled weights.

Spec §2.4. Per token: s = sqrt(softplus(router logits)); the experts are the top k of s + bias
(the bias steers selection only) or, in the hash-routed first layers, the token's fixed row of
tid2eid; the weights are the chosen un-biased scores divided by their sum, times route_scale.
The router logits come from the fused GEMV split over K (a 256 x 4096 product would occupy only a
few programs), as partial sums added here.

softplus(x) = log1p(exp(x)) is computed with a log1p that keeps full relative precision for very
negative logits (log(1 + u) * u / ((1 + u) - 1)), and is x above 20, as torch's. Top-k picks the
max k times; ties go to the lower expert id.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference.ops import route as reference_route
from dwarfstar.backends.triton.kernels.hc_pre import sum_partials
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting, next_pow2
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType

ROUTER_SPLIT = 4


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, tokens_ptr, ids_ptr, weights_ptr, T, E, route_scale,
    K: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr, HASH: tl.constexpr, BT: tl.constexpr,
    BE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    e = tl.arange(0, BE)
    ok = t_ok[:, None] & (e < E)[None, :]
    x = sum_partials(logits_ptr, t.to(tl.int64)[:, None] * E + e[None, :], ok, T * E, SPLIT)
    u = tl.exp(tl.minimum(x, 20.0))  # above 20 softplus(x) is x; keeps the unused branch finite
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    score = tl.sqrt(tl.where(x > 20.0, x, log1p))
    if HASH:
        token = tl.load(tokens_ptr + t, mask=t_ok, other=0).to(tl.int64)
    else:
        pick = tl.where(ok, score + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :], float("-inf"))
    slot = tl.arange(0, KP)
    ids = tl.zeros((BT, KP), tl.int32)
    chosen_scores = tl.zeros((BT, KP), tl.float32)
    for j in tl.static_range(K):
        if HASH:
            chosen = tl.load(tid2eid_ptr + token * K + j, mask=t_ok, other=0)
        else:
            chosen = tl.argmax(pick, axis=1)
            pick = tl.where(e[None, :] == chosen[:, None], float("-inf"), pick)
        s = tl.sum(tl.where(e[None, :] == chosen[:, None], score, 0.0), axis=1)
        ids = tl.where(slot[None, :] == j, chosen.to(tl.int32)[:, None], ids)
        chosen_scores = tl.where(slot[None, :] == j, s[:, None], chosen_scores)
    weights = chosen_scores / tl.sum(chosen_scores, axis=1)[:, None] * route_scale
    out = t[:, None] * K + slot[None, :]
    out_ok = t_ok[:, None] & (slot < K)[None, :]
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, weights, mask=out_ok)


def route(
    f: torch.Tensor,
    router: QWeight,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    tokens: torch.Tensor,
    k: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """f [T, D] -> (expert ids int32 [T, k], weights float32 [T, k]); tokens [T] on the device."""
    t = f.shape[0]
    n_experts = router.rows
    logits = qmatmul(f, router, split_k=ROUTER_SPLIT)
    ids = torch.empty(t, k, dtype=torch.int32, device=f.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=f.device)
    bt = min(64, next_pow2(t)) if interpreting() else 1
    hashed = tid2eid is not None
    _route_kernel[(triton.cdiv(t, bt),)](
        logits, bias if bias is not None else logits, tid2eid if hashed else ids, tokens, ids, weights,
        t, n_experts, route_scale,
        K=k, KP=next_pow2(k), SPLIT=logits.shape[0], HASH=hashed, BT=bt, BE=next_pow2(n_experts), num_warps=4,
    )  # fmt: skip
    return ids, weights


def reference(f, router: QWeight, bias, tid2eid, tokens, k, route_scale):
    fixed = tid2eid[tokens.long()].long() if tid2eid is not None else None
    return reference_route(f @ router.dequantize().T, k, route_scale, bias, fixed)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Routing one decode token: the router GEMV, then biased top-k."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    router = random_qweight(GGMLType.F16, (a.n_routed_experts, a.dim), dev, gen)
    f = torch.randn(1, a.dim, device=dev, generator=gen)
    bias = torch.zeros(a.n_routed_experts, device=dev)
    tokens = torch.zeros(1, dtype=torch.int32, device=dev)
    run = functools.partial(route, f, router, bias, None, tokens, a.n_activated_experts, a.route_scale)
    return [BenchCase("moe_route", f"decode: {a.n_routed_experts} experts, top {a.n_activated_experts}", run,
                      router.nbytes, 2 * router.rows * router.cols)]  # fmt: skip
