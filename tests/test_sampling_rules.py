"""The device-agnostic sampler: greedy is the argmax, seeded draws follow the rules' distribution.

The expected probabilities are computed here from the rules as the sampling module states them
(weights exp((l - l_max) / T), min-p, top-k, top-p in rank order), in plain Python, not by the code
under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams, redraw_refused, sample_batch, sample_tokens

PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01]
LOGITS = torch.log(torch.tensor(PROBS))[torch.tensor([3, 0, 7, 1, 9, 2, 5, 8, 4, 6])]  # not in rank order


def rule_probs(logits: list[float], params: SamplingParams) -> list[float]:
    top = max(logits)
    weight = [math.exp((v - top) / params.temperature) for v in logits]
    ranked = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    kept = [i for i in ranked if weight[i] >= params.min_p]
    if params.top_k:
        kept = kept[: params.top_k]
    if params.top_p < 1:
        total, before, nucleus = sum(weight[i] for i in kept), 0.0, []
        for i in kept:
            if before < params.top_p * total:
                nucleus.append(i)
            before += weight[i]
        kept = nucleus
    mass = sum(weight[i] for i in kept)
    return [weight[i] / mass if i in kept else 0.0 for i in range(len(logits))]


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is the 1 - 1e-4 normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_fits(draws: list[int], want: list[float]) -> None:
    n = len(draws)
    counts = torch.bincount(torch.tensor(draws), minlength=len(want)).tolist()
    assert all(c == 0 for c, p in zip(counts, want, strict=True) if p == 0), counts  # never a filtered token
    support = [(c, p * n) for c, p in zip(counts, want, strict=True) if p > 0]
    assert all(expected >= 5 for _, expected in support)  # where the chi-square approximation holds
    statistic = sum((c - e) ** 2 / e for c, e in support)
    assert statistic < chi_square_critical(len(support) - 1), (statistic, counts)


CASES = [
    SamplingParams(temperature=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, min_p=0.1),  # keeps p >= 0.03
    SamplingParams(temperature=0.7, top_k=4, min_p=0.0),
    SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.0),
]


@pytest.mark.parametrize("params", CASES)
def test_first_draws_over_many_seeds_follow_the_rules(params):
    draws = [Sampler(SamplingParams(**{**vars(params), "seed": seed}))(LOGITS) for seed in range(3000)]
    assert_fits(draws, rule_probs(LOGITS.tolist(), params))


@pytest.mark.parametrize("params", CASES[1::2])
def test_successive_draws_of_one_seed_follow_the_rules(params):
    sampler = Sampler(SamplingParams(**{**vars(params), "seed": 7}))
    assert_fits([sampler(LOGITS) for _ in range(3000)], rule_probs(LOGITS.tolist(), params))
    assert sampler.step == 3000


def test_greedy_is_the_argmax_with_ties_to_the_lower_id():
    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    rows[2, 40] = rows[2, 41] = rows[2].max() + 1  # a tie at the top
    want = [int(torch.argmax(row)) for row in rows]  # the previous sampler's rule
    assert want[2] == 40
    assert sample_batch(rows, [Sampler(GREEDY) for _ in rows]) == want
    # greedy rows keep their argmax in a batch that also samples
    mixed = [Sampler(GREEDY if i % 2 else SamplingParams(seed=i)) for i in range(len(rows))]
    assert sample_batch(rows, mixed)[1::2] == want[1::2]
    assert sample_batch(rows.to(torch.bfloat16), [Sampler(GREEDY) for _ in rows]) == [
        int(torch.argmax(row.to(torch.bfloat16).float())) for row in rows
    ]


def test_a_batch_gives_each_row_what_its_sampler_gives_alone():
    rows = 2.0 * torch.randn(5, 200, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(seed=3),
        SamplingParams(seed=4, top_k=7),
        GREEDY,
        SamplingParams(seed=5, temperature=0.5, top_p=0.5),
        SamplingParams(seed=6, top_k=2000, min_p=0.0),
    ]
    batched, alone = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for _ in range(20):
        tokens = sample_batch(rows, batched)
        assert tokens == [sampler(row) for sampler, row in zip(alone, rows, strict=True)]


def test_a_seed_fixes_the_sequence_and_seeds_differ():
    rows = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(seed=11, min_p=0.0)
    first, again = Sampler(params), Sampler(params)
    run = [first(rows) for _ in range(30)]
    assert run == [again(rows) for _ in range(30)]
    other = Sampler(SamplingParams(seed=12, min_p=0.0))
    assert run != [other(rows) for _ in range(30)]
    assert len(set(run)) > 10  # the counter moves: not the same draw repeated


def test_every_tensor_stays_on_the_logits_device():
    """On the meta device any CPU tensor mixed into the computation raises, and nothing can sync."""
    rows = torch.randn(4, 64, device="meta")
    samplers = [
        Sampler(SamplingParams(seed=1)),  # min-p only: drawn in id order
        Sampler(SamplingParams(seed=2, top_p=0.9)),  # ranked by a sort of the row
        Sampler(GREEDY),
        Sampler(SamplingParams(seed=3, top_k=5)),  # ranked by top-k
    ]
    tokens = sample_tokens(rows, samplers)
    assert tokens.device.type == "meta" and tokens.shape == (4,)
    assert sample_tokens(rows[2:], samplers[2:]).device.type == "meta"  # top-k bounds every row
    assert [s.step for s in samplers] == [1, 1, 2, 2]


def test_rows_and_samplers_must_match():
    with pytest.raises(DwarfStarError, match="2 rows of logits for 1 samplers"):
        sample_batch(torch.zeros(2, 10), [Sampler(GREEDY)])


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, min_p=0.0), CASES[3]], ids=str)
def test_refused_ids_are_never_drawn(params):
    """A refused draw is replaced by an independent one over the other ids: token t comes with
    probability P(t) + P(refused) * P'(t), P the rules over all ids and P' over the allowed ones,
    both computed here in plain Python; the sampler's counter moves by one a token all the same."""
    refused = frozenset({int(LOGITS.argmax()), 4})  # the best token among them
    params = SamplingParams(**{**vars(params), "refused": refused})
    allowed = [v if i not in refused else -math.inf for i, v in enumerate(LOGITS.tolist())]
    if params.greedy:
        sampler = Sampler(params)
        drawn = redraw_refused([LOGITS], [sampler], sample_batch(LOGITS.reshape(1, -1), [sampler]))
        assert drawn == [max(range(len(allowed)), key=lambda i: (allowed[i], -i))] and sampler.step == 1
        return
    full, rest = rule_probs(LOGITS.tolist(), params), rule_probs(allowed, params)
    lost = sum(full[i] for i in refused)
    want = [0.0 if i in refused else full[i] + lost * rest[i] for i in range(len(full))]
    draws = []
    for seed in range(3000):
        sampler = Sampler(SamplingParams(**{**vars(params), "seed": seed + 1}))
        draws += redraw_refused([LOGITS], [sampler], sample_batch(LOGITS.reshape(1, -1), [sampler]))
        assert sampler.step == 1
    assert_fits(draws, want)
