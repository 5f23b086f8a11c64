"""Logprobs recorded with a draw: the model's log-softmax at the request's temperature (1 for greedy),
before min-p, top-k and top-p, for the drawn token and the best alternatives.

The expected values are computed here in float64 from the logits, with torch's log_softmax, not by
the code under test.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams, redraw_refused, sample_batch

VOCAB = 500


def expected(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(row.double() / temperature, dim=-1)


PARAMS = [
    SamplingParams(temperature=1.0, logprobs=5, seed=1),
    SamplingParams(temperature=0.7, top_k=3, min_p=0.0, logprobs=2, seed=2),  # top-k does not change them
    SamplingParams(temperature=0.0, logprobs=4),  # greedy: reported at temperature 1
    SamplingParams(temperature=1.0, seed=3),  # asks for none
    SamplingParams(temperature=1.3, top_p=0.5, logprobs=0, seed=4),  # the drawn token's alone
]


def test_each_asking_row_gets_its_tokens_logprob_and_best_alternatives():
    gen = torch.Generator().manual_seed(0)
    samplers = [Sampler(p) for p in PARAMS]
    for _ in range(5):
        logits = 3 * torch.randn(len(PARAMS), VOCAB, generator=gen)
        tokens = sample_batch(logits, samplers)
        for row, token, sampler in zip(logits, tokens, samplers, strict=True):
            params = sampler.params
            if params.logprobs is None:
                assert sampler.logprobs is None
                continue
            want = expected(row, 1.0 if params.greedy else params.temperature)
            got = sampler.logprobs
            assert got.token == token
            assert got.logprob == pytest.approx(float(want[token]), abs=1e-5)
            assert got.logit == float(row[token])
            best = want.topk(params.logprobs)
            assert [a.token for a in got.top] == best.indices.tolist()
            assert [a.logprob for a in got.top] == pytest.approx(best.values.tolist(), abs=1e-5)
            assert sum(torch.tensor([a.logprob for a in got.top]).exp()) <= 1 + 1e-6
            if params.greedy:
                assert token == int(row.argmax())


def test_a_batch_where_every_row_asks_equals_each_row_alone():
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(3, VOCAB, generator=gen)
    params = [SamplingParams(temperature=t, logprobs=3, seed=9) for t in (0.5, 1.0, 2.0)]
    together = [Sampler(p) for p in params]
    sample_batch(logits, together)
    for row, p, batched in zip(logits, params, together, strict=True):
        alone = Sampler(p)
        sample_batch(row[None], [alone])
        assert alone.logprobs == batched.logprobs


def test_a_refused_tokens_redraw_reports_the_redrawn_tokens_logprob():
    row = torch.full((VOCAB,), -10.0)
    row[7], row[8] = 5.0, 4.0  # 7 is the greedy choice, and refused
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=2, refused=frozenset({7})))
    drawn = sample_batch(row[None], [sampler])
    assert drawn == [7] and sampler.logprobs.token == 7
    assert redraw_refused([row], [sampler], drawn) == [8]
    want = expected(row, 1.0)
    assert sampler.logprobs.token == 8
    assert sampler.logprobs.logprob == pytest.approx(float(want[8]), abs=1e-5)
    assert [a.token for a in sampler.logprobs.top] == [7, 8]  # the model's alternatives, refused or not


def test_logprobs_must_not_be_negative():
    with pytest.raises(DwarfStarError, match="logprobs"):
        SamplingParams(logprobs=-1)
    assert GREEDY.logprobs is None
