"""Token sampling on the device: temperature, min-p, top-k, top-p, and a seeded counter-based RNG.

Same rules and order as `dwarfstar.session.sampling.Sampler` (ds4's): keep the tokens whose weight
p_i = exp((l_i - l_max) / T) is at least min_p (the top token weighs 1), then the k best of those,
then, with top-p, each token while the mass of the better kept tokens is below top_p of the kept
total; draw among the survivors in proportion to p_i. Greedy (T <= 0) is the argmax, ties to the
lower token id. One difference: the device looks at the 1024 best logits at most (`TOP_K_CAP`), also
when top_k is 0; that changes nothing unless more than 1024 tokens pass min-p.

The candidates come from `topk` (unordered); the kernel ranks them by pairwise comparison (value,
then lower id first), so the masses "before" each candidate need no sort. The draw uses Philox
(`tl.rand(seed, offset)`): the same (seed, step) gives the same token on every device, and
`n` draws at steps step..step+n-1 come out of one launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.kernels.topk import topk_indices
from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, next_pow2
from dwarfstar.session.sampling import TOP_K_CAP, SamplingParams


@triton.jit
def _sample_kernel(
    logits_ptr, cand_ptr, out_ptr, n_cand, temperature, min_p, top_p, seed, step, n_draws,
    GREEDY: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, ND: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, KP)
    idx = tl.load(cand_ptr + i, mask=i < n_cand, other=-1)
    live = idx >= 0
    v = tl.load(logits_ptr + idx, mask=live, other=float("-inf"))
    top = tl.max(v, axis=0)
    if GREEDY:
        best = tl.min(tl.where(live & (v == top), idx, 2147483647), axis=0)
        for d0 in range(0, n_draws, ND):
            draw = d0 + tl.arange(0, ND)
            tl.store(out_ptr + draw, best + 0 * draw, mask=draw < n_draws)
    else:
        p = tl.where(live, tl.exp((v - top) / temperature), 0.0)
        keep = live & (p >= min_p)
        total = tl.sum(tl.where(keep, p, 0.0), axis=0)
        # mass ranked strictly before each candidate (higher logit, or equal logit and lower id); the
        # min-p survivors are a prefix of that ranking, so for a survivor it is survivors' mass only
        before = tl.zeros((KP,), tl.float32)
        for j0 in tl.static_range(0, KP, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            idx_j = tl.load(cand_ptr + j, mask=j < n_cand, other=-1)
            v_j = tl.load(logits_ptr + idx_j, mask=idx_j >= 0, other=float("-inf"))
            p_j = tl.where(idx_j >= 0, tl.exp((v_j - top) / temperature), 0.0)
            ahead = (v_j[None, :] > v[:, None]) | ((v_j[None, :] == v[:, None]) & (idx_j[None, :] < idx[:, None]))
            before += tl.sum(tl.where(ahead, p_j[None, :], 0.0), axis=1)
        keep = keep & (before / total < top_p)
        # both filters keep a prefix of the ranking, so a kept candidate's kept mass before it is
        # `before`: it owns [before, before + p) of the kept mass
        kept_before = tl.where(keep, before, float("inf"))
        kept_total = tl.sum(tl.where(keep, p, 0.0), axis=0)
        for d0 in range(0, n_draws, ND):
            draw = d0 + tl.arange(0, ND)
            target = tl.rand(seed, step + draw) * kept_total  # [ND]
            # the chosen candidate starts the last kept interval at or below the target
            start = tl.where(kept_before[None, :] <= target[:, None], kept_before[None, :], -1.0)  # [ND, KP]
            last = tl.max(start, axis=1)
            chosen = tl.min(tl.where((start == last[:, None]) & keep[None, :], idx[None, :], 2147483647), axis=1)
            tl.store(out_ptr + draw, chosen, mask=draw < n_draws)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int = 0, n: int = 1) -> torch.Tensor:
    """Token ids int32 [n] drawn from logits [vocab] (or [1, vocab]) with draw counters step..step+n-1."""
    logits = logits.reshape(-1).float().contiguous()
    vocab = logits.numel()
    k = min(params.top_k, TOP_K_CAP) if params.top_k > 0 else TOP_K_CAP
    k = min(k, vocab)
    valid = torch.full((1,), vocab, dtype=torch.int32, device=logits.device)
    candidates = topk_indices(logits.view(1, -1), valid, k)
    out = torch.empty(n, dtype=torch.int32, device=logits.device)
    kp = next_pow2(k)
    _sample_kernel[(1,)](
        logits, candidates, out, k, max(params.temperature, 1e-6), params.min_p, params.top_p,
        seed & 0x7FFFFFFF, step, n,
        GREEDY=params.greedy, KP=kp, CHUNK=min(kp, 8), ND=min(next_pow2(n), max(1, 65536 // kp)), num_warps=8,
    )  # fmt: skip
    return out


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
