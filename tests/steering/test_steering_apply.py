"""Steering applied through the forward pass's hooks, on the reference backend and the tiny model.

The direction is a basis vector e_k in every layer, so what the hook must do is known without the
formula: at F = 1 the sublayer output's column k becomes exactly 0, at F = -1 it doubles, and every
other column is untouched.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.session.session import Session
from dwarfstar.session.throttle import throttle
from dwarfstar.steering.apply import SteeredBackend, steering_of
from dwarfstar.steering.direction import Direction, SteeringScale

PROMPT = torch.randint(3, 120000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
K = 5  # the steered hidden dimension


@pytest.fixture(scope="module")
def reference(tiny_model_file):
    return load_engine(EngineSpec(tiny_model_file(4), backend="reference", qat=False)).backend


def basis_direction(args) -> Direction:
    vectors = torch.zeros(args.n_layers, args.dim)
    vectors[:, K] = 1.0
    return Direction(vectors, "ffn_out")


@pytest.fixture
def steered(reference):
    backend = SteeredBackend(reference, basis_direction(reference.args), SteeringScale(ffn=1.0))
    yield backend
    backend.detach()


def outputs_around_steering(backend: SteeredBackend, point: str) -> tuple[list, list]:
    """Hooks ahead of and behind the steering hook: each layer's output before and after it."""
    before, after = [], []
    hooks = backend.model.hooks[point]
    first = lambda il, out, batch: before.append(out.clone())  # noqa: E731
    last = lambda il, out, batch: after.append(out.clone())  # noqa: E731
    hooks.insert(0, first)
    hooks.append(last)
    return before, after


@pytest.mark.parametrize("scale", [1.0, -1.0, 0.25])
@pytest.mark.parametrize("point", ["ffn_out", "attn_out"])
def test_hook_scales_the_component_along_the_direction(steered, point, scale):
    steered.steering.stage([SteeringScale(**{point.split("_")[0]: scale})], [len(PROMPT)])
    hooks = steered.model.hooks[point]
    before, after = outputs_around_steering(steered, point)
    try:
        steered.inner.forward(PROMPT, steered.new_state())
    finally:
        del hooks[0], hooks[-1]
    assert len(before) == len(after) == steered.args.n_layers
    for y, z in zip(before, after, strict=True):
        assert torch.equal(z[:, K], y[:, K] * (1 - scale))
        others = [i for i in range(y.shape[1]) if i != K]
        assert torch.equal(z[:, others], y[:, others])


def test_default_scale_changes_the_logits_and_zero_does_not(reference):
    plain = reference.forward(PROMPT, reference.new_state())  # before any hook is on the model
    steered = SteeredBackend(reference, basis_direction(reference.args), SteeringScale(ffn=1.0))
    try:
        assert (steered.forward(PROMPT, steered.new_state()) - plain).abs().max() > 0.1
        steered.steering.default = SteeringScale()
        assert torch.equal(steered.forward(PROMPT, steered.new_state()), plain)
    finally:
        steered.detach()


def test_each_session_keeps_its_scale_in_a_batched_step(steered):
    scales = [SteeringScale(ffn=2.0), SteeringScale(), SteeringScale(ffn=-1.5, attn=0.5)]
    sessions = [Session(steered, ctx=64) for _ in scales]
    for session, scale in zip(sessions, scales, strict=True):
        steered.assign(session, scale)
        session.prefill(PROMPT[:6])
    alone = []
    for session in sessions:
        copy = Session(steered, ctx=64)
        steered.assign(copy, steered.scale_of(session.state))
        copy.prefill(PROMPT[:7])
        alone.append(copy.state.logits)
    batched = steered.forward_batch([[PROMPT[6]]] * 3, [s.state for s in sessions])
    for got, want in zip(batched, alone, strict=True):
        assert torch.allclose(got[-1], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])


def test_scale_follows_the_session_across_a_cut(steered):
    session = Session(steered, ctx=64, chunk=4)
    steered.assign(session, SteeringScale(ffn=-2.0))
    session.prefill(PROMPT)
    full = session.state.logits.clone()
    session.truncate(5)  # the state is rebuilt: the session, not the state, holds the setting
    session.prefill(PROMPT[5:])
    assert torch.allclose(session.state.logits, full, rtol=1e-5, atol=1e-5)
    assert steered.scale_of(session.state) == SteeringScale(ffn=-2.0)


def test_throttled_steered_backend_still_steers(reference, steered):
    paced = throttle(steered, 50)
    assert steering_of(paced) is steered
    assert torch.equal(paced.forward(PROMPT, paced.new_state()), steered.forward(PROMPT, steered.new_state()))


def test_detach_restores_the_plain_forward(reference):
    plain = reference.forward(PROMPT, reference.new_state())
    backend = SteeredBackend(reference, basis_direction(reference.args), SteeringScale(ffn=3.0))
    assert backend.detach() is reference
    assert all(not hooks for hooks in reference.hooks.values())
    assert torch.equal(reference.forward(PROMPT, reference.new_state()), plain)


def test_a_layer_range_applies_its_own_rows(steered):
    """A pipeline stage runs `run_layers(first, last)`: the hooks get global layer indices, so two
    stages together steer exactly as one pass does."""
    rows = torch.randn(steered.args.n_layers, steered.args.dim, generator=torch.Generator().manual_seed(1))
    per_layer = SteeredBackend(steered.inner, Direction(rows / rows.norm(dim=-1, keepdim=True)), SteeringScale(2, 1))
    steered.steering.stage([SteeringScale()], [len(PROMPT)])  # only the per-layer direction acts
    try:
        whole = per_layer.forward(PROMPT, per_layer.new_state())
        model = per_layer.model
        batch = model.batch([PROMPT], [per_layer.new_state()])
        split = model.args.n_layers // 2
        h = model.run_layers(model.run_layers(model.embed(batch), batch, 0, split), batch, split)
        staged = model.ops.logits(model.head(h, batch, all_positions=True)[0], batch)
        assert torch.equal(staged, whole)
    finally:
        per_layer.detach()


def test_decode_sized_calls_read_one_buffer_written_in_place(steered):
    """A captured CUDA graph replays the hook's reads from fixed addresses: for every call of decode
    size, uniform or mixed, the scales must land in the same buffer the capture saw."""
    from dwarfstar.steering.apply import ROW_CAPACITY

    steering = steered.steering
    steering.stage([SteeringScale(ffn=1.0)], [1])
    buffer = steering._current["ffn_out"]
    for scales, lengths in [([SteeringScale(ffn=-2.0)], [1]), ([SteeringScale(ffn=0.5), SteeringScale()], [1, 1])]:
        steering.stage(scales, lengths)
        assert steering._current["ffn_out"] is buffer
        assert buffer[: len(lengths)].tolist() == [s.ffn for s in scales]
    steering.stage([SteeringScale(ffn=3.0)], [ROW_CAPACITY + 1])  # a prefill chunk: eager, its own array
    assert steering._current["ffn_out"] is not buffer and steering._current["ffn_out"].shape == (ROW_CAPACITY + 1,)
