"""The reference backend's decode step runs attention and the compressors for all its sequences at
once (padded to the longest); it must leave each sequence exactly where running its tokens in one
prefill chunk (the per-sequence path) does: the same next-token logits, raw ring, compressed rows
and frontiers, over positions that fill the ring and finish ratio-4 and ratio-128 windows."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.loader import open_model

PROMPT = torch.randint(3, 120000, (140,), generator=torch.Generator().manual_seed(5)).tolist()
STARTS = [3, 61, 125]  # the third crosses 128: its ratio-128 window finishes during the steps
STEPS = 6


@pytest.fixture(scope="module")
def model_file(tiny_model_file):
    return tiny_model_file(0)


@pytest.mark.parametrize("kv_slots", [4, 1], ids=["one block", "a block each"])
def test_a_batched_decode_step_leaves_each_sequence_as_one_prefill_does(model_file, kv_slots, close_arrays) -> None:
    """QAT off: its FP8 rounding turns fp32 noise between a chunk and a step into whole steps of
    the rounding grid (already so for a sequence decoded alone), which would hide a real error."""
    model = ReferenceModel(open_model(model_file), qat=False, kv_slots=kv_slots)
    assert any(spec.compress_ratio == 128 for spec in model.args.layers)
    states = [model.new_state() for _ in STARTS]
    assert (len({s.block for s in states}) == 1) == (kv_slots == 4)
    for state in states:  # rows not written yet are uninitialised memory: make reading one show
        for il in range(model.args.n_layers):
            for name, array in state.parts(il).items():
                if name == "raw":
                    state.part(il, name).fill_(float("nan"))
                elif name.endswith("_rows"):  # the block's row pool, every page of it
                    array.fill_(float("nan"))
    for n, state in zip(STARTS, states, strict=True):
        model.forward(PROMPT[:n], state, all_logits=False)
    stepped = []
    for step in range(STEPS):
        stepped.append(model.forward_batch([[PROMPT[n + step]] for n in STARTS], states))
    for i, (n, state) in enumerate(zip(STARTS, states, strict=True)):
        alone = model.new_state()
        want = model.forward(PROMPT[: n + STEPS], alone)  # one chunk: attention per sequence
        for step in range(STEPS):
            assert close_arrays(stepped[step][i], want[n + step : n + step + 1]), f"sequence {i}, step {step}"
        assert state.pos == alone.pos == n + STEPS
        for il in range(model.args.n_layers):
            got, expect = state.host_parts(il), alone.host_parts(il)
            assert got.keys() == expect.keys()
            for name in got:
                assert close_arrays(got[name], expect[name]), f"sequence {i}, layer {il}, {name}"
