"""The host side of a captured decode step (`graphs.DecodeGraphs.step`), without running the model.

The graph is stood in for by a replay that records the input buffers it finds and writes logits and
drawn tokens computed from them, so what is checked is what reaches the device: each row's token,
position and slot and its sampler's knobs, whether the step took the plan the previous step made
for it (the same sequences one position on) or made its own. The staging buffers run on unpinned
CPU memory here, with events that check that a buffer is never refilled while its copy may run.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton import graphs
from dwarfstar.backends.triton.backend import TritonBackend
from dwarfstar.backends.triton.kernels.sampling import knob_rows
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams

VOCAB = 1000  # the stand-in's logits: token + pos at a row's own column, so every row is told apart


class Replays:
    """`_capture`'s stand-in: each replay records (inputs, knobs) and draws token = f(inputs, knobs)."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(self, bucket: int, bounds: tuple[int, ...], k: int) -> graphs._Captured:
        inputs = torch.zeros(3, bucket, dtype=torch.int32)
        knobs = torch.zeros(bucket, 6)
        drawn = torch.zeros(2, bucket, dtype=torch.int32)
        logits = torch.zeros(bucket, VOCAB)

        def replay() -> None:
            self.seen.append((inputs.clone(), knobs.clone()))
            logits.zero_()
            logits[torch.arange(bucket), (inputs[0] + inputs[1]) % VOCAB] = 1.0
            drawn[0] = (inputs[0] * 7 + knobs.view(torch.int32)[:, 5]) % VOCAB  # token * 7 + the draw counter
            drawn[1] = 0

        return graphs._Captured(replay, logits, inputs, knobs, drawn)


class InFlight:
    """A CUDA event's stand-in on one staging buffer: what was queued must be unchanged when waited on."""

    def __init__(self, staging: graphs._Staging) -> None:
        self.staging, self.queued = staging, None

    def record(self) -> None:
        self.queued = self.staging.rows.clone()

    def synchronize(self) -> None:
        assert self.queued is None or torch.equal(self.queued, self.staging.rows), "refilled in flight"


@pytest.fixture
def buckets(tiny_model_file, monkeypatch):
    backend = TritonBackend.from_model_file(open_model(tiny_model_file(0)), device="cpu", graphs=False, kv_slots=4)
    decode = graphs.DecodeGraphs(backend)
    replays = Replays()
    monkeypatch.setattr(decode, "_capture", replays.capture)
    plans = []
    monkeypatch.setattr(decode, "_plan", lambda states, samplers: plans.append(1) or plan(states, samplers))
    plan = graphs.DecodeGraphs._plan.__get__(decode)
    real = graphs._Staging.__init__

    def watched(self, bucket, pinned):
        real(self, bucket, pinned)
        self.sent = InFlight(self)

    monkeypatch.setattr(graphs._Staging, "__init__", watched)
    states = [backend.new_state() for _ in range(3)]
    for n, state in zip((5, 40, 130), states, strict=True):  # as after n tokens
        state.reserve(0, n)
        state.pos, state.tokens = n, [1] * n
    return decode, replays, plans, states


def expected_inputs(tokens, states, samplers, bucket, pad):
    """What the device must see: token, position and slot per row (spare rows: the padding slot at 0),
    and each sampler's knobs at its counter (spare rows greedy)."""
    spare = bucket - len(states)
    rows = torch.tensor([
        list(tokens) + [0] * spare, [s.pos for s in states] + [0] * spare, [s.index for s in states] + [pad] * spare
    ], dtype=torch.int32)  # fmt: skip
    if samplers is None:
        return rows, None
    params = [s.params for s in samplers] + [GREEDY] * spare
    return rows, knob_rows(params, [s.seed for s in samplers] + [0] * spare, [s.step for s in samplers] + [0] * spare)


def test_each_replay_sees_its_rows_and_knobs_whether_planned_ahead_or_not(buckets):
    decode, replays, plans, states = buckets
    samplers = [Sampler(SamplingParams(seed=i, temperature=0.5 + i, top_k=5 * i)) for i in range(3)]
    calls = [
        ([0, 1, 2], True), ([0, 1, 2], True), ([0, 1, 2], True),  # the same sequences: planned ahead
        ([2, 0], True), ([2, 0], False), ([2, 0], False),  # switched, then without samplers
        ([1], True), ([1], "withdrawn"), ([1], True),  # a counter taken back: the plan made ahead is stale
    ]  # fmt: skip
    planned = 0
    for order, sampled in calls:
        group = [states[i] for i in order]
        drawing = [samplers[i] for i in order] if sampled else None
        if sampled == "withdrawn":
            drawing[0].withdraw()
        tokens = [100 + s.pos % 50 for s in group]
        before = len(plans)
        bucket = next(b for b in (1, 2, 4) if b >= len(group))  # B rounded up to a power of two
        want_rows, want_knobs = expected_inputs(tokens, group, drawing, bucket, decode.pad.index)
        counters = None if drawing is None else [s.step for s in drawing]
        positions = [s.pos for s in group]
        logits, drawn = decode.step(tokens, group, drawing)
        rows, knobs = replays.seen[-1]
        assert torch.equal(rows, want_rows)
        if want_knobs is not None:
            assert torch.equal(knobs, want_knobs)
        planned += len(plans) - before == 1  # only the next step's plan was made: this one was ready
        for state, token, pos, row in zip(group, tokens, positions, logits, strict=True):
            assert state.pos == pos + 1 and state.tokens[-1] == token and torch.equal(state.logits, row[0])
            assert int(row[0].argmax()) == (token + pos) % VOCAB
        if drawing is None:
            assert drawn is None
        else:
            assert drawn == [(t * 7 + c) % VOCAB for t, c in zip(tokens, counters, strict=True)]
            assert [s.step for s in drawing] == [c + 1 for c in counters]
    assert planned == 4  # the 2nd and 3rd steps, the 2nd without samplers, and the step after the withdrawal
