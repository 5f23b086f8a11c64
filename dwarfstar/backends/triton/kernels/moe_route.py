"""MoE routing: sqrt-softplus scores, biased top-k or hash selection, renormalised scaled weights.

Spec §2.4. Per token: s = sqrt(softplus(router logits)); the experts are the top k of s + bias
(the bias steers selection only) or, in the hash-routed first layers, the token's fixed row of
tid2eid; the weights are the chosen un-biased scores divided by their sum, times route_scale.
In a decode step (`fused`) routing is one launch: each program multiplies
a [RB, BK] tile of the router by its columns of the tokens of its block and stores the partial
logits; the block's last program (`runtime.last_program`) adds them in a fixed order and routes.
Given `q8` rows, the programs of the first router tile also quantize their columns of the input to
int8 (`expert_int8.store_q8`): the routed experts' fast 2-bit form reads them, with no launch of its own.
Prefill chunks take the logits from the GEMV split over K (a 256 x 4096 product would occupy only a
few programs), as partial sums added by one program per token.

softplus(x) = log1p(exp(x)) is computed with a log1p that keeps full relative precision for very
negative logits (log(1 + u) * u / ((1 + u) - 1)), and is x above 20, as torch's. Top-k picks the
max k times; ties go to the lower expert id.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.expert_int8 import Q8Rows, store_q8
from dwarfstar.backends.triton.kernels.hc_pre import sum_partials
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.kernels.quant_blocks import compiles_ptx, load_weight_tile
from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    KernelWork,
    dependent_launch,
    interpreting,
    last_program,
    next_pow2,
    program_sums,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.model.numerics import route as reference_route

ROUTER_SPLIT = 4
ROUTER_TILE = (16, 256)  # rows, columns of the router per program of the one-launch form: 256 programs for Flash


@triton.jit
def route_table(bias_ptr, tid2eid_ptr, tokens_ptr, t, t_ok, E, K: tl.constexpr, KP: tl.constexpr,
                HASH: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    """What `choose` reads besides the logits, loaded apart so that a caller sends it out with the
    logits' loads: HASH, the K experts of tokens t [BT] from their rows of the table [BT, KP]; else the
    router bias [BE]."""
    if HASH:
        slot = tl.arange(0, KP)
        token = tl.load(tokens_ptr + t, mask=t_ok, other=0).to(tl.int64)
        return tl.load(tid2eid_ptr + token[:, None] * K + slot[None, :], mask=t_ok[:, None] & (slot < K)[None, :],
                       other=0)  # fmt: skip
    else:
        e = tl.arange(0, BE)
        return tl.load(bias_ptr + e, mask=e < E, other=0.0)


@triton.jit
def choose(
    x, t, t_ok, table, ids_ptr, weights_ptr, E, route_scale,
    K: tl.constexpr, KP: tl.constexpr, HASH: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Route tokens t [BT] from their router logits x [BT, BE] and their `route_table`: store their
    expert ids and weights."""
    e = tl.arange(0, BE)
    ok = t_ok[:, None] & (e < E)[None, :]
    u = tl.exp(tl.minimum(x, 20.0))  # above 20 softplus(x) is x; keeps the unused branch finite
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.div_rn(tl.log(w) * u, w - 1.0))
    score = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
    slot = tl.arange(0, KP)
    if not HASH:
        pick = tl.where(ok, score + table[None, :], float("-inf"))
    ids = tl.zeros((BT, KP), tl.int32)
    chosen_scores = tl.zeros((BT, KP), tl.float32)
    for j in tl.static_range(K):
        if HASH:
            chosen = tl.sum(tl.where(slot[None, :] == j, table, 0), axis=1)
        else:
            chosen = tl.argmax(pick, axis=1)
            pick = tl.where(e[None, :] == chosen[:, None], float("-inf"), pick)
        s = tl.sum(tl.where(e[None, :] == chosen[:, None], score, 0.0), axis=1)
        ids = tl.where(slot[None, :] == j, chosen.to(tl.int32)[:, None], ids)
        chosen_scores = tl.where(slot[None, :] == j, s[:, None], chosen_scores)
    weights = tl.div_rn(chosen_scores, tl.sum(chosen_scores, axis=1)[:, None]) * route_scale
    out = t[:, None] * K + slot[None, :]
    out_ok = t_ok[:, None] & (slot < K)[None, :]
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, weights, mask=out_ok)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, tokens_ptr, ids_ptr, weights_ptr, T, E, route_scale,
    K: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr, HASH: tl.constexpr, BT: tl.constexpr,
    BE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    e = tl.arange(0, BE)
    table = route_table(bias_ptr, tid2eid_ptr, tokens_ptr, t, t_ok, E, K, KP, HASH, BE)
    x = sum_partials(
        logits_ptr, t.to(tl.int64)[:, None] * E + e[None, :], t_ok[:, None] & (e < E)[None, :], T * E, SPLIT
    )
    choose(x, t, t_ok, table, ids_ptr, weights_ptr, E, route_scale, K, KP, HASH, BT, BE)


