"""`dwarfstar run` one-shot use, `--power`, the diagnostic dumps and the backend options (`--backend`,
`--ctx`, `--precision`), on the tiny random model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from dwarfstar.backends.mlx import mlx_available
from dwarfstar.backends.registry import pick_backend
from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.prompt import render_conversation
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.specials import BOS, USER

_register_commands()
SYSTEM, QUESTION = "Be brief.", "Tell me about Milan"
N_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return path


@pytest.fixture(scope="module")
def reference(tiny: Path) -> tuple[list[int], list[int], str]:
    """(prompt ids, greedy tokens without EOS, their text) straight from the session layer."""
    engine = load_engine(EngineSpec(tiny, "reference", ctx=32768))
    prompt = render_conversation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    ids = engine.tokenizer.encode_prompt(prompt.parts)
    session = Session(engine.backend, ctx=32768)
    session.prefill(ids)
    eos = engine.model.args.eos_token_id
    out = [t for t in session.generate(N_TOKENS, GREEDY, stop_tokens=[eos]) if t != eos]
    return ids, out, engine.tokenizer.decode(out)


def run_cli(*args: str) -> Result:
    """`dwarfstar run` in this process: no interpreter start-up, so timings are of the model alone."""
    return CliRunner().invoke(app, ["run", *args])


def one_shot(tiny: Path, *extra: str) -> Result:
    args = ["-m", str(tiny), "--backend", "reference", "-sys", SYSTEM, "-p", QUESTION, "--nothink", "--temp", "0"]
    done = run_cli(*args, *extra)
    assert done.exit_code == 0, done.output
    return done


def decode_seconds(stderr: str) -> float:
    return float(re.search(r"decode \d+ tok in ([\d.]+) s", stderr).group(1))


def test_one_shot_greedy_is_deterministic_and_matches_the_session_layer(tiny, reference) -> None:
    first = one_shot(tiny, "-n", str(N_TOKENS))
    second = one_shot(tiny, "-n", str(N_TOKENS))
    assert first.stdout == second.stdout
    text = reference[2]
    assert first.stdout == text + ("" if text.endswith("\n") else "\n")
    # the closing summary, on stderr only
    assert re.search(r"prefill \d+ tok in .* \| decode \d+ tok in .* tok/s\)", first.stderr)


def test_power_sleeps_without_changing_the_output(tiny) -> None:
    # two runs of each, best time counts: other processes on the machine slow single runs down
    full = [one_shot(tiny, "-n", "64") for _ in range(2)]
    half = [one_shot(tiny, "-n", "64", "--power", "50") for _ in range(2)]
    assert {r.stdout for r in full + half} == {full[0].stdout}
    for run in half:
        idle = float(re.search(r"power 50%: idle ([\d.]+) s", run.stderr).group(1))
        # at 50% the throttle idles as long as the model works
        assert idle > 0.3 * decode_seconds(run.stderr)
    assert min(decode_seconds(r.stderr) for r in half) > 1.3 * min(decode_seconds(r.stderr) for r in full)


def test_dump_logprobs_has_ds4s_schema(tiny, reference, tmp_path) -> None:
    out = tmp_path / "logprobs.json"
    done = one_shot(tiny, "-n", "4", "--dump-logprobs", str(out), "--logprobs-top-k", "5")
    assert done.stdout == ""  # no text, as in ds4
    doc = json.loads(out.read_text(encoding="utf-8"))
    prompt_ids, greedy, _ = reference
    assert set(doc) == {"source", "prompt_tokens", "ctx", "top_k", "steps"}
    assert doc["prompt_tokens"] == len(prompt_ids) and doc["ctx"] == 32768 and doc["top_k"] == 5
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2, 3]
    assert [s["selected"]["id"] for s in doc["steps"]] == greedy[:4]
    for step in doc["steps"]:
        assert set(step) == {"step", "selected", "logprob", "top_logprobs"}
        top = step["top_logprobs"]
        assert len(top) == 5 and top[0]["token"] == step["selected"]
        assert step["logprob"] == top[0]["logprob"]
        assert all(set(t) == {"token", "logit", "logprob"} for t in top)
        assert all(set(t["token"]) == {"id", "text", "bytes"} for t in top)
        logprobs = [t["logprob"] for t in top]
        assert logprobs == sorted(logprobs, reverse=True) and logprobs[0] <= 0
        logits = [t["logit"] for t in top]
        # log-softmax shifts every logit by the same amount
        assert all(abs((lg - lp) - (logits[0] - logprobs[0])) < 1e-3 for lg, lp in zip(logits, logprobs, strict=True))
        for t in top:
            raw = bytes(t["token"]["bytes"])
            assert t["token"]["text"] == raw.decode("utf-8", errors="surrogateescape").translate(
                {c: c - 0xDC00 for c in range(0xDC80, 0xDD00)}
            )


def test_dump_tokens_tokenizes_as_written_and_exits(tiny) -> None:
    done = run_cli("-m", str(tiny), "-p", f"{BOS}Hi{USER}", "--dump-tokens")
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    ids = json.loads(lines[0])
    assert ids[0] == 0 and ids[-1] == 128803  # BOS and <｜User｜> stay control tokens
    assert [int(line.split()[0]) for line in lines[1:]] == ids
    assert lines[1].endswith(BOS)


def test_prompt_errors_are_clear(tiny, tmp_path) -> None:
    # DwarfStarError reaches main(), which prints it without a traceback (exit 2)
    done = run_cli("-m", str(tiny), "-p", "a", "--prompt-file", str(tmp_path / "x.txt"))
    assert isinstance(done.exception, DwarfStarError) and "not both" in str(done.exception)
    done = run_cli("-m", str(tmp_path / "missing.gguf"), "-p", "a")
    assert isinstance(done.exception, DwarfStarError) and "not found" in str(done.exception)
    done = run_cli("-m", str(tiny), "--dump-logprobs", str(tmp_path / "x.json"))
    assert isinstance(done.exception, DwarfStarError) and "need a prompt" in str(done.exception)


PROMPT_IDS = "0,17,42,9000,123,77"


def dump_logits(tiny: Path, out: Path, *extra: str) -> np.ndarray:
    done = run_cli("-m", str(tiny), "--prompt-tokens", PROMPT_IDS, "--dump-logits", str(out), *extra)
    assert done.exit_code == 0, done.output
    return np.load(out)


def test_triton_backend_from_the_cli_matches_the_reference(tiny, tmp_path) -> None:
    """On a CPU-only machine this is Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
    which `--backend triton` accepts when asked for; on a GPU, the compiled kernels."""
    want = dump_logits(tiny, tmp_path / "reference.npy", "--backend", "reference")
    got = dump_logits(tiny, tmp_path / "triton.npy", "--backend", "triton")
    assert got.shape == want.shape == (6, TINY.vocab_size)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3  # the spec's bound with QAT rounding on


def test_triton_without_a_gpu_names_the_interpreter(tiny, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    done = run_cli("-m", str(tiny), "--backend", "triton", "--prompt-tokens", PROMPT_IDS, "--dump-logits", "x.npy")
    assert isinstance(done.exception, DwarfStarError) and "TRITON_INTERPRET=1" in str(done.exception)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_backend("triton") == "triton"
    assert pick_backend("auto") != "triton"  # the interpreter only when asked for by name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_backend("auto") != "triton"  # with the interpreter on, even a GPU would run in it


BACKEND_NAMES = [
    "reference",
    "triton",
    pytest.param("mlx", marks=pytest.mark.skipif(not mlx_available(), reason="no mlx")),
]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_ctx_bounds_every_backend(tiny, tmp_path, backend) -> None:
    ids = ",".join(str(3 + i) for i in range(65))
    args = ["-m", str(tiny), "--backend", backend, "--ctx", "64", "--prompt-tokens", ids]
    done = run_cli(*args, "--dump-logits", str(tmp_path / "x.npy"))
    assert isinstance(done.exception, ContextOverflowError), done.output
    assert "0 + 65 tokens exceed the context of 64" in str(done.exception)
    engine = load_engine(EngineSpec(tiny, backend, ctx=64))
    assert engine.backend.max_seq_len == 64
    with pytest.raises(ContextOverflowError):
        engine.backend.forward(list(range(3, 68)), engine.backend.new_state())


def test_precision_is_exact_by_default_and_fast_only_on_triton(tiny) -> None:
    assert load_engine(EngineSpec(tiny, "triton")).backend.precision.fast is False
    assert load_engine(EngineSpec(tiny, "triton", precision="fast")).backend.precision.fast is True
    for backend in ["reference", *(["mlx"] if mlx_available() else [])]:
        with pytest.raises(DwarfStarError, match="--precision fast needs the triton backend"):
            load_engine(EngineSpec(tiny, backend, precision="fast"))
    done = run_cli("-m", str(tiny), "--backend", "reference", "--precision", "fast", "-p", "hi")
    assert isinstance(done.exception, DwarfStarError) and "needs the triton backend" in str(done.exception)
    done = CliRunner().invoke(app, ["serve", "-m", str(tiny), "--backend", "reference", "--precision", "fast"])
    assert isinstance(done.exception, DwarfStarError) and "needs the triton backend" in str(done.exception)
    done = run_cli("-m", str(tiny), "--precision", "bf16", "-p", "hi")
    assert isinstance(done.exception, DwarfStarError) and "unknown precision 'bf16'" in str(done.exception)
