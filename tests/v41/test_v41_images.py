"""Image blocks in DeepSeek V4.1's forward (issues 33 and 34): a block's rows replace the embedding at
its positions, the Engram gate is shut there (and the n-gram look-back stops at it), and the router
selects with the image bias `exp_probs_b_vl`; the block attends causally. Checked against the
single-pass restatement of tests/v41/test_v41_forward.py, on every backend that runs V4.1 here."""

from __future__ import annotations

import pytest
import torch
from test_v41_forward import PROMPT, restate
from v41_restate import roundings_recorded, roundings_taken

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import ImageSpan, content_ids

AT, LENGTH = 9, 7  # the block's first position and length


@pytest.fixture(scope="module")
def model(v41_tiny):
    return v41_tiny


@pytest.fixture(scope="module")
def block(model) -> tuple[list[int], torch.Tensor]:
    """A prompt with one image block (its content ids) and the block's rows."""
    ids = content_ids(b"\x01" * 32, LENGTH, model.args.vocab_size)
    rows = torch.randn(LENGTH, model.args.dim, generator=torch.Generator().manual_seed(5))
    return [*PROMPT[:AT], *ids, *PROMPT[AT:30]], rows


def test_a_block_equals_the_restatement(model, block):
    tokens, rows = block
    backend = ReferenceModel41.from_file(model, 0)
    with roundings_recorded() as roundings:
        got = backend.forward(tokens, backend.new_state(), all_logits=False, images=[ImageSpan(AT, rows)])[-1]
    with roundings_taken(roundings):
        want, _ = restate(model, tokens, {AT: rows})
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4 and int(got.argmax()) == int(want.argmax())
    # the image rules matter here: the same rows at text ids (text routing, an open Engram gate) differ
    text_routes, _ = restate(model, tokens[:AT] + PROMPT[AT : AT + LENGTH] + tokens[AT + LENGTH :], {AT: rows})
    assert float((text_routes - want).abs().max()) > 1e-3


def test_a_block_in_any_calls_gives_the_one_call_logits(model, block):
    tokens, rows = block
    backend = ReferenceModel41.from_file(model, 0)
    whole = backend.forward(tokens, backend.new_state(), all_logits=False, images=[ImageSpan(AT, rows)])[-1]
    state = backend.new_state()
    backend.forward(tokens[:4], state, all_logits=False)
    backend.forward(tokens[4:20], state, all_logits=False, images=[ImageSpan(AT - 4, rows)])
    split = backend.forward(tokens[20:], state, all_logits=False)[-1]
    assert torch.equal(split, whole)
    per_token = backend.forward(tokens, backend.new_state(), all_logits=True, images=[ImageSpan(AT, rows)])
    assert torch.allclose(per_token[-1], whole, rtol=1e-5, atol=1e-5)


def test_bad_blocks_are_refused_before_the_state_changes(model, block):
    tokens, rows = block
    backend = ReferenceModel41.from_file(model, 0)
    state = backend.new_state()
    with pytest.raises(DwarfStarError, match="attends causally"):
        backend.forward(tokens, state, images=[ImageSpan(AT, rows, attend=(0, LENGTH - 1))])
    with pytest.raises(DwarfStarError, match="hidden size"):
        backend.forward(tokens, state, images=[ImageSpan(AT, rows[:, :8])])
    with pytest.raises(DwarfStarError, match="not an image id"):
        backend.forward(tokens, state, images=[ImageSpan(AT - 1, rows)])
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        backend.forward(tokens, state)  # image ids without their block
    assert state.pos == 0
