"""The session layer over several DeepSeek V4.1 sequences (issue 33): batched prefill and decode of
sessions at different positions, forks, snapshots, truncation and rebuilds each leave a sequence with
exactly the logits it gets alone (the reference's forward is exact under any split: test_v41_forward)."""

from __future__ import annotations

import copy

import pytest
import torch

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session, decode_batch, prefill_batch

CTX, CHUNK = 256, 8
PROMPT = [(7919 * i + 101) % 120000 for i in range(21)]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def backend(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=CTX)).backend


def alone(backend, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens` of a fresh sequence, in one forward call."""
    return backend.forward(tokens, backend.new_state(), all_logits=False)[0]


def session_at(backend, n: int) -> Session:
    session = Session(backend, ctx=CTX, chunk=CHUNK)
    if n:
        session.prefill(PROMPT[:n])
    return session


def test_batched_prefill_and_decode_at_different_positions_equal_each_sequence_alone(backend):
    starts = [3, 8, 13]  # inside a chunk, on a boundary, inside the next
    sessions = [session_at(backend, n) for n in starts]
    pieces = [PROMPT[3:8], PROMPT[8:11], PROMPT[13:16]]  # the first ends on its chunk boundary
    prefill_batch(sessions, pieces)
    assert [s.state.pos for s in sessions] == [8, 11, 16] and 8 in sessions[0].checkpoints
    for s in sessions:
        assert torch.equal(s.logits, alone(backend, s.tokens))
    for token in (5, 17):
        decode_batch(sessions, [token] * 3)
        for s in sessions:
            assert torch.equal(s.logits, alone(backend, s.tokens))
    greedy = [Sampler(GREEDY) for _ in sessions]
    drawn = decode_batch(sessions, [9] * 3, greedy)  # a step that also draws each one's next token
    assert drawn == [int(alone(backend, s.tokens).argmax()) for s in sessions]


def test_a_forked_session_and_its_source_go_on_apart(backend):
    source = session_at(backend, 17)
    fork = copy.deepcopy(source, memo={id(backend): backend})  # the server pool's fork
    assert fork.checkpoints == source.checkpoints == [8, 16]
    source.prefill([4, 4])
    fork.truncate(12)  # from its own checkpoint 8, replaying 4 tokens
    fork.prefill([6])
    assert torch.equal(source.logits, alone(backend, PROMPT[:17] + [4, 4]))
    assert torch.equal(fork.logits, alone(backend, PROMPT[:12] + [6]))
    assert source.tokens == PROMPT[:17] + [4, 4]


def test_snapshot_restore_and_rebuild(backend):
    session = session_at(backend, 10)
    snap = session.snapshot()
    want = list(session.generate(3, GREEDY))
    session.restore(snap)
    assert session.tokens == PROMPT[:10] and torch.equal(session.logits, alone(backend, PROMPT[:10]))
    assert list(session.generate(3, GREEDY)) == want  # the same continuation again
    session.rebuild(11)  # recomputed from a checkpoint before its last token
    assert session.tokens == PROMPT[:10] + want[:1]
    assert torch.equal(session.logits, alone(backend, PROMPT[:10] + want[:1]))
    session.rebuild(0)
    assert session.tokens == [] and session.logits is None


def test_a_batch_with_a_bad_sequence_changes_none(backend):
    sessions = [session_at(backend, 4), session_at(backend, 6)]
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        decode_batch(sessions, [3, backend.args.vocab_size])
    assert [s.state.pos for s in sessions] == [4, 6]
    assert torch.equal(sessions[0].logits, alone(backend, PROMPT[:4]))
