"""Greedy speculation emits exactly what plain greedy decoding emits: 300 tokens from a 20-token
prompt (the raw window of 8 wraps, position 128 ends the first ratio-128 window), on every backend
that runs here, with the MTP block drafting and with a scripted drafter whose steps accept all, some
or none of their drafts."""

from __future__ import annotations

import pytest
from conftest import PROMPT
from spec_support import ScriptedDrafter, first_gap, payload, plain_greedy, speculative

from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.speculative.decode import step_batch
from dwarfstar.speculative.mtp import load_draft

N_TOKENS = 300


@pytest.fixture(scope="module")
def plain(engines, backend_name):
    backend = engines(backend_name).backend
    return plain_greedy(backend, PROMPT, N_TOKENS)


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_scripted_drafts_change_nothing(engines, backend_name, plain, n_draft):
    engine = engines(backend_name)
    truth = plain.tokens
    spec = speculative(engine.backend, load_draft(engine.backend, engine.model), PROMPT, n_draft)
    spec.drafter = ScriptedDrafter(truth, wrong_every=5)
    got = list(spec.generate(N_TOKENS, GREEDY))
    assert first_gap(got, truth[len(PROMPT) :]) is None and len(got) == N_TOKENS
    assert spec.session.tokens == truth
    # the script made every kind of step happen: full acceptance, partial, and none
    accepted_first = spec.stats.accepted[0]
    assert 0 < accepted_first < spec.stats.drafted[0]
    if n_draft > 1:
        assert spec.stats.accepted[n_draft - 1] > 0


@pytest.mark.parametrize(("n_draft", "alignment", "rollback"), [(2, "next", "rerun"), (3, "same", "truncate")])
def test_mtp_drafts_change_nothing(engines, backend_name, plain, n_draft, alignment, rollback):
    """The random MTP block agrees with the random trunk almost never, so nearly every step rolls
    back. Rerun rollbacks leave the state plain decoding built, byte for byte. Truncated ones run no
    extra pass; their states equal plain decoding's within float rounding, which the FP8 rounding
    of the KV rows turns into whole steps here and there (test_rollback.py compares those states)."""
    engine = engines(backend_name)
    draft = load_draft(engine.backend, engine.model)
    spec = speculative(engine.backend, draft, PROMPT, n_draft, alignment=alignment, rollback=rollback)
    got = list(spec.generate(N_TOKENS, GREEDY))
    assert first_gap(got, plain.tokens[len(PROMPT) :]) is None and len(got) == N_TOKENS
    assert spec.stats.steps > 0 and sum(spec.stats.accepted) == 0  # every step rolled back
    assert spec.stats.rollbacks == spec.stats.drafted[0]  # every step that drafted
    if rollback == "rerun":
        assert payload(spec.session.state, engine.backend) == payload(plain.state, engine.backend)
    else:  # no extra pass: the prompt, each step's verified tokens, and the last token
        assert spec.session.stats.computed == len(PROMPT) + spec.stats.steps + sum(spec.stats.drafted) + 1


def test_stop_token_ends_inside_a_step(engines):
    """A stop token among accepted drafts ends generation there, kept in the state as plain decoding keeps it."""
    engine = engines("reference")
    truth = plain_greedy(engine.backend, PROMPT, 60).tokens
    stop = truth[len(PROMPT) + 40]
    want = truth[len(PROMPT) : truth.index(stop, len(PROMPT)) + 1]
    spec = speculative(engine.backend, load_draft(engine.backend, engine.model), PROMPT, 4)
    spec.drafter = ScriptedDrafter(truth, wrong_every=10**6)  # every draft right: steps end mid-way only at the stop
    got = list(spec.generate(N_TOKENS, GREEDY, stop_tokens=[stop]))
    assert got == want
    assert spec.session.tokens == PROMPT + want and spec.session.state.pos == len(PROMPT) + len(want)


def test_speculators_verified_in_one_pass(engines):
    """Two sequences speculating with different draft counts, verified together (as the server's
    batched decode runs them), each emit the plain greedy text; one of them ends earlier."""
    engine = engines("reference")
    truth = plain_greedy(engine.backend, PROMPT, 60).tokens
    draft = load_draft(engine.backend, engine.model)
    specs = [speculative(engine.backend, draft, PROMPT, n) for n in (2, 4)]
    for spec, wrong_every in zip(specs, (4, 7), strict=True):
        spec.drafter = ScriptedDrafter(truth, wrong_every)
    budgets = [60, 41]
    out = [[int(spec.state.logits.argmax())] for spec in specs]
    while live := [i for i in range(2) if len(out[i]) < budgets[i]]:
        emitted = step_batch(
            [specs[i] for i in live],
            [out[i][-1] for i in live],
            [Sampler(GREEDY)] * len(live),
            [budgets[i] - len(out[i]) for i in live],
            [lambda token: False] * len(live),
        )
        for i, emit in zip(live, emitted, strict=True):
            out[i] += emit
    for got, budget in zip(out, budgets, strict=True):
        assert got == truth[len(PROMPT) : len(PROMPT) + budget]
    for spec, got in zip(specs, out, strict=True):  # the state holds all but the pending token
        assert spec.session.tokens == PROMPT + got[:-1]
        assert spec.stats.rollbacks > 0 and sum(spec.stats.accepted) > 0
