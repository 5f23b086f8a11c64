"""Directional steering in every backend: F = 0 is bit-identical to no steering, F != 0 matches the
reference (QAT rounding off, so the tolerance is the fp32 summation order's, as in
test_conformance_logits.py), and sequences with different scales in one batched step each get their own.

The direction is random per layer (unit rows), and both hook points are steered, so a backend that
put the hook at the wrong place, on the wrong layer's row or with the wrong sign is far off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from conformance import PROMPT, REFERENCE, compare_logits

from dwarfstar.backends.protocol import Backend
from dwarfstar.session.session import Session
from dwarfstar.steering.apply import SteeredBackend
from dwarfstar.steering.direction import Direction, SteeringScale

EXACT_REL, EXACT_KL = 1e-5, 1e-8
PREFILL, DECODE_STEPS = 13, 2  # short: Triton's interpreter takes about a second per token
STEERED = SteeringScale(ffn=1.5, attn=-0.75)


def random_direction(args) -> Direction:
    rows = torch.randn(args.n_layers, args.dim, generator=torch.Generator().manual_seed(11))
    return Direction(rows / rows.norm(dim=-1, keepdim=True), "ffn_out")


@contextmanager
def steered(backend: Backend, scale: SteeringScale) -> Iterator[SteeredBackend]:
    """The shared, session-cached backend with the direction on; its hooks come off afterwards."""
    wrapped = SteeredBackend(backend, random_direction(backend.args), scale)
    try:
        yield wrapped
    finally:
        wrapped.detach()


def prefill_and_decode(backend) -> torch.Tensor:
    state = backend.new_state()
    logits = [backend.forward(PROMPT[:PREFILL], state)]
    logits += [backend.forward([t], state, all_logits=False) for t in PROMPT[PREFILL : PREFILL + DECODE_STEPS]]
    return torch.cat(logits).cpu()


def assert_exact_match(want: torch.Tensor, got: torch.Tensor, what: str) -> None:
    diff = compare_logits(want, got)
    assert diff.within(EXACT_REL, EXACT_KL, near_ties_may_swap=False), f"{what}: {diff}"


def test_zero_scale_is_bit_identical(kind, loaded):
    backend = loaded(kind, False)
    plain = prefill_and_decode(backend)
    with steered(backend, SteeringScale()) as zero:
        assert torch.equal(prefill_and_decode(zero), plain)


def test_steered_logits_match_the_reference(kind, loaded):
    with steered(loaded(REFERENCE, False), STEERED) as reference:
        want = prefill_and_decode(reference)
    plain = prefill_and_decode(loaded(REFERENCE, False))
    assert compare_logits(plain, want).max_rel > 1e-2  # the steering moves the logits well past the tolerance
    with steered(loaded(kind, False), STEERED) as backend:
        assert_exact_match(want, prefill_and_decode(backend), f"{kind.id} steered")


def batched_step(backend: SteeredBackend, scales: list[SteeringScale]) -> list[torch.Tensor]:
    """Two sessions prefilled at their own scales, then one batched step for both."""
    sessions = []
    for i, scale in enumerate(scales):
        session = Session(backend, ctx=64)
        backend.assign(session, scale)
        session.prefill(PROMPT[i : i + 6])
        sessions.append(session)
    out = backend.forward_batch([[PROMPT[40]], [PROMPT[41]]], [s.state for s in sessions])
    return [o.cpu() for o in out]


def test_per_session_scales_in_one_batch_match_the_reference(kind, loaded):
    scales = [STEERED, SteeringScale(ffn=-2.0)]
    with steered(loaded(REFERENCE, False), SteeringScale()) as reference:
        want = batched_step(reference, scales)
    with steered(loaded(kind, False), SteeringScale()) as backend:
        got = batched_step(backend, scales)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert_exact_match(w, g, f"{kind.id} batched sequence {i}")
