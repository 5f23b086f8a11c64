"""mHC pre-mix: from the 24 mixes to the sublayer input, with Sinkhorn; alone or fused with the post before.

Spec §2.2. Per token: the 24 mixes fn @ flatten(h), scaled by rsqrt(mean(h^2) + eps); pre =
sigmoid(.) + eps and post = 2 sigmoid(.); Sinkhorn on the 4 x 4 combination logits (row softmax,
column normalise, 19 rounds of row and column normalisation); the collapse x = sum_s pre_s h_s and
the sublayer's RMSNorm, so the output is the attention or MoE input directly.

In a decode step (`fused`) it is one launch, `hc_post_pre` included: the post of the sublayer
before (stream k = post_k * out + sum_j comb[j, k] h_j, `hc_post`) and this pre-mix.
Each program owns BD dims of a token's 4 streams: it updates them in place (with the post), and
stores its partial sums of the 24 mixes and of the squares; the last program of the token to finish
(`runtime.last_program`) adds the partials in a fixed order, runs Sinkhorn and reads the new streams
back for the collapse and the norm. V4.1's lagged mHC (`hc_mix.hc_post_mix`) is the same launch with
LAGGED: it writes the fresh pre out and collapses with the pre of the sublayer before. Prefill chunks
take the mixes from the split-K GEMV (`qmatmul`) and run one program per token with its streams in
registers (4 x 4096 floats for Flash).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import hc_post as post_kernel
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.kernels.quant_blocks import load_weight_tile
from dwarfstar.backends.triton.runtime import (
    BenchCase,
    BenchShape,
    KernelWork,
    dependent_launch,
    interpreting,
    last_program,
    next_pow2,
    program_values,
    rsqrt_rn,
    ticket_counters,
    wait_for_inputs,
)
from dwarfstar.backends.triton.weights import QWeight, random_qweight
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType

MIX_SPLIT = 8  # K splits of the 24-row mix GEMV (4 * D columns), in the prefill form
FUSED_DIMS = 64  # dims of a token's streams per program of the one-launch form: 64 programs at D = 4096
FLOAT_MIXES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


@triton.jit
def load_streams(h_ptr, t, t_ok, D, NHC: tl.constexpr, BD: tl.constexpr):
    """The streams of tokens t [BT] as a [BT, NHC, BD] tile, and the mean square of all NHC * D values."""
    s = tl.arange(0, NHC)
    d = tl.arange(0, BD)
    off = (t.to(tl.int64)[:, None, None] * NHC + s[None, :, None]) * D + d[None, None, :]
    h = tl.load(h_ptr + off, mask=t_ok[:, None, None] & (d < D)[None, None, :], other=0.0)
    mean_sq = tl.div_rn(tl.sum(tl.sum(h * h, axis=2), axis=1), NHC * D * 1.0)
    return h, mean_sq


@triton.jit
def sum_partials(ptr, offsets, mask, split_stride, SPLIT: tl.constexpr):
    """sum over SPLIT partial results laid out `split_stride` apart, at `offsets` (any shape)."""
    acc = tl.zeros(offsets.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ptr + s * split_stride + offsets, mask=mask, other=0.0)
    return acc


@triton.jit
def mix_constants(scale_ptr, base_ptr, NHC: tl.constexpr):
    """A sublayer's mix scales (pre, post, comb) and biases (pre [NHC], post [NHC], comb [NHC, NHC]), for
    `mix_weights`: loaded apart from it, so a caller can send them out with its other loads."""
    s = tl.arange(0, NHC)
    jk = 2 * NHC + NHC * s[:, None] + s[None, :]  # [NHC, NHC]: comb[j, k] at 8 + 4j + k
    return (tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2), tl.load(base_ptr + s),
            tl.load(base_ptr + NHC + s), tl.load(base_ptr + jk))  # fmt: skip


@triton.jit
def mix_weights(pre, post, comb, rs, constants, iters, hc_eps, NHC: tl.constexpr):
    """The mixes fn @ h of X tokens (pre, post [X, NHC], comb [X, NHC, NHC]) and rsqrt(mean(h^2) + eps)
    [X] -> pre = sigmoid + eps, post = 2 sigmoid, and comb through Sinkhorn; `constants` from
    `mix_constants`."""
    scale_pre, scale_post, scale_comb, base_pre, base_post, base_comb = constants
    pre = tl.sigmoid(pre * rs[:, None] * scale_pre + base_pre[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(post * rs[:, None] * scale_post + base_post[None, :])
    comb = comb * rs[:, None, None] * scale_comb + base_comb[None, :, :]
    # Sinkhorn: row softmax (+eps), column normalisation, then iters - 1 rounds of row and column
    comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
    comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None]) + hc_eps
    comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    return pre, post, comb


@triton.jit
def stream_mixes(
    h_ptr, mix_ptr, scale_ptr, base_ptr, t, t_ok, T, D, iters, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Tokens t's streams [BT, NHC, BD] and their mixes: (h, pre, post, comb) from the split-K partial
    sums of fn @ flatten(h) (`sum_partials`), scaled by rsqrt(mean(h^2) + eps), through `mix_weights`."""
    h, mean_sq = load_streams(h_ptr, t, t_ok, D, NHC, BD)
    n_mix = NHC * (NHC + 2)
    s = tl.arange(0, NHC)
    t2, t3 = t_ok[:, None], t_ok[:, None, None]
    row = t.to(tl.int64) * n_mix
    stride = T * n_mix
    jk = 2 * NHC + NHC * s[:, None] + s[None, :]
    pre = sum_partials(mix_ptr, row[:, None] + s[None, :], t2, stride, SPLIT)
    post = sum_partials(mix_ptr, row[:, None] + NHC + s[None, :], t2, stride, SPLIT)
    comb = sum_partials(mix_ptr, row[:, None, None] + jk[None, :, :], t3, stride, SPLIT)
    constants = mix_constants(scale_ptr, base_ptr, NHC)
    pre, post, comb = mix_weights(pre, post, comb, rsqrt_rn(mean_sq + norm_eps), constants, iters, hc_eps, NHC)
    return h, pre, post, comb


