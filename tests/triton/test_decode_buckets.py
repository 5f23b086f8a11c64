"""Decode steps by batch-size bucket (`graphs.DecodeGraphs`), with the graph replay stood in for.

CUDA graphs need a GPU; here `graphs.capture` is replaced by a stand-in whose replay reruns the
step's device work on the same input buffers, which is exactly what a graph replay does. What runs
for real is everything around it: the padding slot, the per-row token/position/slot inputs, the
row bounds and the host bookkeeping. Any set of sessions, in any order, at any positions, replays
the graph of its bucket, and each sequence gets the eager kernels' logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dwarfstar.backends.triton import graphs
from dwarfstar.backends.triton.backend import TritonBackend
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY, TOP_K_CAP, Sampler, SamplingParams

pytestmark = pytest.mark.whole_model  # tests/triton/conftest.py: no int32 overflow checks

LENGTHS = (5, 30, 131)  # inside the raw window, past a ratio-4 boundary, past the first ratio-128 row


def replaying(run, pool):
    out = run()
    return (lambda: out.copy_(run())), out


def test_any_sessions_replay_their_buckets_graph_and_match_the_eager_kernels(tiny_model_file, monkeypatch):
    monkeypatch.setattr(graphs, "capture", replaying)
    model = open_model(tiny_model_file(0))
    served = TritonBackend.from_model_file(model, device="cpu", graphs=False, kv_slots=4)
    buckets = graphs.DecodeGraphs(served)
    prompt = torch.randint(3, model.args.vocab_size, (max(LENGTHS),), generator=torch.Generator().manual_seed(2))
    mine = [served.new_state() for _ in LENGTHS]  # the first block: 3 sessions and the padding slot
    for n, state in zip(LENGTHS, mine, strict=True):
        served.forward(prompt[:n], state, all_logits=False)
    theirs = [copy.deepcopy(state) for state in mine]  # forks in a second block run the eager kernels
    assert buckets.serves(mine) and not buckets.serves(theirs[:1])

    def step(order: list[int]) -> None:
        tokens = [int(theirs[i].logits.argmax()) for i in order]
        got, _ = buckets.step(tokens, [mine[i] for i in order])
        for i, token, logits in zip(order, tokens, got, strict=True):
            want = served.forward([token], theirs[i], all_logits=False)
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
            assert mine[i].pos == theirs[i].pos and mine[i].tokens == theirs[i].tokens
            assert torch.equal(mine[i].logits, logits[0])

    step([0, 1, 2])  # bucket 4: three sequences and one padding row
    step([1])  # bucket 1
    step([2, 0])  # bucket 2, the sessions switched
    captured = len(buckets.captured)
    step([2, 1, 0])  # bucket 4 again, in another order and at later positions: the same graph
    step([0])
    assert len(buckets.captured) == captured == 3
    assert {bucket for bucket, _, _ in buckets.captured} == {1, 2, 4}


@pytest.mark.slow  # 11 minutes in the interpreter (a fifth of the suite): tools/gpu_check.sh and `nox -s slow`
def test_a_sampled_step_draws_inside_the_replay_what_the_sampler_draws_after_it(tiny_model_file, monkeypatch):
    """The sampling kernel runs in the captured step, on the knobs of whichever requests it serves:
    greedy rows and sampled rows (with and without top-k/top-p) get the tokens that sampling the
    eager step's logits with the same seeds gives, the greedy-only and mixed steps are captured
    apart, and a sampler's counter advances by one per step."""
    monkeypatch.setattr(graphs, "capture", replaying)
    model = open_model(tiny_model_file(0))
    served = TritonBackend.from_model_file(model, device="cpu", graphs=False, kv_slots=4)
    buckets = graphs.DecodeGraphs(served)
    prompt = torch.randint(3, model.args.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    mine = [served.new_state() for _ in range(3)]  # the first block: 3 sessions and the padding slot
    assert buckets.serves(mine)
    for n, state in zip((7, 21, 40), mine, strict=True):
        served.forward(prompt[:n], state, all_logits=False)
    theirs = [copy.deepcopy(state) for state in mine]
    mixes = [
        [GREEDY, GREEDY, GREEDY],
        [GREEDY, SamplingParams(seed=1, temperature=1.5, min_p=0.01), SamplingParams(seed=2, top_k=9, top_p=0.9)],
    ]
    for params in mixes * 2:
        tokens = [int(t.logits.argmax()) for t in theirs]
        drawing, checking = [Sampler(p) for p in params], [Sampler(p) for p in params]
        logits, drawn = buckets.step(tokens, mine, drawing)
        want = torch.cat([served.forward([t], s, all_logits=False) for t, s in zip(tokens, theirs, strict=True)])
        torch.testing.assert_close(torch.cat(logits), want, rtol=1e-4, atol=1e-4)
        # drawn from the step's own logits: a random model's near-tied logits may rank apart between
        # the batched and the eager kernels, which moves a sampled draw
        assert drawn == served.sample_batch(torch.cat(logits), checking)
        assert [s.step for s in drawing] == [1, 1, 1]
    assert sorted(k for _, _, k in buckets.captured) == [1, min(TOP_K_CAP, model.args.vocab_size)]
