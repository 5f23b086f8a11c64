"""Device sampling against the session sampler's distribution (same filters, same order)."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import sampling
from dwarfstar.sampling import Sampler, SamplingParams, sample_tokens


def logits_for(device, vocab=3000, seed=0):
    x = 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    x[17] = x[18] = x.max() + 1.0  # a tie at the top: the lower id wins under greedy
    return x.to(device)


def test_greedy_is_the_argmax_with_ties_to_the_lower_id(device):
    logits = logits_for(device)
    assert sampling.sample(logits, SamplingParams(temperature=0.0), seed=1).tolist() == [17]
    assert sampling.sample(logits, SamplingParams(temperature=1.0, top_k=1), seed=1).tolist() == [17]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
        SamplingParams(temperature=2.0, top_k=0, top_p=0.5, min_p=0.01),
    ],
)
def test_draws_follow_the_reference_distribution(params, device):
    logits = logits_for(device, seed=1)
    want = sampling.reference_probs(logits, params)
    n = 4096
    draws = sampling.sample(logits, params, seed=1234, step=0, n=n).cpu()
    assert bool((want[draws.long()] > 0).all())  # never a filtered-out token
    freq = torch.bincount(draws.long(), minlength=want.numel()).float() / n
    assert (freq - want).abs().max() < 5 * (want.max() / n) ** 0.5 + 1e-3  # within ~5 sigma
    again = sampling.sample(logits, params, seed=1234, step=0, n=n).cpu()
    assert torch.equal(draws, again)  # a seed and step fix the draw
    assert not torch.equal(draws[:64], sampling.sample(logits, params, seed=99, n=64).cpu())


def test_reference_distribution_is_the_session_samplers():
    """Guards the kernel's torch reference against drifting from `Sampler`: its draws fit the same law."""
    logits = logits_for("cpu", seed=2)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, seed=5)
    want = sampling.reference_probs(logits, params)
    sampler = Sampler(params)
    n = 3000
    freq = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=want.numel()).float() / n
    assert bool((want[freq > 0] > 0).all())
    assert (freq - want).abs().max() < 5 * (want.max() / n) ** 0.5 + 1e-3


def test_rows_whose_rules_reach_past_the_candidates_are_flagged(device):
    """Without top-k, a row whose TOP_K_CAP-th candidate still passes min-p may keep tokens the
    kernel never saw: it is flagged for the full-vocabulary draw; the others are not."""
    params = [
        SamplingParams(temperature=0.7, min_p=0.0),  # every token passes
        SamplingParams(temperature=0.7, min_p=0.0, top_k=5),  # top-k bounds it
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.05),  # the 1024th of 3000 weighs about 1e-3
    ]
    logits = logits_for(device).expand(len(params), -1)
    knobs = sampling.knob_rows(params, [1] * len(params), [0] * len(params)).to(device)
    _, flagged = sampling.sample_rows(logits, knobs, sampling.candidates_for(params, logits.shape[1]))
    assert flagged.tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("top_p", [1.0, 0.999])  # drawn in token-id order, and in rank order
def test_tokens_too_light_to_move_a_float_sum_never_take_the_draw(top_p, device):
    """With min-p 0 every token of the row is kept, most far too light to change a float32 running
    sum, so runs of them share one interval start: the draw goes to the heavy token whose interval
    holds the target, as the device-agnostic sampler draws."""
    heavy = [201, 12, 250, 5, 128]
    logits = torch.full((256,), -37.0)
    logits[heavy] = torch.tensor([3.0, 2.6, 2.4, 2.4, 2.0])
    params = [SamplingParams(temperature=2.0, min_p=0.0, top_p=top_p, seed=i) for i in range(16)]
    rows = logits.expand(len(params), -1)
    knobs = sampling.knob_rows(params, [p.seed for p in params], [0] * len(params)).to(device)
    drawn, _ = sampling.sample_rows(rows.to(device), knobs, sampling.candidates_for(params, 256))
    want = sample_tokens(rows.contiguous(), [Sampler(p) for p in params]).tolist()
    assert drawn[:, 0].cpu().tolist() == want and set(want) <= set(heavy)