@triton.jit
def _hc_pre_kernel(
    h_ptr, mix_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, post_ptr, comb_ptr,
    T, D, iters, hc_eps, norm_eps,
    SPLIT: tl.constexpr, NHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    h, pre, post, comb = stream_mixes(
        h_ptr, mix_ptr, scale_ptr, base_ptr, t, t_ok, T, D, iters, hc_eps, norm_eps, SPLIT, NHC, BD
    )
    s = tl.arange(0, NHC)
    t2, t3 = t_ok[:, None], t_ok[:, None, None]
    x = tl.sum(pre[:, :, None] * h, axis=1)  # [BT, BD], from the raw (un-normalised) streams
    d = tl.arange(0, BD)
    x = x * rsqrt_rn(tl.div_rn(tl.sum(x * x, axis=1), D * 1.0) + norm_eps)[:, None]
    x = x * tl.load(norm_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], x, mask=t2 & (d < D)[None, :])
    tl.store(post_ptr + t[:, None] * NHC + s[None, :], post, mask=t2)
    tl.store(comb_ptr + t[:, None, None] * NHC * NHC + (NHC * s[:, None] + s[None, :])[None, :, :], comb, mask=t3)


@triton.jit
def post_and_mix(
    h_ptr, parts_ptr, post_ptr, comb_ptr, fn_ptr, part_ptr, tb, T, D, P, fn_row_bytes, stream_bytes, n_mix,
    POST: tl.constexpr, WTYPE: tl.constexpr, NHC: tl.constexpr, MIXP: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """The programs' part of the one-launch mHC kernels, for token block tb and this program's BD dims:
    the streams' slice, first updated in place by the post of the sublayer before (with POST), times
    the matching columns of the next mix fn [n_mix, NHC * D], and the slice's sum of squares, stored
    as the program's partials [MIXP + 1] at part[t, program]."""
    p, n_prog = tl.program_id(0), tl.num_programs(0)
    d = p * BD + tl.arange(0, BD)
    d_ok = d < D
    s = tl.arange(0, NHC)
    m = tl.arange(0, MIXP)
    rows = tl.where(m < n_mix, m, 0).to(tl.int64) * fn_row_bytes  # padding rows repeat row 0, unused
    for i in range(BT):
        t = (tb * BT + i).to(tl.int64)
        if t < T:
            at = (t * NHC + s[:, None]) * D + d[None, :]  # [NHC, BD]
            if POST:  # as `hc_post`: post_k * out, then + comb[j, k] h_j in order of j
                o = tl.zeros((BD,), tl.float32)
                for q in range(P):
                    o += tl.load(parts_ptr + (t * P + q) * D + d, mask=d_ok, other=0.0)
                new = tl.load(post_ptr + t * NHC + s)[:, None] * o[None, :]
                for j in tl.static_range(NHC):
                    comb_j = tl.load(comb_ptr + (t * NHC + j) * NHC + s)  # row j: comb[j, k] for every k
                    new += comb_j[:, None] * tl.load(h_ptr + (t * NHC + j) * D + d, mask=d_ok, other=0.0)[None, :]
                tl.store(h_ptr + at, new, mask=d_ok[None, :])
            else:
                new = tl.load(h_ptr + at, mask=d_ok[None, :], other=0.0)
            acc = tl.zeros((MIXP, BD), tl.float32)
            for k in tl.static_range(NHC):  # stream k's columns of fn: k * D + d
                w = load_weight_tile(fn_ptr, fn_ptr, rows + k * stream_bytes, p * BD, D, WTYPE, MIXP, BD)
                acc += w * tl.sum(tl.where(s[:, None] == k, new, 0.0), axis=0)[None, :]
            part = part_ptr + (t * n_prog + p) * (MIXP + 1)
            tl.store(part + m, tl.sum(acc, axis=1))
            tl.store(part + MIXP, tl.sum(tl.sum(new * new, axis=1), axis=0))


@triton.jit
def square_parts(part_ptr, t, n_prog, NHC: tl.constexpr, MIXP: tl.constexpr, NPP: tl.constexpr):
    """The programs' sums of squares of token t's streams (`post_and_mix`), not yet added:
    [NPP, 1, NHC], the first column used."""
    s = tl.arange(0, NHC)[None, :]
    return program_values(part_ptr, t, s * 0 + MIXP, s == 0, n_prog, MIXP + 1, NPP)


@triton.jit
def streams_rsqrt(squares, D, eps, NHC: tl.constexpr):
    """rsqrt(mean(h^2) + eps) [1] of a token's streams from its `square_parts`, added in program order."""
    return rsqrt_rn(tl.div_rn(tl.sum(tl.sum(squares, axis=0), axis=1), NHC * D * 1.0) + eps)


@triton.jit
def finished_mixes(
    part_ptr, t, n_prog, D, scale_ptr, base_ptr, iters, hc_eps, norm_eps,
    NHC: tl.constexpr, MIXP: tl.constexpr, NPP: tl.constexpr,
):  # fmt: skip
    """Token t's (pre [1, NHC], post [1, NHC], comb [1, NHC, NHC]) from the programs' partial sums of the
    mixes and squares (`post_and_mix`), added in program order, through `mix_weights` (Sinkhorn).
    Every partial is loaded before the first is added: one round trip to L2, not four."""
    s = tl.arange(0, NHC)[None, :]  # [1, NHC]
    jk = 2 * NHC + NHC * tl.arange(0, NHC)[:, None] + tl.arange(0, NHC)[None, :]
    width = MIXP + 1
    pre = program_values(part_ptr, t, s, s >= 0, n_prog, width, NPP)
    post = program_values(part_ptr, t, NHC + s, s >= 0, n_prog, width, NPP)
    comb = program_values(part_ptr, t, jk, jk >= 0, n_prog, width, NPP)
    squares = square_parts(part_ptr, t, n_prog, NHC, MIXP, NPP)
    constants = mix_constants(scale_ptr, base_ptr, NHC)
    rs = streams_rsqrt(squares, D, norm_eps, NHC)
    pre, post, comb = tl.sum(pre, axis=0), tl.sum(post, axis=0), tl.sum(comb, axis=0)[None, :, :]
    return mix_weights(pre, post, comb, rs, constants, iters, hc_eps, NHC)


@triton.jit
def first_streams(h_ptr, norm_ptr, t, D, NHC: tl.constexpr, FD: tl.constexpr):
    """Dims 0 .. FD of token t's streams [NHC, FD], read past L1 (other programs of the launch wrote
    them), and of the norm's weight [FD]: `collapse_norm`'s first block, which a finishing program
    loads before it adds the mixes' partial sums, so the round trips to L2 overlap."""
    s = tl.arange(0, NHC)
    d = tl.arange(0, FD)
    at = (t.to(tl.int64) * NHC + s[:, None]) * D + d[None, :]
    h = tl.load(h_ptr + at, mask=(d < D)[None, :], other=0.0, cache_modifier=".cg")
    return h, tl.load(norm_ptr + d, mask=d < D, other=0.0)


@triton.jit
def _weighted_rows(h, weights, NHC: tl.constexpr):
    """sum_s weights_s h[s] of streams h [NHC, FD], weights [1, NHC]: each weight taken out as a scalar,
    so h keeps its load's layout (a thread holds all NHC rows of its columns) and is never converted."""
    s = tl.arange(0, NHC)
    x = tl.zeros([h.shape[1]], tl.float32)
    for k in tl.static_range(NHC):
        w_k = tl.sum(tl.where(s[None, :] == k, weights, 0.0))
        x += w_k * tl.sum(tl.where(s[:, None] == k, h, 0.0), axis=0)
    return x


@triton.jit
def collapse_norm(
    h_ptr, first, t, weights, norm_ptr, out_ptr, D, eps, NHC: tl.constexpr, FD: tl.constexpr, ONE_BLOCK: tl.constexpr
):
    """out[t] = RMSNorm(sum_s weights_s h_s; norm) for token t, weights [1, NHC], FD dims at a time,
    the first FD of them and of the norm's weight `first` (`first_streams`).

    ONE_BLOCK, where FD covers the row (Flash's 4096, `collapse_block`): the sum stays in registers
    and is scaled there, one store. Otherwise the unnormalised sum goes to `out` block by block (the
    streams past h0 read past L1) and is scaled in a second pass, once its sum of squares is known."""
    s = tl.arange(0, NHC)
    t = t.to(tl.int64)
    d = tl.arange(0, FD)
    h0, norm0 = first
    x = _weighted_rows(h0, weights, NHC)  # [FD]
    sq = tl.sum(x * x, axis=0)
    if ONE_BLOCK:
        x = x * rsqrt_rn(tl.div_rn(sq, D * 1.0) + eps)
        x = x * norm0
        tl.store(out_ptr + t * D + d, x, mask=d < D)
    else:
        tl.store(out_ptr + t * D + d, x)
        for d0 in range(FD, D, FD):
            dd = d0 + d
            ok = dd < D
            h = tl.load(h_ptr + (t * NHC + s[:, None]) * D + dd[None, :], mask=ok[None, :], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            x = _weighted_rows(h, weights, NHC)
            tl.store(out_ptr + t * D + dd, x, mask=ok)
            sq += tl.sum(x * x, axis=0)
        tl.debug_barrier()  # the second pass's threads read what others stored
        r = rsqrt_rn(tl.div_rn(sq, D * 1.0) + eps)
        for d0 in range(0, D, FD):
            dd = d0 + d
            ok = dd < D
            x = tl.load(out_ptr + t * D + dd, mask=ok, other=0.0, cache_modifier=".cg") * r
            x = x * tl.load(norm_ptr + dd, mask=ok, other=0.0)
            tl.store(out_ptr + t * D + dd, x, mask=ok)


@triton.jit
def _hc_pre_fused_kernel(
    h_ptr, parts_ptr, post_ptr, comb_ptr, fn_ptr, scale_ptr, base_ptr, lag_ptr, norm_ptr, x_ptr, pre_out_ptr,
    post_out_ptr, comb_out_ptr, part_ptr, counter_ptr, T, D, P, fn_row_bytes, stream_bytes, iters, hc_eps, norm_eps,
    POST: tl.constexpr, WTYPE: tl.constexpr, NHC: tl.constexpr, MIXP: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, NPP: tl.constexpr, FD: tl.constexpr, ONE_BLOCK: tl.constexpr, LAGGED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    tb, n_prog = tl.program_id(1), tl.num_programs(0)
    n_mix = NHC * (NHC + 2)
    post_and_mix(
        h_ptr, parts_ptr, post_ptr, comb_ptr, fn_ptr, part_ptr, tb, T, D, P, fn_row_bytes, stream_bytes, n_mix,
        POST, WTYPE, NHC, MIXP, BT, BD,
    )  # fmt: skip
    if last_program(counter_ptr + tb, n_prog):
        s = tl.arange(0, NHC)[None, :]  # [1, NHC]
        jk = 2 * NHC + NHC * tl.arange(0, NHC)[:, None] + tl.arange(0, NHC)[None, :]
        for i in range(BT):
            t = tb * BT + i
            if t < T:
                first = first_streams(h_ptr, norm_ptr, t, D, NHC, FD)
                pre, post, comb = finished_mixes(
                    part_ptr, t, n_prog, D, scale_ptr, base_ptr, iters, hc_eps, norm_eps, NHC, MIXP, NPP
                )
                t64 = t.to(tl.int64)
                tl.store(post_out_ptr + t64 * NHC + s, post)
                tl.store(comb_out_ptr + t64 * NHC * NHC + (jk - 2 * NHC)[None, :, :], comb)
                if LAGGED:  # V4.1: the fresh pre is the next sublayer's; this one collapses with the one before's
                    tl.store(pre_out_ptr + t64 * NHC + s, pre)
                    pre = tl.load(lag_ptr + t64 * NHC + s)
                collapse_norm(h_ptr, first, t, pre, norm_ptr, x_ptr, D, norm_eps, NHC, FD, ONE_BLOCK)


@functools.cache
def _stream_bytes_per_col(ggml_type: GGMLType) -> int:
    if ggml_type not in FLOAT_MIXES:
        raise ValueError(f"the mHC mixes must be F32, F16 or BF16, not {ggml_type.name}")
    return BLOCK_GEOMETRY[ggml_type][1]


def fused_launch(
    h: torch.Tensor, parts: torch.Tensor | None, fn: QWeight, n_mix: int, dims: int | None, tokens: int | None
) -> tuple[dict, tuple[int, int], torch.Tensor, torch.Tensor]:
    """The one-launch form's sizes and buffers: (constexprs and the shared scalars, grid, partials,
    counters). `dims` per program (default FUSED_DIMS; in the interpreter all of them) and `tokens`
    per program (default 1; 16 in the interpreter) size the grid."""
    t, nhc, d = h.shape
    if not h.is_contiguous() or (parts is not None and not parts.is_contiguous()):
        raise ValueError("h and the sublayer output must be contiguous")
    if fn.cols != nhc * d or fn.rows != n_mix:
        raise ValueError(f"the mix must be [{n_mix}, {nhc * d}], got [{fn.rows}, {fn.cols}]")
    bd = next_pow2(dims or (d if interpreting() else FUSED_DIMS))
    bt = tokens or (min(16, next_pow2(t)) if interpreting() else 1)
    grid = (triton.cdiv(d, bd), triton.cdiv(t, bt))
    mixp, fd = next_pow2(n_mix), collapse_block(d)
    part = torch.empty(t, grid[0], mixp + 1, device=h.device, dtype=torch.float32)
    counters = ticket_counters(h.device, "hc", grid[1])
    scalars = dict(T=t, D=d, P=1 if parts is None else parts.shape[1], fn_row_bytes=fn.row_bytes,
                   stream_bytes=d * _stream_bytes_per_col(fn.ggml_type))  # fmt: skip
    constexprs = dict(
        POST=parts is not None, WTYPE=fn.wtype, NHC=nhc, MIXP=mixp, BT=bt, BD=bd, NPP=next_pow2(grid[0]),
        FD=fd, ONE_BLOCK=fd >= d, num_warps=8,
    )  # fmt: skip
    return scalars | constexprs, grid, part, counters


def as_parts(out: torch.Tensor) -> torch.Tensor:
    """The sublayer output as [T, P, D] parts ([T, D] is one part)."""
    return out if out.dim() == 3 else out.unsqueeze(1)


def launch_fused(h, parts, post, comb, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, dims, tokens, lag=None):
    """The one launch (`_hc_pre_fused_kernel`, sized by `fused_launch`): the post (with `parts`, its
    `post` and `comb`), the mix and the normed collapse -> (x, pre, post, comb) of the sublayer. With
    `lag` [T, n] (V4.1's lagged mHC: LAGGED) the collapse takes it and the fresh pre is returned for the
    next sublayer; without (V4) the fresh pre collapses and pre is None."""
    t, nhc, d = h.shape
    sizes, grid, part, counters = fused_launch(h, parts, fn, nhc * (nhc + 2), dims, tokens)
    x = torch.empty(t, d, device=h.device, dtype=torch.float32)
    pre_out = None if lag is None else torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    post_out = torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    comb_out = torch.empty(t, nhc, nhc, device=h.device, dtype=torch.float32)
    before = (h, h, h) if parts is None else (parts, post, comb)  # unread without the post
    lag_from, pre_to = (h, h) if lag is None else (lag, pre_out)  # untouched without LAGGED
    _hc_pre_fused_kernel[grid](
        h, *before, fn.data, scale, base, lag_from, norm_weight, x, pre_to, post_out, comb_out, part, counters,
        iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, LAGGED=lag is not None, **sizes, **dependent_launch(),
    )  # fmt: skip
    return x, pre_out, post_out, comb_out


def hc_pre(
    h: torch.Tensor,
    fn: QWeight,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    fused: bool = False,
    dims: int | None = None,
    tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n_hc, D] contiguous -> (RMSNorm(collapsed x; norm_weight) [T, D], post [T, n], comb [T, n, n]).

    `fused`: in one launch (a decode step), its programs sized by `dims` and `tokens` (`fused_launch`)."""
    t, nhc, d = h.shape
    if fused:
        x, _, post, comb = launch_fused(
            h, None, None, None, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, dims, tokens
        )
        return x, post, comb
    mix = qmatmul(h.view(t, nhc * d), fn, split_k=MIX_SPLIT)
    out = torch.empty(t, d, device=h.device, dtype=torch.float32)
    post = torch.empty(t, nhc, device=h.device, dtype=torch.float32)
    comb = torch.empty(t, nhc, nhc, device=h.device, dtype=torch.float32)
    bt, bd = tokens_per_program(t), next_pow2(d)
    _hc_pre_kernel[(triton.cdiv(t, bt),)](
        h, mix, scale, base, norm_weight, out, post, comb, t, d, iters, hc_eps, norm_eps,
        SPLIT=mix.shape[0], NHC=nhc, BT=bt, BD=bd, num_warps=max(4, min(16, bd // 512)),
    )  # fmt: skip
    return out, post, comb


def hc_post_pre(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *mix, dims=None, tokens=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post of one sublayer (h updated in place, `hc_post`: out [T, D] or [T, P, D] parts, post
    [T, n], comb [T, n, n]), then `hc_pre` of the next, `mix` its (fn, scale, base, norm_weight, iters,
    hc_eps, norm_eps), in one launch: (x, post, comb) of the next. For a decode step; a prefill chunk
    runs `hc_post`, then `hc_pre`."""
    x, _, post, comb = launch_fused(h, as_parts(out), post, comb, *mix, dims, tokens)
    return x, post, comb


def fused_work(a: dict, n_mix: int) -> KernelWork:
    """What a one-launch mHC kernel moves: the mix, the streams read (twice: the finisher reads them
    back) and, with the post, written and the sublayer output read, and the output rows."""
    t, d, nhc = a["T"], a["D"], a["NHC"]
    weight, streams = n_mix * a["fn_row_bytes"], 4 * t * nhc * d
    post = (streams + 4 * t * a["P"] * d) if a["POST"] else 0
    return KernelWork(weight + 2 * streams + post + 4 * t * d, weight, 1, 0)


def launch_work(kernel: str, a: dict) -> KernelWork | None:
    """What a `_hc_pre_fused_kernel` launch moves (see `runtime.KernelWork`)."""
    return fused_work(a, a["NHC"] * (a["NHC"] + 2)) if kernel == "_hc_pre_fused_kernel" else None


def collapse_block(d: int) -> int:
    """`collapse_norm`'s FD for rows of d: the whole row up to 4096 (64 floats of a token's streams a
    thread at 8 warps), so Flash's sum never leaves the registers; all of it in the interpreter."""
    return next_pow2(d) if interpreting() else min(4096, next_pow2(d))


def tokens_per_program(t: int) -> int:
    return min(16, next_pow2(t)) if interpreting() else 1


def reference(h, fn: QWeight, scale, base, norm_weight, iters, hc_eps, norm_eps):
    x, post, comb = ops.hc_pre(h, fn.dequantize(), scale, base, iters, hc_eps, norm_eps)
    return ops.rms_norm(x, norm_weight, norm_eps), post, comb


def reference_post_pre(h, out, post, comb, fn: QWeight, scale, base, norm_weight, iters, hc_eps, norm_eps):
    """(new streams, x, post, comb): `hc_post`'s reference, then `hc_pre`'s."""
    h = post_kernel.reference(h, out, post, comb)
    return h, *reference(h, fn, scale, base, norm_weight, iters, hc_eps, norm_eps)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    """mHC pre of one decode token (one launch, the mix GEMV included) and of a prefill chunk; the
    post of the MoE fused with the next pre (the decode transition)."""
    a, dev, gen = shape.args, shape.device, shape.generator()
    fn = random_qweight(GGMLType.F16, (a.hc_mix_dim, a.hc_mult * a.dim), dev, gen)
    scale, base = torch.full((3,), 0.3, device=dev), torch.zeros(a.hc_mix_dim, device=dev)
    norm = torch.ones(a.dim, device=dev)
    const = (fn, scale, base, norm, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
    cases = []
    for what, t in (("decode", 1), ("prefill", shape.prefill)):
        h = torch.randn(t, a.hc_mult, a.dim, device=dev, generator=gen)
        run = functools.partial(hc_pre, h, *const, fused=t == 1)
        moved = fn.nbytes + 4 * (h.numel() + t * a.dim)
        cases.append(BenchCase("hc_pre", f"{what} {t} tokens", run, moved, 2 * t * fn.rows * fn.cols))
    h = torch.randn(1, a.hc_mult, a.dim, device=dev, generator=gen)
    out = torch.randn(1, a.dim, device=dev, generator=gen)
    post = torch.rand(1, a.hc_mult, device=dev, generator=gen)
    comb = torch.rand(1, a.hc_mult, a.hc_mult, device=dev, generator=gen)
    run = functools.partial(hc_post_pre, h, out, post, comb, *const)
    moved = fn.nbytes + 4 * (3 * h.numel() + 2 * a.dim)
    cases.append(BenchCase("hc_pre", "decode post + pre, 1 token", run, moved, 2 * fn.rows * fn.cols))
    return cases
