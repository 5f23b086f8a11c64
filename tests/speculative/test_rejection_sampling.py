"""Rejection sampling emits tokens distributed exactly as plain sampling (chi-square tests)."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import torch
from conftest import PROMPT
from spec_support import CHUNK, CTX

from dwarfstar.sampling import Sampler, SamplingParams, redraw_refused, sample_batch
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Drafter, Speculator
from dwarfstar.speculative.mtp import load_draft
from dwarfstar.speculative.verify import (
    Verdict,
    draw,
    next_uniform,
    rule_probabilities,
    verify_greedy,
    verify_sampled,
    without_refused,
)

# a test fails when its counts are this unlikely under the claimed distribution
SIGNIFICANCE = 1e-3


def chi_square_p(counts: dict, expected: dict[object, float], trials: int) -> float:
    """p-value of Pearson's statistic, cells with an expected count below 5 pooled into one."""
    cells = [(counts.get(k, 0), e * trials) for k, e in expected.items()]
    assert sum(counts.values()) == sum(counts.get(k, 0) for k in expected), "a draw outside the support"
    big = [(o, e) for o, e in cells if e >= 5]
    small = [(o, e) for o, e in cells if e < 5]
    if small:
        big.append((sum(o for o, _ in small), sum(e for _, e in small)))
    stat = sum((o - e) ** 2 / e for o, e in big)
    df = len(big) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_first_token_follows_the_target_distribution():
    """p and q disagree a lot (q favours what p dislikes): the emitted token still follows p, and the
    acceptance rate is sum(min(p, q)), as the method predicts."""
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30], dtype=torch.float64)
    sampler, trials = Sampler(SamplingParams(seed=3)), 20000
    counts, accepted = Counter(), 0
    for _ in range(trials):
        d = draw(q, next_uniform(sampler))
        verdict = verify_sampled([p, p], [q], [d], sampler)
        counts[d if verdict.accepted else verdict.token] += 1
        accepted += verdict.accepted
    assert chi_square_p(counts, dict(enumerate(p.tolist())), trials) > SIGNIFICANCE
    assert abs(accepted / trials - float(torch.minimum(p, q).sum())) < 0.015


def test_rule_probabilities_are_what_the_sampler_draws():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.8, min_p=0.02, top_k=10, top_p=0.9, seed=9)
    probs = rule_probabilities(logits, params)
    sampler, trials = Sampler(params), 6000
    counts = Counter(sample_batch(logits.reshape(1, -1), [sampler])[0] for _ in range(trials))
    support = {i: float(v) for i, v in enumerate(probs) if v > 0}
    assert 1 < len(support) <= 10
    assert chi_square_p(counts, support, trials) > SIGNIFICANCE


def test_refused_ids_get_no_mass_and_theirs_goes_to_the_redraw():
    """Speculation takes refused ids (the server's control tokens) out as plain decoding does: p is P
    without them plus P(refused) times the distribution over the other ids, here a softmax by hand, and
    plain sampling's draw + redraw_refused follows it."""
    logits = torch.tensor([3.0, 2.0, 1.5, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, min_p=0.0, refused=frozenset({0, 3}), seed=5)
    whole = torch.softmax(logits.double(), 0)
    others = torch.softmax(logits.double()[[1, 2, 4, 5]], 0)
    want = torch.zeros(6, dtype=torch.float64)
    want[[1, 2, 4, 5]] = whole[[1, 2, 4, 5]] + (whole[0] + whole[3]) * others
    probs = rule_probabilities(logits, params)
    assert torch.allclose(probs, want, atol=1e-12) and probs[[0, 3]].sum() == 0
    sampler, trials, counts = Sampler(params), 4000, Counter()
    for _ in range(trials):
        counts[redraw_refused([logits], [sampler], sample_batch(logits.reshape(1, -1), [sampler]))[0]] += 1
    assert chi_square_p(counts, {i: float(v) for i, v in enumerate(probs) if v > 0}, trials) > SIGNIFICANCE


def test_greedy_verification_never_emits_a_refused_id():
    rows = torch.tensor([[0.0, 5.0, 4.0, 1.0], [7.0, 1.0, 2.0, 3.0]])  # the best: 1, then 0 (both refused)
    params = SamplingParams(temperature=0.0, refused=frozenset({0, 1}))
    assert verify_greedy(rows, [2]) == Verdict(0, 1)
    assert verify_greedy(without_refused(rows, params), [2]) == Verdict(1, 3)  # the best allowed ids


class SkewedTargetDrafter(Drafter):
    """Drafts over the target's own support (a fork of the target state runs ahead) with weights of its
    own: each supported token `skew` times less likely than the one of the next lower id. The supports
    match, the weights do not, so drafts are rejected often."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def propose(self, spec, n, sampler):
        fork = copy.deepcopy(spec.state)
        token, drafts, dists = spec.pending, [], []
        for _ in range(n):
            p = rule_probabilities(spec.target.forward([token], fork, all_logits=False)[0], sampler.params)
            support = (p > 0).double()
            weights = support * self.skew ** -(support.cumsum(0) - 1)
            q = weights / weights.sum()
            token = draw(q, next_uniform(sampler))
            drafts.append(token)
            dists.append(q)
        return drafts, dists


def first_two_tokens(backend, state, params: SamplingParams) -> dict[tuple[int, int], float]:
    """The exact distribution of the first two tokens sampled after `state`, which is left as it was."""
    start = state.snapshot()
    p1 = rule_probabilities(state.logits, params)
    expected = {}
    for t1 in p1.nonzero().flatten().tolist():
        after = backend.forward([t1], state, all_logits=False)[0]
        state.restore(start)
        for t2, p in enumerate(rule_probabilities(after, params).tolist()):
            if p:
                expected[t1, t2] = float(p1[t1]) * p
    return expected


def sampled_pairs(spec: Speculator, params: SamplingParams, trials: int, rewind) -> Counter:
    """The first two tokens `spec` generates with seeds 0..trials-1, each run after `rewind()`."""
    counts = Counter()
    for seed in range(trials):
        rewind()
        tokens = list(itertools.islice(spec.generate(3, SamplingParams(**{**params.__dict__, "seed": seed})), 2))
        counts[tuple(tokens)] += 1
    return counts


def test_model_tokens_follow_plain_sampling(engines):
    """The first two generated tokens over many seeds, on the model, against their exact distribution
    (the second is the first speculative one: drafted, then accepted or resampled)."""
    engine = engines("reference")
    backend = engine.backend
    params = SamplingParams(temperature=1.0, min_p=0.0, top_k=2)
    spec = Speculator(Session(backend, ctx=CTX, chunk=CHUNK), load_draft(backend, engine.model), 1)
    spec.drafter = SkewedTargetDrafter(skew=4.0)
    spec.prefill(PROMPT)
    start = (spec.state.snapshot(), spec.track.state.snapshot(), spec.track.hidden, spec.track.last)

    expected = first_two_tokens(backend, spec.state, params)

    def rewind() -> None:
        spec.state.restore(start[0])
        spec.track.state.restore(start[1])
        spec.track.hidden, spec.track.last = start[2], start[3]

    trials = 150
    counts = sampled_pairs(spec, params, trials, rewind)
    drafted, accepted = spec.stats.drafted[0], spec.stats.accepted[0]
    assert drafted == trials and 0.2 * trials < accepted < 0.95 * trials  # the draft is rejected often
    assert chi_square_p(counts, expected, trials) > SIGNIFICANCE
