"""Sessions on the tiny model: every way of building a state gives the same next-token logits as one
uninterrupted run, over sequences that fill the raw window and cross compression boundaries."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.kvcache.payload import read_payload, write_payload
from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams, sample_batch
from dwarfstar.session.session import MAX_CHECKPOINTS, Cancelled, Session, decode_batch

PROMPT = torch.randint(3, 120000, (301,), generator=torch.Generator().manual_seed(11)).tolist()
TOL = 1e-5  # fp32 noise between differently batched matmuls, relative to the largest logit


@pytest.fixture(scope="module")
def model_path(tiny_model_file):
    return tiny_model_file(2)


@pytest.fixture(scope="module")
def backend(model_path):
    return ReferenceModel(open_model(model_path), qat=False)


@pytest.fixture(scope="module")
def reference_logits(backend):
    """Next-token logits after every prefix of PROMPT from one uninterrupted pass."""
    return backend.forward(PROMPT, backend.new_state())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a - b).abs().max() / b.abs().max()).item() < TOL


@pytest.mark.parametrize("chunk", [7, 64, 128, 4096])
def test_chunked_prefill_matches_one_pass(backend, reference_logits, chunk):
    session = Session(backend, ctx=1024, chunk=chunk)
    assert close(session.prefill(PROMPT), reference_logits[-1])
    assert session.stats.computed == len(PROMPT)


def test_prefill_then_decode(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=64)
    session.prefill(PROMPT[:250])
    for i in range(250, len(PROMPT)):
        assert close(session.decode(PROMPT[i]), reference_logits[i])


def test_snapshot_restore_continue(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=64)
    session.prefill(PROMPT[:200])
    snap = session.snapshot()
    session.prefill([9, 99, 999] * 20)  # wander off, crossing window and compression boundaries
    session.restore(snap)
    assert session.tokens == PROMPT[:200]
    assert close(session.prefill(PROMPT[200:]), reference_logits[-1])


def test_truncate_replays_exactly(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=64)
    session.prefill(PROMPT)
    for keep in (290, 257, 130, 3):
        computed = session.stats.computed
        session.truncate(keep)
        assert session.tokens == PROMPT[:keep]
        assert close(session.logits, reference_logits[keep - 1]), keep
        # replay starts from the last chunk checkpoint at or before `keep`
        assert session.stats.computed - computed == keep - (keep // 64) * 64
    assert close(session.prefill(PROMPT[3:]), reference_logits[-1])


def test_stale_snapshot_is_refused(backend):
    session = Session(backend, ctx=1024, chunk=64)
    session.prefill(PROMPT[:20])
    early = session.snapshot()
    session.prefill(PROMPT[20:200])
    late = session.snapshot()
    session.restore(early)
    session.prefill([5] * 100)  # overwrites the compressed rows `late` pointed at
    with pytest.raises(ValueError, match="no longer valid"):
        session.restore(late)


def test_saved_payload_loads_in_a_fresh_process(backend, model_path, reference_logits, tmp_path):
    session = Session(backend, ctx=1024, chunk=64)
    session.prefill(PROMPT[:260])
    with open(tmp_path / "s.dsv4", "wb") as f:
        write_payload(f, session.state, TINY, 1024, 64)
    script = f"""
