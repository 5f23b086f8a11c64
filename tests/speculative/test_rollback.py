"""Rollback: after a rejection the state is the state of a run that never saw the rejected tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PROMPT
from spec_support import payload, speculative

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.sampling import GREEDY
from dwarfstar.speculative.mtp import load_draft
from dwarfstar.speculative.rollback import CompressorTap, truncate

LONG = torch.randint(3, 120000, (140,), generator=torch.Generator().manual_seed(5)).tolist()


CASES = [
    (124, 3, 5),  # the rejected tokens end the ratio-128 window (position 127) and emit its row
    (122, 8, 5),  # the kept tokens cross position 128, the rejected ones fill the next window
    (125, 1, 4),  # one kept token: plain decoding's step, the ring wrapped by the rejected ones
]
# the window is 8: a pass of at most 8 tokens can be truncated in place
TRUNCATE_CASES = [
    (124, 3, 5),
    (126, 1, 2),  # the ratio-4 window in progress (124..127) pooled and cleared by the rejected tokens
    (121, 2, 6),  # the kept tokens end mid ratio-4 window, the rejected ones complete two rows and position 128
    (129, 1, 1),  # N=1 after the boundary: the rejected token only adds a frontier slot
]


def clean_state(backend, prefix: list[int], good: list[int]):
    clean = backend.new_state()
    backend.forward(prefix, clean, all_logits=False)
    backend.forward(good, clean, all_logits=False)
    return clean


def truncated_state(backend, prefix: list[int], good: list[int], bad: list[int]):
    state = backend.new_state()
    backend.forward(prefix, state, all_logits=False)
    snap = state.snapshot()
    with CompressorTap(backend) as tap:
        logits = backend.forward(good + bad, state)
    assert "compress" not in vars(backend.ops)  # the tap is gone after the pass
    truncate(backend, state, snap, tap.of(slice(0, len(good + bad))), good, logits)
    return state


def assert_truncated_like(state, clean, start: int, n_layers: int) -> None:
    """`state` holds what `clean` holds: bit for bit where no kept token computed it (the ring rows of
    the positions before `start`, those the rejected tokens overwrote included, and the compressed
    rows before start), the same empty frontier slots (gate -inf), and within float noise where the
    kept tokens were computed: in a longer pass, whose MoE groups rows by expert, and the CPU's
    matrix kernels round by the number of rows."""
    old = start - (state.pos - state.cache.args.window)  # ring rows, oldest first, before `start`
    for il in range(n_layers):
        got, want = state.host_parts(il), clean.host_parts(il)
        assert got.keys() == want.keys()
        assert np.array_equal(got["raw"][:old], want["raw"][:old])
        for kind, spec in state.cache.compressors[il].items():
            before = start // spec.ratio
            assert np.array_equal(got[f"{kind}_rows"][:before], want[f"{kind}_rows"][:before])
            assert np.array_equal(np.isinf(got[f"{kind}_gate"]), np.isinf(want[f"{kind}_gate"]))
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"layer {il} {name}")


@pytest.mark.parametrize(("before", "kept", "rejected"), TRUNCATE_CASES)
def test_truncate_is_the_run_without_rejected_tokens(engines, backend_name, before, kept, rejected):
    """The rollback speculation uses, with no token run again: the state, its next-token logits and
    its continuation are those of a run that never saw the rejected tokens."""
    backend = engines(backend_name).backend
    prefix, good = LONG[:before], LONG[before : before + kept]
    bad = [t + 1 for t in LONG[before + kept : before + kept + rejected]]
    state = truncated_state(backend, prefix, good, bad)
    clean = clean_state(backend, prefix, good)
    assert state.pos == clean.pos and state.tokens == clean.tokens
    assert_truncated_like(state, clean, before, backend.args.n_layers)
    torch.testing.assert_close(state.logits, clean.logits, rtol=1e-4, atol=1e-4)
    after = LONG[before + kept : before + kept + 3]
    backend.forward(after, state, all_logits=False)
    backend.forward(after, clean, all_logits=False)
    assert_truncated_like(state, clean, before, backend.args.n_layers)


@pytest.mark.parametrize(("before", "kept", "rejected"), CASES)
def test_restore_and_rerun_is_the_run_without_rejected_tokens(engines, backend_name, before, kept, rejected):
    backend = engines(backend_name).backend
    prefix, good = LONG[:before], LONG[before : before + kept]
    bad = [t + 1 for t in LONG[before + kept : before + kept + rejected]]

    spec = backend.new_state()
    backend.forward(prefix, spec, all_logits=False)
    snap = spec.snapshot()
    backend.forward(good + bad, spec)
    spec.restore(snap)
    backend.forward(good, spec, all_logits=False)

    clean = clean_state(backend, prefix, good)
    assert payload(spec, backend) == payload(clean, backend)


def test_draft_window_holds_only_true_rows(mtp_files):
    """The MTP block's own window after speculation (its drafted rows rolled back) equals that of a
    draft fed the target's streams of the final sequence, pair by pair. Without the QAT rounding:
    the two feeds batch differently, and the FP8 rounding turns float noise into whole steps."""
    engine = load_engine(EngineSpec(mtp_files["nextn"], "reference", qat=False, ctx=1024))
    draft = load_draft(engine.backend, engine.model)
    spec = speculative(engine.backend, draft, PROMPT, 3)
    list(spec.generate(40, GREEDY))
    tokens = spec.session.tokens
    assert spec.track.state.pos == len(tokens) - 1  # the last row waits for the next token

    _, streams = engine.backend.forward_streams(tokens, engine.backend.new_state())
    fresh = draft.new_state()
    draft.rows(streams[:-1], tokens[1:], fresh)
    got, want = spec.track.state.host_parts(0)["raw"], fresh.host_parts(0)["raw"]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
