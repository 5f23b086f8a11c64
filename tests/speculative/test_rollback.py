"""Rollback: after a rejection the state is the state of a run that never saw the rejected tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PROMPT
from spec_support import payload, speculative

from dwarfstar.engine import load_engine
from dwarfstar.session.sampling import GREEDY
from dwarfstar.speculative.mtp import load_draft

LONG = torch.randint(3, 120000, (140,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize(
    ("before", "kept", "rejected"),
    [
        (124, 3, 5),  # the rejected tokens end the ratio-128 window (position 127) and emit its row
        (122, 8, 5),  # the kept tokens cross position 128, the rejected ones fill the next window
        (125, 1, 4),  # one kept token: plain decoding's step, the ring wrapped by the rejected ones
    ],
)
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

    clean = backend.new_state()
    backend.forward(prefix, clean, all_logits=False)
    backend.forward(good, clean, all_logits=False)
    assert payload(spec, backend) == payload(clean, backend)


def test_draft_window_holds_only_true_rows(mtp_files):
    """The MTP block's own window after speculation (its drafted rows rolled back) equals that of a
    draft fed the target's streams of the final sequence, pair by pair. Without the QAT rounding:
    the two feeds batch differently, and the FP8 rounding turns float noise into whole steps."""
    engine = load_engine(mtp_files["nextn"], "reference", qat=False, ctx=1024)
    draft = load_draft(engine.backend, engine.model)
    spec = speculative(engine.backend, draft, PROMPT, 3)
    list(spec.generate(40, GREEDY))
    tokens = spec.session.tokens
    assert spec.draft_state.pos == len(tokens) - 1  # the last row waits for the next token

    _, streams = engine.backend.forward_streams(tokens, engine.backend.new_state())
    fresh = draft.new_state()
    draft.rows(streams[:-1], tokens[1:], fresh)
    got, want = spec.draft_state.host_parts(0)["raw"], fresh.host_parts(0)["raw"]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