import sys, torch
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY
from dwarfstar.kvcache.payload import read_payload
model = ReferenceModel(open_model({str(model_path)!r}), qat=False)
state = read_payload(open({str(tmp_path / "s.dsv4")!r}, "rb").read(), TINY, 1024, 64, model.new_state)
torch.save(model.forward({PROMPT[260:]!r}, state, all_logits=False), {str(tmp_path / "out.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert close(torch.load(tmp_path / "out.pt")[-1], reference_logits[-1])
    buf = io.BytesIO()
    write_payload(buf, session.state, TINY, 1024, 64)
    assert close(read_payload(buf.getvalue(), TINY, 1024, 64, backend.new_state).logits, reference_logits[259])


def test_context_overflow_is_a_clear_error_and_changes_nothing(backend):
    session = Session(backend, ctx=64, chunk=16)
    session.prefill(PROMPT[:60])
    with pytest.raises(ContextOverflowError, match="60 tokens in the session \\+ 5 new exceed the context of 64"):
        session.prefill(PROMPT[60:65])
    assert len(session.tokens) == 60
    assert len(list(session.generate(100, GREEDY))) == 4  # generation stops at the context limit


def test_cancel_between_chunks_leaves_a_usable_session(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=64)
    calls = []
    with pytest.raises(Cancelled, match="stopped after 128 of 301"):
        session.prefill(PROMPT, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert session.tokens == PROMPT[:128]
    assert close(session.prefill(PROMPT[128:]), reference_logits[-1])


def test_generation_is_deterministic_and_greedy_follows_argmax(backend):
    a, b = Session(backend, ctx=1024), Session(backend, ctx=1024)
    for s in (a, b):
        s.prefill(PROMPT[:50])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    assert list(a.generate(8, params)) == list(b.generate(8, params))
    greedy = Session(backend, ctx=1024)
    first = int(greedy.prefill(PROMPT[:50]).argmax())
    assert next(greedy.generate(1, GREEDY)) == first


class OwnSampling:
    """The tiny model with a sampler of its own, as the Triton backend has; records each call's rows."""

    def __init__(self, inner: ReferenceModel) -> None:
        self.inner, self.args, self.calls = inner, inner.args, []

    def new_state(self):
        return self.inner.new_state()

    def forward(self, tokens, state, all_logits=True, images=None):
        return self.inner.forward(tokens, state, all_logits, images=images)

    def forward_batch(self, token_lists, states, all_logits=False, images=None):
        return self.inner.forward_batch(token_lists, states, all_logits, images=images)

    def sample_batch(self, logits, samplers):
        self.calls.append((tuple(logits.shape), len(samplers)))
        return sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)


def test_generate_samples_through_the_backend_one_row_per_token(backend):
    own = OwnSampling(backend)
    params = SamplingParams(temperature=0.8, seed=9)
    sessions = [Session(own, ctx=1024), Session(backend, ctx=1024)]
    for s in sessions:
        s.prefill(PROMPT[:40])
    tokens = [list(s.generate(5, params)) for s in sessions]
    assert tokens[0] == tokens[1]  # the same rules and draws as the generic sampler
    assert own.calls == [((1, backend.args.vocab_size), 1)] * 5


def test_drawing_ahead_never_shifts_a_seeds_tokens(backend):
    """A decode step draws the token after it; when that token is never used (the caller stops),
    its draw is taken back, so stopping and going on gives the tokens of one uninterrupted call."""
    params = SamplingParams(temperature=1.5, min_p=0.0, seed=3)
    whole = Session(backend, ctx=1024)
    whole.prefill(PROMPT[:40])
    want = list(whole.generate(6, Sampler(params)))
    parts, sampler, got = Session(backend, ctx=1024), Sampler(params), []
    parts.prefill(PROMPT[:40])
    for _ in range(6):
        tokens = parts.generate(3, sampler)
        got.append(next(tokens))
        tokens.close()  # the token drawn ahead is not taken
    assert got == want and len(set(want)) > 1


def test_generate_needs_a_prompt(backend):
    with pytest.raises(DwarfStarError, match="prefill a prompt first"):
        next(Session(backend, ctx=64).generate(1, GREEDY))


def test_sampler_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def draws(params: SamplingParams) -> set[int]:
        sampler = Sampler(params)
        return {sampler(logits) for _ in range(300)}

    assert draws(SamplingParams(temperature=1.0, min_p=0.0, seed=1)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, min_p=0.2, seed=1)) == {0, 1, 2}  # 0.15 >= 0.2 * 0.5
    assert draws(SamplingParams(temperature=1.0, min_p=0.0, top_k=2, seed=1)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, min_p=0.0, top_p=0.8, seed=1)) == {0, 1}
    assert draws(SamplingParams(temperature=0.0)) == {0}
    with pytest.raises(DwarfStarError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_batched_decode_matches_separate_sessions(backend):
    """Three conversations at different positions, stepped together, match stepping each alone."""
    starts = [17, 120, 250]
    batched = [Session(backend, ctx=1024, chunk=64) for _ in starts]
    alone = [Session(backend, ctx=1024, chunk=64) for _ in starts]
    for n, b, s in zip(starts, batched, alone, strict=True):
        b.prefill(PROMPT[:n])
        s.prefill(PROMPT[:n])
    for step in range(6):
        tokens = [PROMPT[n + step] for n in starts]
        decode_batch(batched, tokens)
        for token, b, s in zip(tokens, batched, alone, strict=True):
            s.decode(token)
            assert b.tokens == s.tokens
            assert close(b.logits, s.logits)


def test_marks_end_passes_and_a_cut_back_to_one_replays_nothing(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=64)
    session.mark([37, 150, 500])  # 500 lies beyond the prompt: never reached, no checkpoint
    assert session.room() == 37
    session.prefill(PROMPT)
    assert session.checkpoints == [37, 64, 128, 150, 192, 256]
    for keep, replay in ((150, 0), (40, 3), (37, 0)):
        computed = session.stats.computed
        session.truncate(keep)
        assert session.stats.computed - computed == replay
        assert close(session.logits, reference_logits[keep - 1]), keep
    assert close(session.prefill(PROMPT[37:]), reference_logits[-1])


def test_checkpoints_beyond_the_limit_keep_the_newest_and_stay_spread(backend, reference_logits):
    session = Session(backend, ctx=1024, chunk=8)
    session.prefill(PROMPT)  # 37 chunk boundaries
    positions = session.checkpoints
    assert len(positions) == MAX_CHECKPOINTS and positions[-1] == 296
    gaps = [b - a for a, b in zip([0, *positions], positions, strict=False)]
    assert max(gaps) <= 2 * 296 / MAX_CHECKPOINTS, gaps
    for keep in (299, 150, 20):  # exact whichever checkpoint the replay starts from
        session.truncate(keep)
        assert close(session.logits, reference_logits[keep - 1]), keep
