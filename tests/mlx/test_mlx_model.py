"""The MLX backend (portable path, built-in ops only) against the torch reference on the tiny model.

Tolerances, and why:
* QAT rounding off: nothing in the model is discontinuous, so the only difference is fp32
  summation order (MLX's BLAS against torch's): max error 1e-5 relative to the largest logit, the
  same bound the reference holds between its own one-pass and token-by-token runs.
* QAT rounding on (the real model): the FP8/FP4 roundings themselves are bit-exact
  (test_mlx_ops.py), but a value within fp32 noise of a rounding boundary can round the other way.
  On this prompt one raw KV row of layer 2 (position 244) does, which moves the next 8 queries,
  and what they feed, by up to 3.5e-3 (spec §9: two correct runs of the official code differ by up
  to 2.7e-4; the reference's own prefill and decode differ by 1e-3). A 60-position decode window
  holding that flip has a mean KL of 1.1e-6, above the spec's whole-run 1e-6. So: mean KL < 1e-5,
  no top-1 change except at near-ties (reference top-2 gap < 1e-2), max relative error < 1e-2.
  Dropping the rounding altogether moves this model by a mean KL of 1.3e-2 and 0.59 relative, so
  the bounds still catch a rounding applied in the wrong place by orders of magnitude.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.backends.mlx.parity import compare_logits
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.kvcache.payload import read_payload, write_payload
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.session.session import Session, decode_batch

PROMPT = torch.randint(3, 120000, (300,), generator=torch.Generator().manual_seed(7)).tolist()
PREFIX = 240  # decode the rest: crosses ratio-4 rows and the ratio-128 row completed at position 255
EXACT_REL = 1e-5
# QAT on, a value within fp32 noise of an FP8/FP4 rounding midpoint rounds the other way and moves
# what follows by a grid step; where the flips fall depends on the two summation orders. Against the
# reference's batch-invariant attention (issue 37), MLX's one-pass prefill measured a mean KL of
# 4.7e-5 and a worst row 0.12 relative (3 rows over 0.05), no top-1 change; dropping the rounding
# moves the tiny model by a mean KL of 1.4e-2 (tests/backends/test_conformance_logits.py).
QAT_KL, QAT_REL = 1e-4, 0.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return open_model(path)


@pytest.fixture(scope="module", params=[False, True], ids=["qat-off", "qat-on"])
def pair(request, tiny):
    """(reference, MLX model, reference logits after every prefix of PROMPT) with the same rounding switch."""
    reference = ReferenceModel(tiny, qat=request.param)
    return reference, MLXModel(tiny, qat=request.param), reference.forward(PROMPT, reference.new_state())


@pytest.fixture(scope="module")
def one_pass(pair):
    """The MLX logits after every prefix of PROMPT, from one pass."""
    model = pair[1]
    return model.forward(PROMPT, model.new_state())


def assert_parity(want: torch.Tensor, got: torch.Tensor, qat: bool) -> None:
    diff = compare_logits(want, got)
    if qat:
        assert diff.mean_kl < QAT_KL and diff.top1_mismatches == 0 and diff.max_rel < QAT_REL, diff
    else:
        assert diff.max_rel < EXACT_REL and diff.top1_agreement == 1.0, diff


def test_prefill_matches_reference(pair, one_pass):
    assert_parity(pair[2], one_pass, pair[0].qat)


def test_decode_steps_match_reference(pair):
    reference, model, want = pair
    state = model.new_state()
    last = model.forward(PROMPT[:PREFIX], state, all_logits=False)
    steps = [last] + [model.forward([t], state, all_logits=False) for t in PROMPT[PREFIX:]]
    assert_parity(want[PREFIX - 1 :], torch.cat(steps), reference.qat)
    assert torch.equal(state.logits, steps[-1][0]) and state.pos == len(PROMPT) and state.tokens == PROMPT


def test_chunked_prefill_equals_one_pass(pair, one_pass):
    """The MLX backend against itself: odd chunk sizes give the one-pass logits (to fp32 noise or a flip)."""
    reference, model, _ = pair
    state, parts, i = model.new_state(), [], 0
    for size in [3, 64, 1, 17, 128, 87]:
        parts.append(model.forward(PROMPT[i : i + size], state))
        i += size
    assert_parity(one_pass, torch.cat(parts), reference.qat)


def test_snapshot_restore_matches_reference(pair):
    """Rewinding to a snapshot and taking another branch gives the logits of that branch run afresh."""
    reference, model, want = pair
    state = model.new_state()
    model.forward(PROMPT[:PREFIX], state, all_logits=False)
    snap = state.snapshot()
    detour = torch.randint(3, 120000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    model.forward(detour, state)
    state.restore(snap)
    assert state.pos == PREFIX and state.tokens == PROMPT[:PREFIX]
    resumed = model.forward(PROMPT[PREFIX:], state)
    assert_parity(want[PREFIX:], resumed, reference.qat)
    fresh = model.new_state()
    model.forward(PROMPT[:PREFIX], fresh, all_logits=False)
    assert torch.equal(model.forward(PROMPT[PREFIX:], fresh), resumed)  # same ops, same order: bit-exact
    assert state.nbytes() == fresh.nbytes()


def test_state_layout_matches_reference(tiny):
    """Same shapes and row counts as the reference state, so payloads and byte counts agree."""
    reference, model = ReferenceModel(tiny, qat=False), MLXModel(tiny, qat=False)
    a, b = reference.new_state(), model.new_state()
    reference.forward(PROMPT[:150], a)
    model.forward(PROMPT[:150], b)
    assert a.nbytes() == b.nbytes()
    for il in range(tiny.args.n_layers):
        pa, pb = a.host_parts(il), b.host_parts(il)
        assert pa.keys() == pb.keys()
        for name in pa:
            assert pa[name].shape == pb[name].shape, name
            if name.endswith("_gate"):
                assert np.array_equal(np.isinf(pa[name]), np.isinf(pb[name]))
            else:
                assert np.allclose(pa[name], pb[name], atol=1e-4), name


def test_payload_round_trip_continues_identically(tiny):
    """A payload written from an MLX state, read back into another MLX slot, continues bit-exactly."""
    model = MLXModel(tiny, qat=True)
    state = model.new_state()
    model.forward(PROMPT[:PREFIX], state, all_logits=False)
    buf = io.BytesIO()
    write_payload(buf, state, model.args, ctx=1024, chunk=64)
    loaded = read_payload(buf.getvalue(), model.args, 1024, 64, model.new_state)
    assert torch.equal(loaded.logits, state.logits)
    assert torch.equal(model.forward(PROMPT[PREFIX:], loaded), model.forward(PROMPT[PREFIX:], state))


def test_session_truncate_and_batched_decode(tiny):
    """The session layer drives the MLX backend unchanged: exact truncation and batched decode."""
    model = MLXModel(tiny, qat=False)
    session = Session(model, ctx=1024, chunk=64)
    session.prefill(PROMPT[:200])
    session.truncate(150)
    fresh = Session(model, ctx=1024, chunk=64)
    fresh.prefill(PROMPT[:150])
    assert torch.equal(session.logits, fresh.logits)
    decode_batch([session, fresh], [PROMPT[150], PROMPT[151]])
    alone = Session(model, ctx=1024, chunk=64)
    alone.prefill(PROMPT[:150] + [PROMPT[151]])
    assert compare_logits(alone.logits[None], fresh.logits[None]).max_rel < EXACT_REL


def test_bad_input_is_a_clear_error(tiny):
    model = MLXModel(tiny, max_seq_len=16)
    state = model.new_state()
    model.forward(list(range(10)), state)
    with pytest.raises(ContextOverflowError, match="10 \\+ 7 tokens exceed the context of 16"):
        model.forward(list(range(7)), state)
    with pytest.raises(DwarfStarError, match="token id 129280 is outside the vocabulary"):
        model.forward([1, 129280], state)
    with pytest.raises(DwarfStarError, match="appears twice"):
        model.forward_batch([[1], [2]], [state, state])
    assert state.pos == 10  # the failed calls changed nothing


@pytest.mark.slow
def test_fused_primitives_match_eager(tiny):
    """The mx.compile'd primitives (the default on Metal) against eager ops, here on the CPU.

    Slow only the first time on a machine: MLX compiles each fused graph with the C++ compiler.
    """
    eager, fused = MLXModel(tiny, qat=True, fuse=False), MLXModel(tiny, qat=True, fuse=True)
    states = eager.new_state(), fused.new_state()
    for chunk in (PROMPT[:40], PROMPT[40:41], PROMPT[41:42]):
        a, b = (model.forward(chunk, state) for model, state in zip((eager, fused), states, strict=True))
        assert compare_logits(a, b).max_rel < 1e-5


def test_a_fork_in_the_block_shares_row_pages_and_both_continue_exactly(tiny):
    """With two slots to a block (as a server gives its sessions), a fork holds its parent's row
    pages; both then write past the fork (a page they share is copied by the first writer) and
    continue exactly as an unforked state does."""
    model = MLXModel(tiny, qat=False, kv_slots=3)
    parent, alone = model.new_state(), model.new_state()
    for state in (parent, alone):
        model.forward(PROMPT[:PREFIX], state, all_logits=False)
    twin = copy.deepcopy(parent)
    assert twin.block == parent.block and model.cache.pages_in_use() == 2 * 2  # 60 rows at ratio 4, 1 at 128
    want = model.forward(PROMPT[PREFIX:], alone)
    assert torch.equal(model.forward(PROMPT[PREFIX:], parent), want)
    assert torch.equal(model.forward(PROMPT[PREFIX:], twin), want)
