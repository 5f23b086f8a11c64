"""Numerical primitives of DeepSeek V4 in plain torch, float32.

Each function states the official semantics it follows (spec §2.1, §2.2, §9). Backends check
their kernels against these.

Batch invariance: a row's result is the same bits however many other rows share the call (other
sequences of a batch, the rest of a prefill chunk, padding). BLAS picks its kernel, and so the order
in which it sums, by the shape of a product, so every product with weights goes through `linear`,
which never hands BLAS fewer than `MIN_ROWS` rows; attention sums over its keys in fixed blocks
(`attention_rows`), so that the masked keys padding a row out to its batch's longest add exact zeros;
and the transcendental functions go through `elementwise`, which computes every element alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dwarfstar.model.numerics import (
    E2M1_GRID,
    E2M1_MIDPOINTS,
    FP4_BLOCK,
    FP4_MAX,
    FP8_BLOCK,
    FP8_MAX,
    elementwise,
    hadamard_matrix,
)
from dwarfstar.model.state import CompressorSpec

# MKL multiplies fewer than 16 rows with other kernels (another summation order) than 16 or more,
# whose per-element order does not depend on the row count: measured for M = 1..4200 rows over the
# reference's product shapes (and K up to 16,384), AVX-512. tests/test_batch_invariance.py checks it.
MIN_ROWS = 16
KEY_BLOCK = 64  # keys per block of an attention row's sums (`attention_rows`)
_E2M1_GRID = torch.tensor(E2M1_GRID)
_E2M1_MIDPOINTS = torch.tensor(E2M1_MIDPOINTS)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in].T, each row's result the same bits whatever the number of rows: the
    rows go to BLAS contiguous and at least `MIN_ROWS` of them (zero rows pad the rest)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    n = flat.shape[0]
    if n < MIN_ROWS:
        flat = torch.cat((flat, flat.new_zeros(MIN_ROWS - n, flat.shape[1])))
    return (flat @ w.T)[:n].reshape(*x.shape[:-1], w.shape[0])


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.softmax(dim) with its exponentials through `elementwise`."""
    e = elementwise(torch.exp, x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of the LAST rope dims of x; cos/sin are [T, R/2].

    x is [T, ..., D]; the leading D - R dims (the "nope" part) pass through. `inverse` undoes the
    rotation, which the attention output needs because V = K carries the rotation too.
    """
    half = cos.shape[-1]
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0): the UE8M0 scale of the official kernels."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(x), exponent)


def _blocked(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """View the last dim as blocks, zero-padding a trailing partial block (tiny models have them).

    Padding with zeros is exact: a zero never raises a block's amax and rounds to zero.
    """
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), n


def fp8_round(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """KV "FP8" QAT rounding of a block of values (spec §9): e4m3fn with a power-of-two scale per
    `block` (V4: 64 nope dims; V4.1: 32, over the whole window row and FP8 GEMM inputs)."""
    blocks, n = _blocked(x, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = _pow2_ceil(amax * (1.0 / FP8_MAX))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)[..., :n]


def fp8_round_nope(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8-round the non-rope dims of KV rows; the trailing rope dims stay exact."""
    return torch.cat((fp8_round(x[..., :-rope_dim]), x[..., -rope_dim:]), dim=-1)


def fp4_round(x: torch.Tensor, block: int = FP4_BLOCK, e4m3_scale: bool = False) -> torch.Tensor:
    """Indexer "FP4" QAT rounding (spec §9): e2m1 with a power-of-two scale per `block`, ties to even code.

    `e4m3_scale` (V4.1's compressed rows, blocks of 16): the scale is amax / 6 rounded to e4m3fn
    instead, amax clamped at 6 * 2^-9 so that the scale is at least e4m3's smallest subnormal; values
    the rounded-down scale pushes past 6 clamp to 6.
    """
    blocks, n = _blocked(x, block)
    if e4m3_scale:
        amax = blocks.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-9)
        scale = (amax * (1.0 / FP4_MAX)).to(torch.float8_e4m3fn).float()
    else:
        amax = blocks.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
        scale = _pow2_ceil(amax * (1.0 / FP4_MAX))
    v = (blocks / scale).clamp(-FP4_MAX, FP4_MAX)
    mag = v.abs()
    mids = _E2M1_MIDPOINTS.to(x.device)
    code = torch.searchsorted(mids, mag.contiguous(), right=False)  # midpoints strictly below |v|
    tie = mag == mids[code.clamp(max=len(mids) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    q = _E2M1_GRID.to(x.device)[code] * torch.sign(v) * scale
    return q.flatten(-2)[..., :n]


def hadamard(x: torch.Tensor) -> torch.Tensor:
    return linear(x, hadamard_matrix(x.shape[-1]).to(x.device))  # symmetric: x @ H = x @ H.T


def indexer_round(x: torch.Tensor) -> torch.Tensor:
    """Indexer QAT: Hadamard rotation, then FP4 rounding (applied to indexer queries and keys)."""
    return fp4_round(hadamard(x))


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): the clamp is applied before the activation."""
    return elementwise(F.silu, gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Multiplies(Protocol):
    """What `routed_ffn` multiplies with: `weights.Products` (float32 here, the CPU kernels' there)."""

    def input(self, x: torch.Tensor) -> Any: ...

    def linear(self, x: Any, w: Any) -> torch.Tensor: ...


def routed_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    expert: Callable[[int], tuple[Any, Any, Any]],
    products: Multiplies,
    limit: float,
    observe: Callable[[int, tuple[torch.Tensor, ...]], None] | None = None,
) -> torch.Tensor:
    """The routed experts' clamped-SwiGLU FFN of each row of x [T, dim], summed over its k slots: one
    product per distinct expert, the router weight [T, k] scaling the SwiGLU output before the down
    projection (as ds4 does). `slot_ids` [T, k] index the expert source (`expert(slot)` -> gate, up,
    down as `products` take them); `ids` are the experts' ids, which `observe(id, (gate input, up input,
    down input))` is told (imatrix collection)."""
    out = torch.zeros_like(x)
    for e in slot_ids.unique().tolist():
        rows, slots = (slot_ids == e).nonzero(as_tuple=True)
        gate, up, down = expert(e)
        inputs = x[rows]
        both = products.input(inputs)
        hidden = swiglu_clamped(products.linear(both, gate), products.linear(both, up), limit)
        hidden = hidden * weights[rows, slots, None]
        if observe is not None:
            observe(int(ids[rows[0], slots[0]]), (inputs, inputs, hidden))
        out.index_add_(0, rows, products.linear(hidden, down))
    return out


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """HC combination matrix [..., n, n]: row softmax, then alternate column/row normalisation.

    One column normalisation follows the softmax, then iters-1 (row, column) rounds (official order).
    """
    comb = softmax(logits, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_mix(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hyper-connection mixes of the streams h [T, n, D]: (pre [T, n], post [T, n], comb [T, n, n]),
    from the RMS-normalised flattened streams (V4 collapses with its own pre, `hc_pre`; V4.1 with the
    previous sublayer's, `v41.mhc`)."""
    n = h.shape[1]
    flat = h.flatten(1)
    mix = linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = elementwise(torch.sigmoid, mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * elementwise(torch.sigmoid, mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hyper-connection pre-mix. h is [T, n, D]; returns (sublayer input [T, D], post [T, n], comb [T, n, n]).

    The mixes come from the RMS-normalised flattened streams (`hc_mix`), but the collapse uses the raw streams.
    """
    pre, post, comb = hc_mix(h, fn, scale, base, iters, hc_eps, norm_eps)
    return (pre.unsqueeze(-1) * h).sum(1), post, comb


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: stream k = post_k * out + sum_j comb[j, k] * h_j (column k of comb, not row)."""
    return post.unsqueeze(-1) * out.unsqueeze(1) + comb.transpose(1, 2) @ h


def hc_head(
    h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the n streams with sigmoid weights (no Sinkhorn, no post)."""
    flat = h.flatten(1)
    mix = linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    weights = elementwise(torch.sigmoid, mix * scale + base) + hc_eps
    return (weights.unsqueeze(-1) * h).sum(1)


def sink_attention_probs(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention weights [..., T, H, N] with a per-head sink logit that only enlarges the denominator.

    q [..., T, H, D], kv [..., N, D] (one shared head, K = V), mask [..., T, N] bool (True = visible),
    sinks [H]; the leading dims (none, or a decode step's sequences) are batch dims.
    """
    scores = torch.einsum("...thd,...nd->...thn", q, kv) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[..., None, :], float("-inf"))
    sink = sinks.view(-1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention with sinks (see `sink_attention_probs`): output [T, H, D]."""
    return torch.einsum("thn,nd->thd", sink_attention_probs(q, kv, mask, sinks), kv)


def attention_rows(
    q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sink attention (`sink_attention_probs`) of R query rows q [R, H, D], each over keys of its own:
    `parts` [(keys [R, n, D] (K = V), mask [R, n] bool)], a row's keys one part after the other.
    Returns the output [R, H, D] and each part's weights [R, H, n].

    Batch-invariant: a row's result depends on its keys and where they sit in the parts, not on R, nor
    on masked keys after a part's last visible one. Scores are one product per key; the softmax
    denominator and the weighted sum run over blocks of `KEY_BLOCK` keys (a part is padded to whole
    blocks), added block after block: a block of masked keys adds an exact 0. Masked keys are zeroed
    (padding may be uninitialised memory, and 0 * NaN is NaN).
    """
    blocked, top = [], sinks.expand(q.shape[0], -1)
    for keys, mask in parts:
        pad = -keys.shape[1] % KEY_BLOCK
        if pad:
            keys, mask = F.pad(keys, (0, 0, 0, pad)), F.pad(mask, (0, pad))
        keys = keys.masked_fill(~mask[..., None], 0.0)
        scores = torch.bmm(q, keys.transpose(1, 2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        if scores.shape[-1]:
            top = torch.maximum(top, scores.amax(-1))
        blocked.append((keys, scores, keys.shape[1] - pad))
    denominator = elementwise(torch.exp, sinks - top)
    exps = []
    for _, scores, _ in blocked:
        e = elementwise(torch.exp, scores - top[..., None])
        sums = e.unflatten(-1, (-1, KEY_BLOCK)).sum(-1)
        for b in range(sums.shape[-1]):
            denominator = denominator + sums[..., b]
        exps.append(e)
    out, weights = torch.zeros_like(q), []
    for (keys, _, n), e in zip(blocked, exps, strict=True):
        p = e / denominator[..., None]
        for lo in range(0, p.shape[-1], KEY_BLOCK):
            out = out + torch.bmm(p[..., lo : lo + KEY_BLOCK], keys[:, lo : lo + KEY_BLOCK])
        weights.append(p[..., :n])
    return out, weights


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores [R, n] = sum_h weights_h * relu(q_h . k) of R query rows q [R, H, D]
    (weights [R, H]) over keys [R, n, D] of their own: one product per key, so a row's scores do not
    depend on R or on the keys after it."""
    return (torch.bmm(q, keys.transpose(1, 2)).relu() * weights[:, :, None]).sum(1)


def top_k_visible(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The k best-scoring visible keys of each row, as a mask like `visible` (all of them when fewer);
    equal scores go to the lower index, so padding a row with more keys never changes its choice."""
    order = torch.sort(scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True, stable=True).indices
    return visible & torch.zeros_like(visible).scatter_(-1, order[..., :k], True)


def compress(
    spec: CompressorSpec,
    front_kv: torch.Tensor,
    front_gate: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    start: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advance a compressor over T tokens from position `start`: the rows finished, RMS-normed, and
    the new frontier (kv, gate).

    kv and gate are the tokens' compressor projections [T, width]; ape [ratio, width] is the bias of
    a token's slot in its window. A finished window of `ratio` tokens pools into one row by a softmax
    gate over its slots (ratio 4 also pools the first half of the previous window: 8 slots with
    overlap). The frontier keeps the unfinished window; the caller stores it, and rotates, rounds and
    appends the rows. Nothing is written in place, so autograd can run through a call.
    """
    r, off = spec.ratio, spec.current_offset
    front_kv, front_gate = front_kv.clone(), front_gate.clone()
    n_pending = start % r  # tokens of the window in progress already in the frontier
    positions = torch.arange(start, start + kv.shape[0], device=kv.device)
    kv = torch.cat((front_kv[off : off + n_pending], kv))
    gate = torch.cat((front_gate[off : off + n_pending], gate + ape[positions % r]))
    n = kv.shape[0] // r
    pooled = kv.new_empty(0, spec.dim)
    if n:
        win_kv, win_gate = kv[: n * r].view(n, r, -1), gate[: n * r].view(n, r, -1)
        if spec.overlap:
            # row w pools the first half of window w-1 and the second half of window w; before
            # window 0 the frontier holds gate -inf, which gives those slots weight 0
            d = spec.dim
            prev_kv = torch.cat((front_kv[None, :r], win_kv[:-1]))[..., :d]
            prev_gate = torch.cat((front_gate[None, :r], win_gate[:-1]))[..., :d]
            slots_kv = torch.cat((prev_kv, win_kv[..., d:]), dim=1)
            slots_gate = torch.cat((prev_gate, win_gate[..., d:]), dim=1)
            front_kv[:r], front_gate[:r] = win_kv[-1], win_gate[-1]
        else:
            slots_kv, slots_gate = win_kv, win_gate
        pooled = rms_norm((slots_kv * softmax(slots_gate, 1)).sum(1), norm, eps)
    rest = kv.shape[0] - n * r
    front_kv[off:] = 0.0
    front_gate[off:] = float("-inf")
    front_kv[off : off + rest] = kv[n * r :]
    front_gate[off : off + rest] = gate[n * r :]
    return pooled, front_kv, front_gate


def compress_step(
    spec: CompressorSpec,
    front_kv: torch.Tensor,
    front_gate: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`compress` for one token of each of B sequences (a decode step): the rows finished [D, dim],
    which sequences finished one (`done` [B] bool), and the new frontiers [B, ...].

    front_kv / front_gate [B, rows, width] are the sequences' frontiers, kv / gate [B, width] their
    tokens' projections, positions [B] the tokens' positions. A token fills its slot of the window in
    progress; the token that fills a window's last slot pools it as `compress` does, and its
    frontier moves on (ratio 4: the finished window becomes the previous one).
    """
    r, off = spec.ratio, spec.current_offset
    front_kv, front_gate = front_kv.clone(), front_gate.clone()
    seqs, slot = torch.arange(kv.shape[0]), positions % r
    front_kv[seqs, off + slot] = kv
    front_gate[seqs, off + slot] = gate + ape[slot]
    done = slot == r - 1
    win_kv, win_gate = front_kv[done], front_gate[done]
    if spec.overlap:  # the previous window's first half of the dims, this window's second half
        d = spec.dim
        slots_kv = torch.cat((win_kv[:, :r, :d], win_kv[:, r:, d:]), dim=1)
        slots_gate = torch.cat((win_gate[:, :r, :d], win_gate[:, r:, d:]), dim=1)
        front_kv[done, :r], front_gate[done, :r] = win_kv[:, r:], win_gate[:, r:]
    else:
        slots_kv, slots_gate = win_kv, win_gate
    pooled = rms_norm((slots_kv * softmax(slots_gate, 1)).sum(1), norm, eps)
    front_kv[done, off:] = 0.0
    front_gate[done, off:] = float("-inf")
    return pooled, done, front_kv, front_gate
