"""The DS41 session payload of a DeepSeek V4.1 state (issue 33): a state saved after a prompt and read
into a fresh one decodes exactly as the uninterrupted sequence; a DSV4 payload is never read as V4.1's
(nor the reverse); damaged payloads are refused with the reason."""

from __future__ import annotations

import io

import pytest
import torch

from dwarfstar.console.chat import Chat, ThinkMode
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.kvcache import payload as v4_payload
from dwarfstar.kvcache.payload import PayloadError
from dwarfstar.kvcache.payloads import payload_nbytes, read_payload, write_payload
from dwarfstar.model.synthetic import TINY
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.accounting import random_state

CTX, CHUNK = 256, 8
PROMPT = [(7919 * i + 101) % 120000 for i in range(11)]  # odd: a ratio-2 frontier holds one token


@pytest.fixture(scope="module")
def engine(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=CTX))


@pytest.fixture(scope="module")
def backend(engine):
    return engine.backend


@pytest.fixture(scope="module")
def saved(backend) -> tuple[bytes, torch.Tensor]:
    """The payload after PROMPT, and the logits the uninterrupted sequence gives after two more tokens."""
    state = backend.new_state()
    backend.forward(PROMPT, state, all_logits=False)
    out = io.BytesIO()
    write_payload(out, state, backend.args, CTX, CHUNK)
    backend.forward([5], state, all_logits=False)
    return out.getvalue(), backend.forward([9], state, all_logits=False)


def test_a_saved_state_decodes_as_the_uninterrupted_sequence(backend, saved):
    data, want = saved
    # v41-tiny: 12 layers, head dim 128, index head dim 64, window 8, vocab 129280, kv sources 2, 4 (ratio 2)
    # and 6 (ratio 1); 11 tokens: header 48 + tokens 44 + logits 517120 + source table 24 + window rows
    # 12 * 7 * 128 * 4 = 43008 + ratio-2 sources 2 * (5 * 192 * 4 + frontier 2 * 2 * 128 * 4) = 11776
    # + the ratio-1 source 11 * 192 * 4 = 8448
    assert len(data) == 580468 == payload_nbytes(backend.args, len(PROMPT))
    state = read_payload(data, backend.args, CTX, CHUNK, backend.new_state)
    assert state.tokens == PROMPT and state.pos == len(PROMPT)
    backend.forward([5], state, all_logits=False)
    assert torch.equal(backend.forward([9], state, all_logits=False), want)


def test_payloads_of_the_other_family_are_refused(backend, saved):
    data, _ = saved
    with pytest.raises(PayloadError, match="a DeepSeek V4.1 Flash payload cannot load into a DeepSeek V4 model"):
        read_payload(data, TINY, CTX, CHUNK, lambda: pytest.fail("no state is made for a refused payload"))
    with pytest.raises(PayloadError, match="not a DSV4 session payload"):
        v4_payload.read_payload(data, TINY, CTX, CHUNK, lambda: pytest.fail("nor here"))
    v4_state = random_state(TINY, 40)
    out = io.BytesIO()
    write_payload(out, v4_state, TINY, CTX, CHUNK)  # the same entry point writes V4's layout for a V4 model
    assert out.getvalue()[:4] == b"DSV4"
    with pytest.raises(PayloadError, match="a DeepSeek V4 payload cannot load into a DeepSeek V4.1 Flash model"):
        read_payload(out.getvalue(), backend.args, CTX, CHUNK, backend.new_state)


def test_damaged_or_foreign_payloads_are_refused(backend, saved):
    data, _ = saved
    read = lambda raw, ctx=CTX, chunk=CHUNK: read_payload(raw, backend.args, ctx, chunk, backend.new_state)  # noqa: E731
    with pytest.raises(PayloadError, match="580467 bytes, the layout for 11 tokens needs 580468"):
        read(data[:-1])
    with pytest.raises(PayloadError, match="the header alone needs 48"):
        read(data[:20])
    with pytest.raises(PayloadError, match="too few for a magic"):
        read(data[:3])
    with pytest.raises(PayloadError, match="neither DSV4"):
        read(b"XXXX" + data[4:])
    with pytest.raises(PayloadError, match="prefill chunk 8, this session uses 16"):
        read(data, chunk=16)
    with pytest.raises(PayloadError, match="written for context 256 with 11 tokens; this session holds 128"):
        read(data, ctx=128)
    bad_token = bytearray(data)
    bad_token[48:52] = (backend.args.vocab_size).to_bytes(4, "little")
    with pytest.raises(PayloadError, match="outside the vocabulary"):
        read(bytes(bad_token))
    other_plan = bytearray(data)
    at = 48 + 4 * len(PROMPT) + 4 * backend.args.vocab_size  # the source table: layers, then ratios
    other_plan[at : at + 4] = (3).to_bytes(4, "little")
    with pytest.raises(PayloadError, match=r"another DeepSeek V4.1 Flash layer plan: kv sources \[3, 4, 6\]"):
        read(bytes(other_plan))


def test_an_empty_state_is_not_saved(backend):
    with pytest.raises(PayloadError, match="cannot save an empty session"):
        write_payload(io.BytesIO(), backend.new_state(), backend.args, CTX, CHUNK)


def test_runs_chat_saves_and_loads_a_v41_conversation(engine, tmp_path, capsys):
    def chat() -> Chat:
        return Chat(
            engine, engine.backend, ctx=CTX, system="", mode=ThinkMode.NOTHINK, params=SamplingParams(0.0), max_tokens=2
        )

    talked = chat()
    talked.ask("hello")
    size = talked.save(tmp_path / "talk")  # `run`'s /save
    assert (tmp_path / "talk.ds41").read_bytes()[:4] == b"DS41" and size == (tmp_path / "talk.ds41").stat().st_size
    loaded = chat()
    assert loaded.load(tmp_path / "talk") == len(talked.session.tokens)  # /load: no prefill
    assert loaded.session.stats.computed == 0 and loaded.session.tokens == talked.session.tokens
    assert torch.equal(loaded.session.logits, talked.session.logits)
    capsys.readouterr()
