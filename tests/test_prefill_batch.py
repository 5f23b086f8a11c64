"""`prefill_batch`: prompt pieces of several sessions in one batched forward leave each session as its
own `prefill` does (logits, KV parts, checkpoints), and a piece that crosses its session's next chunk
boundary is refused before any state changes."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.session.session import Session, prefill_batch

PROMPT = torch.randint(3, 120000, (200,), generator=torch.Generator().manual_seed(9)).tolist()
CHUNK = 64


@pytest.fixture(scope="module")
def backend(tiny_model_file):
    return ReferenceModel(open_model(tiny_model_file(0)), qat=False, kv_slots=4)


def test_a_batched_prefill_leaves_each_session_as_its_own_prefill_does(backend, close_arrays) -> None:
    # three sessions at different points of their chunks; the second piece ends on its chunk boundary
    starts, pieces = [0, 40, 130], [PROMPT[:30], PROMPT[40:64], PROMPT[130:160]]
    batched = [Session(backend, ctx=1024, chunk=CHUNK) for _ in starts]
    alone = [Session(backend, ctx=1024, chunk=CHUNK) for _ in starts]
    for n, b, a in zip(starts, batched, alone, strict=True):
        if n:
            b.prefill(PROMPT[:n])
            a.prefill(PROMPT[:n])
    prefill_batch(batched, pieces)
    for piece, b, a in zip(pieces, batched, alone, strict=True):
        a.prefill(piece)
        assert b.tokens == a.tokens and close_arrays(b.logits, a.logits)
        assert [c.pos for c in b._checkpoints] == [c.pos for c in a._checkpoints]
        for il in range(backend.args.n_layers):
            got, want = b.state.host_parts(il), a.state.host_parts(il)
            assert got.keys() == want.keys() and all(close_arrays(got[k], want[k]) for k in want)
    assert 64 in [c.pos for c in batched[1]._checkpoints]


def test_a_piece_across_a_chunk_boundary_is_refused_before_anything_runs(backend) -> None:
    sessions = [Session(backend, ctx=1024, chunk=CHUNK) for _ in range(2)]
    sessions[1].prefill(PROMPT[:60])
    with pytest.raises(DwarfStarError, match="crosses the checkpoint boundary"):
        prefill_batch(sessions, [PROMPT[:10], PROMPT[60:70]])  # the second is 6 tokens from its boundary
    assert [len(s.tokens) for s in sessions] == [0, 60]
