"""Each backend's sampling path against the rules of `dwarfstar.sampling.Sampler`.

The draws go through the backend's own `sample_batch` (Triton's kernel for greedy and top-k rows,
the device-agnostic rules elsewhere), on logits held where the backend keeps them. The expected distribution is
computed here from the rules themselves (temperature, min-p, top-k, top-p, in that order; ranks by
logit, ties to the lower id), in float64, and the draws are judged by a chi-square test. The seeds
are fixed, so each case is deterministic; each case also rejects the distribution of a plausible
mistake, which shows the test has the power to fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conformance import PROMPT, state_device, state_from_payload

from dwarfstar.sampling import Sampler, SamplingParams

# Rows of WIDTH logits: the rules do not depend on the width, and a draw costs Triton's interpreter
# 0.05 s on 256 logits but 0.5 s on 4,096 (2.3 s for a greedy one over the 129,280 of the model).
# A dozen live tokens spread over the row, with a tie at ranks 3 and 4; every other token far below
# (exp(-40) each, 1e-15 all together).
WIDTH = 256
LIVE_IDS = [201, 12, 250, 5, 128, 80, 33, 99, 110, 7, 42, 255]
LIVE_LOGITS = [3.0, 2.6, 2.4, 2.4, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]
FLOOR = -37.0
# Draws per case: ROWS samplers (seeds 0, 1, ...) in one batch, CALLS batches. The interpreter runs
# the kernel once per row, so it gets fewer. Each mistake below excludes a token the rules keep
# with 5% or more of the mass, or moves the mass by more, so it fails even on 300 draws.
DRAWS = {"interpret": (30, 10)}
DEFAULT_DRAWS = (200, 10)
P_VALUE = 1e-3


def fixed_logits(width: int = WIDTH) -> torch.Tensor:
    logits = torch.full((width,), FLOOR, dtype=torch.float64)
    logits[LIVE_IDS] = torch.tensor(LIVE_LOGITS, dtype=torch.float64)
    return logits


def expected_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The sampling rules, written out: weights at temperature, min-p, top-k, top-p, normalised."""
    values = logits.numpy()
    weight = np.exp((values - values.max()) / params.temperature)
    ranked = np.lexsort((np.arange(values.size), -values))  # by logit, descending; ties to the lower id
    ranked = ranked[weight[ranked] >= params.min_p]
    if params.top_k:
        ranked = ranked[: params.top_k]
    if params.top_p < 1.0:
        kept = weight[ranked]
        ranked = ranked[np.cumsum(kept) - kept < params.top_p * kept.sum()]
    probs = np.zeros(values.size)
    probs[ranked] = weight[ranked] / weight[ranked].sum()
    return probs


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of the counts under probs; tokens expected fewer than 5 times share one bin."""
    n = counts.sum()
    if counts[probs == 0].any():
        return 0.0  # a token the rules exclude was drawn
    expected = probs * n
    big = expected >= 5
    observed_bins = [*counts[big], counts[~big].sum()]
    expected_bins = [*expected[big], expected[~big].sum()]
    if expected_bins[-1] < 5:  # too small a pooled bin: fold it into the smallest kept one
        smallest = int(np.argmin(expected_bins[:-1]))
        observed_bins[smallest] += observed_bins.pop()
        expected_bins[smallest] += expected_bins.pop()
    o, e = np.array(observed_bins, dtype=np.float64), np.array(expected_bins)
    statistic = float(((o - e) ** 2 / e).sum())
    dof = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def ties_to_the_higher_id(logits: torch.Tensor) -> torch.Tensor:
    tweaked = logits.clone()
    tweaked[250] += 1e-9  # ranks 250 before 5, its equal
    return tweaked


# rules, and a plausible mistake the draws must not fit: (logits -> logits it sees, its rules).
# Every field the case does not set keeps its SamplingParams default (min_p 0.05).
CASES = {
    # the mistake: temperature not applied
    "softmax": (dict(temperature=2.0, min_p=0.0), (None, dict(temperature=1.0, min_p=0.0))),
    # keeps weights >= 0.1, i.e. logits >= 3 + 0.7 ln 0.1 = 1.39: the six best; the mistake keeps
    # normalised probabilities >= 0.1 (weights >= 0.28 of the total 2.78), which drops two of them
    "temperature-min-p": (dict(temperature=0.7, min_p=0.1), (None, dict(temperature=0.7, min_p=0.28))),
    # top-k 3 cuts through the tie at ranks 3 and 4 (logit 2.4: ids 5 and 250): the lower id stays
    "top-k-tie": (dict(temperature=1.5, top_k=3), (ties_to_the_higher_id, dict(temperature=1.5, top_k=3))),
    # top-p 0.6 keeps the token whose mass crosses it (id 5: 1.67 of 3.68 before it, 2.22 after);
    # top-p 0.45 is the same ranking without that token
    "top-p": (dict(temperature=1.0, top_p=0.6, min_p=0.0), (None, dict(temperature=1.0, top_p=0.45, min_p=0.0))),
    # min-p keeps 9, top-k 8 of them (3.12 in all), top-p 0.9 the 5 best: the fifth (logit 2.0, 10%)
    # crosses it; top-p 0.8 drops that one
    "all-four": (
        dict(temperature=0.8, min_p=0.02, top_k=8, top_p=0.9),
        (None, dict(temperature=0.8, min_p=0.02, top_k=8, top_p=0.8)),
    ),
}


def draws(backend, logits: torch.Tensor, params: SamplingParams, rows: int, calls: int, first_seed=0) -> list[int]:
    """rows * calls tokens: each call one batch of identical rows, one sampler (seed) per row."""
    samplers = [Sampler(SamplingParams(**{**params.__dict__, "seed": first_seed + i})) for i in range(rows)]
    batch = logits.float().to(state_device(backend)).expand(rows, -1)
    return [t for _ in range(calls) for t in backend.sample_batch(batch, samplers)]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_draws_follow_the_sampling_rules(kind, backend, case):
    rules, (mistaken_view, mistaken_rules) = CASES[case]
    logits = fixed_logits()
    rows, calls = DRAWS.get(kind.runs_on, DEFAULT_DRAWS)
    tokens = draws(backend, logits, SamplingParams(**rules), rows, calls)
    counts = np.bincount(np.array(tokens), minlength=WIDTH)
    assert counts.sum() == rows * calls
    p_rules = chi_square_p_value(counts, expected_probs(logits, SamplingParams(**rules)))
    assert p_rules > P_VALUE, f"{case}: the draws do not follow the rules (p = {p_rules:.2e})"
    seen = logits if mistaken_view is None else mistaken_view(logits)
    p_mistake = chi_square_p_value(counts, expected_probs(seen, SamplingParams(**mistaken_rules)))
    assert p_mistake < P_VALUE, f"{case}: the test cannot tell the rules from a mistake (p = {p_mistake:.2e})"


def test_greedy_takes_the_first_argmax(backend):
    """On full-vocabulary rows, with the tie past id 2**16."""
    logits = fixed_logits(backend.args.vocab_size)
    logits[70001] = logits[120000] = max(LIVE_LOGITS) + 1  # the lower id wins
    assert set(draws(backend, logits, SamplingParams(temperature=0.0), rows=1, calls=2)) == {70001}


def test_a_seed_fixes_the_draws(backend):
    logits = fixed_logits()
    params = SamplingParams(**CASES["all-four"][0])
    first = draws(backend, logits, params, rows=8, calls=2)
    assert draws(backend, logits, params, rows=8, calls=2) == first
    assert draws(backend, logits, params, rows=8, calls=2, first_seed=8) != first


def test_a_decode_step_draws_what_sampling_its_logits_draws(backend, reference_payload):
    """`decode_sample` (on a GPU, the sampling kernel inside the captured step) gives three sequences
    at once, greedy and sampled, the tokens that `sample_batch` draws from the same step's logits
    with the same seeds; the states end exactly where a plain batched step leaves them."""
    lengths = (5, 20, 131)  # inside the raw window, past ratio-4 rows, past the first ratio-128 row
    states = [state_from_payload(reference_payload(n, True), backend) for n in lengths]
    twins = [state_from_payload(reference_payload(n, True), backend) for n in lengths]
    tokens = [PROMPT[n] for n in lengths]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, min_p=0.02, seed=1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2),
    ]
    drawing = [Sampler(p) for p in params]
    drawn = backend.decode_sample(tokens, states, drawing)
    logits = backend.forward_batch([[t] for t in tokens], twins, all_logits=False)
    assert drawn == backend.sample_batch(torch.cat(logits), [Sampler(p) for p in params])
    assert [s.step for s in drawing] == [1, 1, 1]
    for state, twin in zip(states, twins, strict=True):
        assert state.tokens == twin.tokens and torch.equal(state.logits, twin.logits)