@triton.jit
def _route_fused_kernel(
    f_ptr, w_ptr, bias_ptr, tid2eid_ptr, tokens_ptr, part_ptr, counter_ptr, ids_ptr, weights_ptr,
    q_ptr, qs_ptr, qm_ptr, T, E, D, f_stride, row_bytes, route_scale,
    WTYPE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HASH: tl.constexpr, BT: tl.constexpr,
    RB: tl.constexpr, BK: tl.constexpr, NKP: tl.constexpr, BE: tl.constexpr, Q8: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (k, r, b): router rows r * RB.. times columns k * BK.. of the tokens of block b, as
    partial logits part[t, k, rows]; the block's last program adds them and routes its tokens.
    Q8: the programs (k, 0, b) also store those columns as int8 rows (`expert_int8.Q8Rows` q, qs, qm)."""
    wait_for_inputs(PDL)
    pk, pr, tb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_k = tl.num_programs(0)
    r = pr * RB + tl.arange(0, RB)
    r_ok = r < E
    w = load_weight_tile(w_ptr, w_ptr, tl.where(r_ok, r, 0).to(tl.int64) * row_bytes, pk * BK, D, WTYPE, RB, BK)
    k = pk * BK + tl.arange(0, BK)
    for i in range(BT):
        t = (tb * BT + i).to(tl.int64)
        if t < T:
            f = tl.load(f_ptr + t * f_stride + k, mask=k < D, other=0.0)
            tl.store(part_ptr + (t * n_k + pk) * E + r, tl.sum(w * f[None, :], axis=1), mask=r_ok)
            if Q8 and pr == 0:
                store_q8(f.to(tl.float32), q_ptr, qs_ptr, qm_ptr, t * D, pk * BK, D, BK, PTX)
    if last_program(counter_ptr + tb, n_k * tl.num_programs(1)):
        e = tl.arange(0, BE)[None, :]
        for i in range(BT):
            t = tb * BT + i
            if t < T:
                one = tl.zeros((1,), tl.int32) + t
                table = route_table(bias_ptr, tid2eid_ptr, tokens_ptr, one, one < T, E, K, KP, HASH, BE)
                x = program_sums(part_ptr, t, e, e < E, n_k, E, NKP)  # [1, BE]
                choose(x, one, one < T, table, ids_ptr, weights_ptr, E, route_scale, K, KP, HASH, 1, BE)


def route(
    f: torch.Tensor,
    router: QWeight,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    tokens: torch.Tensor,
    k: int,
    route_scale: float,
    fused: bool = False,
    tile: tuple[int, int] | None = None,
    block_tokens: int | None = None,
    q8: Q8Rows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """f [T, D] -> (expert ids int32 [T, k], weights float32 [T, k]); tokens [T] on the device.

    `fused`: in one launch (a decode step), its programs sized by `tile` (router rows, columns) and
    `block_tokens` (defaults:
    ROUTER_TILE and 1 token on a GPU, the whole router and up to 16 tokens in the interpreter); and
    given `q8` ([T, D] rows), f quantized into it by the same launch (`expert_int8.quantize_rows`'s values)."""
    t, d = f.shape
    if q8 is not None and not fused:
        raise ValueError("int8 rows of the input come from the one-launch form (fused=True)")
    n_experts = router.rows
    ids = torch.empty(t, k, dtype=torch.int32, device=f.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=f.device)
    hashed = tid2eid is not None
    choice = dict(K=k, KP=next_pow2(k), HASH=hashed, BE=next_pow2(n_experts), num_warps=4)
    bias_or_any = bias if bias is not None else f
    table = tid2eid if hashed else ids
    if fused:
        if f.stride(1) != 1:
            raise ValueError("the router input needs contiguous rows")
        rb, bk = tile or ((next_pow2(n_experts), next_pow2(d)) if interpreting() else ROUTER_TILE)
        if q8 is not None and (q8.q.shape != f.shape or bk % 32):
            raise ValueError(f"int8 rows {tuple(q8.q.shape)} for inputs {tuple(f.shape)}, {bk}-column tiles: "
                             "they take the inputs' shape and tiles of a multiple of 32 columns")  # fmt: skip
        bt = block_tokens or (min(16, next_pow2(t)) if interpreting() else 1)
        grid = (triton.cdiv(d, bk), triton.cdiv(n_experts, rb), triton.cdiv(t, bt))
        part = torch.empty(t, grid[0], n_experts, device=f.device, dtype=torch.float32)
        _route_fused_kernel[grid](
            f, router.data, bias_or_any, table, tokens, part, ticket_counters(f.device, "route", grid[2]), ids,
            weights, *((q8.q, q8.scale, q8.sums) if q8 is not None else (ids, weights, weights)),
            t, n_experts, d, f.stride(0), router.row_bytes, route_scale,
            WTYPE=router.wtype, BT=bt, RB=rb, BK=bk, NKP=next_pow2(grid[0]), Q8=q8 is not None,
            PTX=compiles_ptx(), **choice, **dependent_launch(),
        )  # fmt: skip
        return ids, weights
    logits = qmatmul(f, router, split_k=ROUTER_SPLIT)
    bt = min(64, next_pow2(t)) if interpreting() else 1
    _route_kernel[(triton.cdiv(t, bt),)](
        logits, bias_or_any, table, tokens, ids, weights, t, n_experts, route_scale,
        SPLIT=logits.shape[0], BT=bt, **choice,
    )  # fmt: skip
    return ids, weights


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a `_route_fused_kernel` launch moves (see `runtime.KernelWork`): the router, the inputs, the
    partial logits (written, then read by the finishers) and the int8 rows (Q8: two bytes per column,
    a float per 32 and per 16)."""
    if kernel != "_route_fused_kernel":
        return None
    weight = a["E"] * a["row_bytes"]
    partials = 2 * 4 * a["T"] * a["E"] * triton.cdiv(a["D"], a["BK"])
    int8 = a["T"] * a["D"] * (2 + 4 / 32 + 4 / 16) if a["Q8"] else 0
    return KernelWork(weight + 4 * a["T"] * a["D"] + partials + int(int8), weight, 1, 0)


def reference(f, router: QWeight, bias, tid2eid, tokens, k, route_scale):
    fixed = tid2eid[tokens.long()].long() if tid2eid is not None else None
    return reference_route(f @ router.dequantize().T, k, route_scale, bias, fixed)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """Routing one decode token in one launch: the router GEMV, then biased top-k; and the same storing
    its input as int8 rows (the routed experts' fast 2-bit form)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    router = random_qweight(GGMLType.F16, (a.n_routed_experts, a.dim), dev, gen)
    f = torch.randn(1, a.dim, device=dev, generator=gen)
    bias = torch.zeros(a.n_routed_experts, device=dev)
    tokens = torch.zeros(1, dtype=torch.int32, device=dev)
    name = f"decode: {a.n_routed_experts} experts, top {a.n_activated_experts}"
    cases = []
    for q8 in (None, Q8Rows.empty(1, a.dim, dev)):
        run = functools.partial(route, f, router, bias, None, tokens, a.n_activated_experts, a.route_scale,
                                fused=True, q8=q8)  # fmt: skip
        label = name if q8 is None else f"{name}, input to int8"
        cases.append(BenchCase("moe_route", label, run, router.nbytes, 2 * router.rows * router.cols))
    return cases
