"""Verifying drafted tokens against the target's logits, exactly.

Greedy: accept drafts while each equals the target's argmax at its position; the next token is the
target's argmax after the last accepted one (the correction at a mismatch, a bonus when all match).

Sampling (standard speculative rejection sampling): draft token d_k was drawn from the draft's
distribution q_k; it is accepted with probability min(1, p_k(d_k) / q_k(d_k)), p_k being the target's
distribution there. At the first rejection the next token is drawn from the residual
max(0, p_k - q_k) renormalised; when all are accepted, from p_{n+1}. Each emitted token is then
distributed exactly as non-speculative sampling would draw it. p and q are the same sampling rules
(`sampling.py`: temperature, min-p, top-k, top-p) applied to each model's logits, and the
ids a request refuses (`SamplingParams.refused`) taken out as plain decoding takes them out: greedy,
the best allowed id; sampled, a refused id's mass goes to a second draw over the others
(`redraw_refused`), so p is P without the refused ids plus P(refused) times P over the rest.

Uniforms come from the request's Philox stream (`philox_uniform(seed, counter)`), one counter per use,
so a seed replays the same tokens on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dwarfstar.sampling import TOP_K_CAP, Sampler, SamplingParams, philox_uniform


def without_refused(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] with the ids `params` refuses at -inf (the same tensor when it refuses none)."""
    if not params.refused:
        return logits
    out = logits.clone()
    out[..., sorted(params.refused)] = float("-inf")
    return out


def rule_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [vocab] (float64) that sampling with `params` draws from for one row of logits,
    a refused id's mass moved to the redraw over the other ids."""
    probs = _rules(logits, params)
    if params.refused:
        refused = sorted(params.refused)
        lost = probs[refused].sum()
        probs[refused] = 0.0
        if lost > 0:
            probs += lost * _rules(without_refused(logits.flatten(), params), params)
    return probs


def _rules(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Weights exp((l - l_max) / T); kept while >= min_p; then the top_k best (by logit, ties to the
    lower id); then each while the kept mass of better tokens is below top_p of the kept total."""
    logits = logits.double().flatten()
    weight = ((logits - logits.max()) / params.temperature).exp()
    kept = torch.where(weight >= params.min_p, weight, 0.0)
    if params.ranks:
        order = torch.sort(logits, descending=True, stable=True).indices
        ranked = kept[order]
        if params.top_k > 0:
            ranked[min(params.top_k, TOP_K_CAP) :] = 0.0
        before = torch.nn.functional.pad(ranked.cumsum(0)[:-1], (1, 0))
        ranked = torch.where(before < params.top_p * ranked.sum(), ranked, 0.0)
        kept = torch.zeros_like(kept).scatter_(0, order, ranked)
    return kept / kept.sum()


def draw(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw in token-id order: the first token whose cumulative mass exceeds u * total."""
    cdf = probs.cumsum(0)
    target = torch.tensor(uniform * float(cdf[-1]), dtype=cdf.dtype, device=cdf.device)
    index = int(torch.searchsorted(cdf, target, right=True))
    # rounding can put the target at the total: take the last token with mass
    return min(index, int(probs.nonzero()[-1]))


def next_uniform(sampler: Sampler) -> float:
    return philox_uniform(sampler.seed, sampler.advance())


@dataclass
class Verdict:
    accepted: int  # leading drafts accepted
    token: int  # the token after them: correction or bonus


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """target_logits [n+1, vocab]: row k is the target's next-token logits after draft k (row 0 after
    the pending token)."""
    best = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, best[accepted])


def verify_sampled(p: list[torch.Tensor], q: list[torch.Tensor], drafts: list[int], sampler: Sampler) -> Verdict:
    """p: the target's distributions, n+1 of them; q: the draft's, one per draft token."""
    for k, token in enumerate(drafts):
        ratio = float(p[k][token]) / float(q[k][token])
        if next_uniform(sampler) >= ratio:  # rejected (never when p >= q at the token)
            residual = (p[k] - q[k]).clamp_min(0.0)
            return Verdict(k, draw(residual if float(residual.sum()) > 0 else p[k], next_uniform(sampler)))
    return Verdict(len(drafts), draw(p[len(drafts)], next_uniform(sampler)))
