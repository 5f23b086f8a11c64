"""Token sampling on the device: temperature, min-p, top-k, top-p, and a seeded counter-based RNG.

Same rules and order as `dwarfstar.sampling.Sampler` (ds4's): keep the tokens whose weight
p_i = exp((l_i - l_max) / T) is at least min_p (the top token weighs 1), then the k best of those,
then, with top-p, each token while the mass of the better kept tokens is below top_p of the kept
total; draw among the survivors in proportion to p_i. Greedy (T <= 0) is the argmax, ties to the
lower token id.

One launch serves a batch of rows, each with its own knobs, read from a device buffer (so a captured
decode step samples inside the graph, whatever its requests ask). The candidates are each row's
`TOP_K_CAP` best logits, from `topk` (in ascending token id). The kernel ranks them with one sort in
registers (a key of the logit's order bits over the complemented id: value, then lower id first) and
takes the masses before each candidate, in rank order and in id order, as prefix sums: the work is
spread over the program's threads, with no chain of dependent loads. Without top-k
more than TOP_K_CAP tokens may pass min-p: the kernel flags such a row, and the caller redraws it
over the whole vocabulary (`dwarfstar.sampling`), which is rare (a flat distribution at a high
temperature).

The draw uses Philox (`tl.rand(seed, offset)`), inverse-CDF in the order `dwarfstar.sampling` uses:
rank order with top-k or top-p, token-id order with min-p alone. So the same (seed, step) gives the
same token here and in the device-agnostic sampler, on every device; `n` draws at steps
step..step+n-1 come out of one launch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.topk import order_key, topk_indices
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, dependent_launch, next_pow2, wait_for_inputs
from dwarfstar.sampling import (
    SEED_BITS,
    TOP_K_CAP,
    Sampler,
    SamplingParams,
    relabel_logprobs,
    sample_tokens,
)


@triton.jit
def _exclusive_cumsum(x, i):
    """The sum of the entries before each entry of x [KP] (i: arange(KP))."""
    inclusive = tl.cumsum(x, axis=0)
    return tl.where(i == 0, 0.0, tl.gather(inclusive, tl.maximum(i - 1, 0), 0))


@triton.jit
def _ranked(v, idx, live, KP: tl.constexpr):
    """The candidates in rank order (higher logit first, then lower id; the others last, id -1): their
    logits and ids, sorted in one key, order bits of the logit over the complement of the id."""
    low = tl.full([], 4294967295, tl.int64) - idx.to(tl.int64)  # a lower id sorts higher
    key = tl.where(live, (order_key(v, live).to(tl.uint64) << 32) | low.to(tl.uint64), 0)
    if KP > 1:
        key = tl.sort(key, descending=True)
    order = (key >> 32).to(tl.int64)  # back from the order bits (`topk.order_key`) to the float
    bits = tl.where(order >= 2147483648, order - 2147483648, -1 - order).to(tl.int32)
    ranked_idx = (tl.full([], 4294967295, tl.int64) - (key & 4294967295).to(tl.int64)).to(tl.int32)
    return bits.to(tl.float32, bitcast=True), ranked_idx


@triton.jit
def _sample_kernel(
    logits_ptr, cand_ptr, knobs_ptr, ints_ptr, out_ptr, overflow_ptr, vocab, n_cand, n_draws,
    KP: tl.constexpr, ND: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Row `program_id` of the batch: its knobs (temperature, min_p, top_p) and ints (top_k or 0,
    seed, step) are read here, so one compiled kernel (and one captured launch) serves any mix."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    temperature = tl.load(knobs_ptr + 6 * row)
    min_p = tl.load(knobs_ptr + 6 * row + 1)
    top_p = tl.load(knobs_ptr + 6 * row + 2)
    top_k = tl.load(ints_ptr + 6 * row + 3)
    seed = tl.load(ints_ptr + 6 * row + 4)
    step = tl.load(ints_ptr + 6 * row + 5)
    row_logits = logits_ptr + row.to(tl.int64) * vocab
    row_out = out_ptr + row * n_draws
    i = tl.arange(0, KP)
    idx = tl.load(cand_ptr + row * n_cand + i, mask=i < n_cand, other=-1)
    live = idx >= 0
    v = tl.load(row_logits + idx, mask=live, other=float("-inf"))
    top = tl.max(v, axis=0)
    overflow = 0
    if temperature <= 0:
        best = tl.min(tl.where(live & (v == top), idx, 2147483647), axis=0)
        for d0 in range(0, n_draws, ND):
            draw = d0 + tl.arange(0, ND)
            tl.store(row_out + draw, best + 0 * draw, mask=draw < n_draws)
    else:
        p = tl.where(live, tl.exp(tl.div_rn(v - top, temperature)), 0.0)
        # in token-id order (the candidates' own: `topk` gives them ascending): the min-p survivors'
        # mass at lower ids, where a draw without ranking starts each kept token's interval
        keep_id = live & (p >= min_p)
        below = _exclusive_cumsum(tl.where(keep_id, p, 0.0), i)
        # in rank order (i is the rank): the mass ranked before each; min-p, then top-k, keep a prefix
        # of the ranking, so a survivor's mass before it is the survivors' mass
        v_r, idx_r = _ranked(v, idx, live, KP)
        live_r = idx_r >= 0
        p_r = tl.where(live_r, tl.exp(tl.div_rn(v_r - top, temperature)), 0.0)
        before = _exclusive_cumsum(p_r, i)
        keep_r = live_r & (p_r >= min_p) & (i < tl.where(top_k > 0, top_k, KP))
        total = tl.sum(tl.where(keep_r, p_r, 0.0), axis=0)
        keep_r = keep_r & (tl.div_rn(before, total) < tl.where(top_p < 1.0, top_p, float("inf")))
        # (the knobs are scalars: combined by arithmetic, which the interpreter's booleans allow)
        ranked = (top_k > 0).to(tl.int32) + (top_p < 1.0).to(tl.int32) > 0
        # a kept candidate owns [start, start + p) of the kept mass, in rank order or in id order
        keep = tl.where(ranked, keep_r, keep_id)
        start = tl.where(keep, tl.where(ranked, before, below), float("inf"))
        chosen_id = tl.where(ranked, idx_r, idx)
        kept_total = tl.sum(tl.where(keep, tl.where(ranked, p_r, p), 0.0), axis=0)
        for d0 in range(0, n_draws, ND):
            draw = d0 + tl.arange(0, ND)
            target = tl.rand(seed, step + draw) * kept_total  # [ND]
            # the chosen candidate starts the last kept interval at or below the target; where starts
            # are equal (masses too small to move a float32 sum), the latest in the draw order, whose
            # interval is the one that is not empty
            at = tl.where(start[None, :] <= target[:, None], start[None, :], -1.0)  # [ND, KP]
            last = tl.max(at, axis=1)
            latest = tl.max(tl.where((at == last[:, None]) & keep[None, :], i[None, :], -1), axis=1)
            chosen = tl.max(tl.where(i[None, :] == latest[:, None], chosen_id[None, :], -1), axis=1)
            tl.store(row_out + draw, chosen, mask=draw < n_draws)
        # without top-k the rules may keep tokens past the candidates: when the weakest still passes
        weakest = tl.min(tl.where(live, p, float("inf")), axis=0)
        overflow = (top_k <= 0).to(tl.int32) * (n_cand < vocab).to(tl.int32) * (weakest >= min_p).to(tl.int32)
    tl.store(overflow_ptr + row, overflow)


def candidates_for(params: Sequence[SamplingParams], vocab: int) -> int:
    """How many of each row's best logits the kernel ranks: one when every row is greedy (the argmax),
    else TOP_K_CAP (each row's top-k then masks its own), so the launch shape depends on the batch's
    kind only, never on its knobs."""
    return 1 if all(p.greedy for p in params) else min(TOP_K_CAP, vocab)


def knob_rows(params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """The kernel's per-row inputs on the host, float32 [B, 6]: temperature, min_p, top_p, then the
    int32 bits of top_k (0: none), seed and step, so one copy moves them all (`.to(device,
    non_blocking=True)`, or `copy_(..., non_blocking=True)` into a captured step's buffer)."""
    rows = np.zeros((len(params), 6), dtype=np.float32)
    rows[:, :3] = [(p.temperature, p.min_p, p.top_p) for p in params]
    rows.view(np.int32)[:, 3:] = [
        (p.candidates or 0, seed & SEED_BITS, step) for p, seed, step in zip(params, seeds, steps, strict=True)
    ]
    host = torch.from_numpy(rows)
    # pinned, so the copy queues behind the step in flight instead of waiting for it
    return host.pin_memory() if torch.cuda.is_available() else host


@functools.cache
def _whole_rows(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """int32 [rows] of `vocab`: every logit is a candidate (made once: no fill inside a captured step)."""
    return torch.full((rows,), vocab, dtype=torch.int32, device=device)


def sample_rows(
    logits: torch.Tensor, knobs: torch.Tensor, k: int, n: int = 1, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids int32 [B, n] drawn from logits [B, vocab] by the rows' knobs (`knob_rows`, on the
    device), with draw counters step..step+n-1, and an int32 [B] flag for the rows whose rules may keep
    more tokens than the k candidates (no top-k and the k-th still passes min-p): those need
    `dwarfstar.sampling`'s full-vocabulary draw. `out` preallocates both (a captured step's buffers)."""
    rows, vocab = logits.shape
    logits = logits.float().contiguous()
    valid = _whole_rows(rows, vocab, logits.device)
    candidates = topk_indices(logits, valid, k)
    tokens, overflow = out if out is not None else (
        torch.empty(rows, n, dtype=torch.int32, device=logits.device),
        torch.empty(rows, dtype=torch.int32, device=logits.device),
    )  # fmt: skip
    kp = next_pow2(k)
    _sample_kernel[(rows,)](
        logits, candidates, knobs, knobs.view(torch.int32), tokens, overflow, vocab, k, n,
        KP=kp, ND=min(next_pow2(n), max(1, 65536 // kp)), num_warps=8, **dependent_launch(),
    )  # fmt: skip
    return tokens, overflow


def redraw_overflow(
    logits: torch.Tensor, samplers: Sequence[Sampler], steps: Sequence[int], host: list[int]
) -> list[int]:
    """The tokens of a one-draw `sample_rows` launch from its host copy (B tokens, then B flags: one
    sync), with each flagged row redrawn over the whole vocabulary at the counter the kernel used (and
    its logprobs, when it asks for them, relabelled to the token redrawn)."""
    b = len(samplers)
    tokens, flagged = host[:b], [i for i in range(b) if host[b + i]]
    if flagged:
        for i in flagged:
            samplers[i].step = steps[i]  # the redraw takes the kernel's draw counter
        redrawn = sample_tokens(torch.stack([logits[i] for i in flagged]), [samplers[i] for i in flagged])
        for i, token in zip(flagged, redrawn.tolist(), strict=True):
            tokens[i] = token
            relabel_logprobs(samplers[i], logits[i], token)
    return tokens


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int = 0, n: int = 1) -> torch.Tensor:
    """Token ids int32 [n] drawn from logits [vocab] (or [1, vocab]) with draw counters step..step+n-1
    (the kernel's own candidates only: no full-vocabulary fallback)."""
    logits = logits.reshape(1, -1)
    knobs = knob_rows([params], [seed], [step]).to(logits.device, non_blocking=True)
    return sample_rows(logits, knobs, candidates_for([params], logits.shape[1]), n)[0][0]


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `Sampler` draws from, over the whole vocabulary (min-p, top-k, top-p)."""
    logits = logits.float().flatten().cpu()
    probs = ((logits - logits.max()) / params.temperature).exp()
    keep = probs >= params.min_p
    k = min(params.top_k, TOP_K_CAP) if params.top_k > 0 else int(keep.sum())
    values, ids = torch.where(keep, probs, 0.0).topk(min(k, int(keep.sum())))
    if params.top_p < 1.0:
        values = values * ((values.cumsum(0) - values) < params.top_p * values.sum())
    out = torch.zeros_like(logits)
    out[ids] = values / values.sum()
    return out


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    logits = 3 * torch.randn(shape.args.vocab_size, device=shape.device, generator=shape.generator())
    run = functools.partial(sample, logits, SamplingParams(temperature=0.8, top_p=0.95), 1234)
    return [BenchCase("sampling", f"one draw over {logits.numel()} logits (min-p, top-p)", run, 4 * logits.numel())]
