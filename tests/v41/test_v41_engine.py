"""A V4.1 model end to end on the reference (issue 33): the engine loads `v41-tiny`, the session layer
drives it (prefill, greedy generate, truncation replays from snapshots), `dwarfstar run` answers, and
what does not run V4.1 yet is a clear error."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_cli_front import cli

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.cli import _register_commands
from dwarfstar.engine.load import load_engine, require_v4
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.engram.hashing import EngramHash
from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.model.config import V41
from dwarfstar.model.file_v41 import NOT_YET, ModelFile41, open_model41
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.loader import open_model
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import RenderOptions
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Session

_register_commands()

PROMPT = [(7919 * i + 101) % 120000 for i in range(23)]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=256, engram_cache=1))


def test_the_engine_loads_v41_on_the_reference(engine, v41_tiny_file):
    assert isinstance(engine.model, ModelFile41) and isinstance(engine.backend, ReferenceModel41)
    assert engine.backend_name == "reference" and engine.backend.max_seq_len == 256
    assert engine.backend.transformer.ops.store.capacity == (1 << 20) // ROW_BYTES  # --engram-cache 1 (MB)
    assert engine.model.args.reasoning_efforts == V41
    # the renderer opens a V4.1 system message with `<｜System｜>`, which the file's vocabulary holds
    text = render_conversation([{"role": "system", "content": "S"}], options=RenderOptions(efforts=V41)).text
    assert engine.tokenizer.encode_prompt(text)  # every control token resolves


def greedy_loop(backend: ReferenceModel41, prompt: list[int], n: int) -> list[int]:
    """The forward's own greedy decode: argmax of each call's logits, fed back."""
    state, out = backend.new_state(), []
    logits = backend.transformer.forward(prompt, state)
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = backend.transformer.forward(out[-1:], state)
    return out


def test_session_greedy_generate_equals_the_forward(engine):
    session = Session(engine.backend, ctx=256, chunk=8)  # the prompt runs in 3 passes
    session.prefill(PROMPT)
    assert session.checkpoints == [8, 16]
    got = list(session.generate(6, GREEDY))
    assert got == greedy_loop(engine.backend, PROMPT, 6)
    assert session.tokens == PROMPT + got and session.state.pos == len(PROMPT) + 6


def test_truncate_replays_to_a_fresh_sessions_logits(engine):
    session = Session(engine.backend, ctx=256, chunk=8)
    session.prefill(PROMPT)
    list(session.generate(4, GREEDY))
    changed = [5, 9, 11]
    for cut in (19, 16, 3):  # from a checkpoint with replay, on one, before every one
        session.truncate(cut)
        assert session.tokens == PROMPT[:cut]
        session.prefill(changed)
        fresh = Session(engine.backend, ctx=256, chunk=8)
        fresh.prefill(PROMPT[:cut] + changed)
        assert torch.equal(session.logits, fresh.logits), cut
        assert session.state.pos == fresh.state.pos
        session.truncate(cut)
        session.prefill(PROMPT[cut:])
    assert session.tokens == PROMPT


def test_snapshots_are_copies(engine):
    state = engine.backend.new_state()
    engine.backend.forward(PROMPT[:9], state, all_logits=False)
    snap = state.snapshot()
    before = state.nbytes()
    engine.backend.forward(PROMPT[9:], state, all_logits=False)
    assert state.nbytes() > before
    state.restore(snap)
    assert state.pos == 9 and state.nbytes() == before
    again = engine.backend.forward(PROMPT[9:], state, all_logits=False)
    state.restore(snap)  # a snapshot stays usable after a restore
    assert torch.equal(engine.backend.forward(PROMPT[9:], state, all_logits=False), again)


def test_all_logits_and_batches(engine):
    backend = engine.backend
    one, two = backend.new_state(), backend.new_state()
    every = backend.forward(PROMPT[:5], one, all_logits=True)
    assert every.shape == (5, backend.args.vocab_size)
    singles = backend.new_state()
    for i, t in enumerate(PROMPT[:5]):
        assert torch.equal(backend.forward([t], singles, all_logits=False)[0], every[i])
    a, b = backend.forward_batch([PROMPT[5:7], PROMPT[:3]], [one, two], all_logits=False)
    assert a.shape == b.shape == (1, backend.args.vocab_size) and (one.pos, two.pos) == (7, 3)
    assert torch.equal(one.logits, a[0]) and torch.equal(two.logits, b[0])


def test_bad_input_is_refused_before_any_state_changes(engine):
    backend, state = engine.backend, engine.backend.new_state()
    span = ImageSpan(0, torch.zeros(2, backend.args.dim))
    with pytest.raises(DwarfStarError, match="not an image id"):
        backend.forward([1, 2], state, images=[span])  # a block's positions hold image ids
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        backend.forward_batch([[1], [backend.args.vocab_size]], [state, backend.new_state()], all_logits=False)
    with pytest.raises(DwarfStarError, match="context overflow"):
        backend.forward([1] * 257, state)
    assert state.pos == 0 and state.logits is None


def test_what_does_not_run_v41_is_a_clear_error(engine, v41_tiny_file, tmp_path):
    # every backend runs V4.1 (cpu: tests/cpu/test_cpu_v41.py, triton: tests/triton/test_v41_triton.py,
    # mlx: tests/v41/test_v41_mlx.py); what refuses it is a V4 command and a V4-only option
    with pytest.raises(ModelFileError, match=re.escape(NOT_YET)):
        open_model(v41_tiny_file)  # every V4 command still refuses the file
    with pytest.raises(ModelFileError, match=re.escape(NOT_YET) + "; dwarfstar steer build runs DeepSeek V4 only"):
        require_v4(engine, "dwarfstar steer build")  # a command that runs V4 only, on the engine it loaded
    with pytest.raises(DwarfStarError, match="--engram-cache takes MB"):
        EngineSpec(v41_tiny_file, engram_cache=-1)


def test_cli_run_answers_on_v41(monkeypatch, capsys, v41_tiny_file):
    args = [
        "run",
        "-m",
        str(v41_tiny_file),
        "-p",
        "hello there",
        "-n",
        "4",
        "--backend",
        "reference",
        "--temp",
        "0",
        "--no-think",
    ]
    code, out, err = cli(monkeypatch, capsys, *args, "--engram-cache", "8")
    assert code == 0, err
    assert out.strip() and "decode 4 tok" in err


def test_v4_commands_refuse_v41(monkeypatch, capsys, v41_tiny_file):
    args = ("test", "tool-call", "-m", str(v41_tiny_file), "--backend", "reference", "--ctx", "256")
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 2 and NOT_YET in err and "dwarfstar test runs DeepSeek V4 only" in err and "Traceback" not in err


def test_a_prompts_engram_rows_are_read_ahead_once(v41_tiny_file, monkeypatch):
    """A prefill call hashes its Engram rows once and starts reading them all before layer 0 runs (the ids
    decide them); a decode step reads its own; every row is read from the file once, whoever asks first."""
    backend = ReferenceModel41.from_file(open_model41(v41_tiny_file), 1 << 20, 256)
    ops = backend.transformer.ops
    asked: list[int] = []
    prefetch = ops.store.prefetch
    ops.store.prefetch = lambda layer_ids: (
        asked.append(sum(ids.size for ids in layer_ids.values())),
        prefetch(layer_ids),
    )[1]
    hashed: list[tuple[int, int]] = []
    rows = EngramHash.rows
    monkeypatch.setattr(
        EngramHash,
        "rows",
        lambda self, il, tokens, start=0: (hashed.append((il, start)), rows(self, il, tokens, start))[1],
    )
    state = backend.new_state()
    prompt = list(range(100, 130))
    backend.forward(prompt, state, all_logits=False)
    backend.forward([7], state, all_logits=False)
    distinct = sum(np.unique(rows(ops.hash, il, prompt)).size for il in backend.args.engram_layers)
    assert asked == [distinct]  # the prompt's distinct rows, all layers', once; not the decode step's
    assert sorted(hashed) == sorted([(il, s) for il in backend.args.engram_layers for s in (0, 30)])
    wanted = {(il, int(r)) for il in backend.args.engram_layers for r in rows(ops.hash, il, [*prompt, 7]).ravel()}
    stats = ops.store.telemetry()
    assert stats["misses"] == len(wanted) and stats["prefetched"] <= stats["misses"]
    # without room for them, a prompt's rows are not read ahead (they would be evicted before use)
    tight = ReferenceModel41.from_file(open_model41(v41_tiny_file), 100 * ROW_BYTES, 256)
    tight.forward(prompt, tight.new_state(), all_logits=False)
    assert tight.transformer.ops.store.telemetry()["prefetched"] == 0
