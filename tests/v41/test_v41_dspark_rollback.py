"""Truncation of a V4.1 state after a rejected draft (`speculative/rollback_v41.py`) on `v41-tiny`: a pass
cut to each of its prefixes leaves the state a run of only that prefix builds, bit for bit (window rows,
compressed rows and index keys, ratio-2 frontiers on both sides of a group, tokens, logits), on the
reference and on MLX; speculation that truncates emits plain greedy's tokens and state without the
rerun's second pass; a pass longer than the window is refused and reruns instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_v41_dspark import Scripted  # a drafter of the known greedy text, wrong at every third position

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.model.synthetic_v41 import V41_TINY
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator
from dwarfstar.speculative.dspark_v41 import DSparkDraft41, LocalRunner41
from dwarfstar.speculative.rollback_v41 import frontiers, truncate41

CTX, CHUNK = 256, 8
PROMPT = [(7919 * i + 101) % 120000 for i in range(13)]  # odd: ends inside a ratio-2 group, past the window
PASS = [311, 4027, 99, 5, 777]  # a verifying pass of 5, at an odd and at an even start
N = 12


@pytest.fixture(scope="module")
def model(v41_tiny):
    return v41_tiny


def reference(model):
    return ReferenceModel41.from_file(model, 1 << 20, CTX)


def mlx(model):
    pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")
    from dwarfstar.backends.mlx.v41.backend import MLXModel41

    return MLXModel41.from_file(model, 1 << 20, CTX)


def values(state) -> dict:
    """Every part of a state as host arrays."""
    parts = {"tokens": list(state.tokens), "logits": state.logits.numpy()}
    for name in ("windows", "rows", "index_keys"):
        parts |= {f"{name}.{il}": state.host(a) for il, a in getattr(state, name).items()}
    for il, pair in state.frontiers.items():
        parts |= {f"frontier.{il}.{i}": state.host(a) for i, a in enumerate(pair)}
    return parts


def assert_same(got, want) -> None:
    got, want = values(got), values(want)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), key


@pytest.mark.parametrize("load", [reference, mlx])
@pytest.mark.parametrize("prefix", [PROMPT, PROMPT[:-1]], ids=["odd-start", "even-start"])
def test_a_pass_truncated_to_each_prefix_is_that_prefixs_state(model, load, prefix):
    backend = load(model)
    ops, start = backend.transformer.ops, backend.new_state()
    backend.forward(prefix, start, all_logits=False)
    for kept in range(1, len(PASS) + 1):
        state, after, logits = start.snapshot(), [], []
        for token in PASS:  # the verifying pass, one token a call
            logits.append(backend.forward([token], state, all_logits=False)[0])
            after.append(frontiers(ops, state))
        truncate41(ops, state, start, after, kept, torch.stack(logits))
        want = start.snapshot()
        for token in PASS[:kept]:
            backend.forward([token], want, all_logits=False)
        assert_same(state, want)
        # and it goes on as that state does
        assert torch.equal(backend.forward([42], state)[0], backend.forward([42], want)[0])


def test_a_pass_longer_than_the_window_is_not_truncated(model):
    backend = ReferenceModel41.from_file(model, 1 << 20, CTX)
    runner, start = LocalRunner41(backend), backend.new_state()
    backend.forward(PROMPT, start, all_logits=False)
    assert runner.can_truncate(V41_TINY.window - 1, []) and not runner.can_truncate(V41_TINY.window, [])
    state = start.snapshot()
    backend.forward(PROMPT[: V41_TINY.window], state)
    with pytest.raises(ValueError, match="cannot truncate a pass of 8 tokens"):
        truncate41(backend.transformer.ops, state, start, [], 1, torch.zeros(8, 1))


def test_speculation_that_truncates_is_plain_greedy_without_a_second_pass(model, v41_dspark_file):
    backend = ReferenceModel41.from_file(model, 1 << 20, CTX)
    draft = DSparkDraft41(backend, model, v41_dspark_file)
    plain = Session(backend, ctx=CTX, chunk=CHUNK)
    plain.prefill(PROMPT)
    list(plain.generate(N, GREEDY))
    runs = {}
    for rollback in ("truncate", "rerun"):
        spec = Speculator(
            Session(backend, ctx=CTX, chunk=CHUNK), draft, 4, drafter=Scripted(plain.tokens), rollback=rollback
        )
        spec.prefill(PROMPT)
        assert list(spec.generate(N, GREEDY)) == plain.tokens[len(PROMPT) :]
        assert spec.stats.rollbacks and sum(spec.stats.accepted) > spec.stats.steps  # partly accepted steps
        runs[rollback] = spec
    assert_same(runs["truncate"].state, plain.state)
    assert_same(runs["rerun"].state, plain.state)
    # the rerun runs the kept tokens of every rejecting step again; truncation runs none
    computed = {name: spec.session.stats.computed for name, spec in runs.items()}
    assert computed["truncate"] < computed["rerun"], computed
