"""The gates end to end on the bundled model, with the fixtures tools/make_gate_fixtures.py wrote for
it from the reference backend: they pass, and an altered expectation makes each of them fail."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.evals import EvalError
from dwarfstar.evals.long_context import DS4_FACTS, check_fact, read_facts, run_long_context
from dwarfstar.evals.tool_call import judge_reply, run_tool_call
from dwarfstar.evals.vectors import read_vector_file, run_case
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.forward import forward_then_sample
from dwarfstar.tokenizer.specials import ASSISTANT, THINK_END

_register_commands()
runner = CliRunner()
GATES = Path(__file__).resolve().parent.parent / "data" / "gates"
LONG_ARGS = {"ctx": 4096, "tokens": 96, "min_prompt_tokens": 1000}  # as make_gate_fixtures.py ran it
TOOL_CTX = 4096
DSML = "｜DSML｜"


@pytest.fixture(scope="module")
def engine():
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=4096))


def _altered_vectors(tmp_path: Path, old: str, new: str) -> Path:
    shutil.copytree(GATES / "prompts", tmp_path / "prompts")
    text = (GATES / "nano.vec").read_text()
    assert old in text
    path = tmp_path / "altered.vec"
    path.write_text(text.replace(old, new, 1))
    return path


def test_vectors_pass_on_the_bundled_model():
    result = runner.invoke(app, ["test", "vectors", "--vector-file", str(GATES / "nano.vec"), "--backend", "reference"])
    assert result.exit_code == 0, result.output
    assert "test vectors: PASS 3/3 cases" in result.output


def _first_case_lines() -> tuple[str, str, str]:
    """The first case's step-0 and step-2 lines and its first top line, as the fixture has them (the
    alterations below are made on what make_gate_fixtures.py wrote, not on remembered values)."""
    lines = (GATES / "nano.vec").read_text().splitlines()
    step0 = next(line for line in lines if line.startswith("step 0 "))
    step2 = next(line for line in lines if line.startswith("step 2 "))
    top = lines[lines.index(step0) + 1]
    return step0, step2, top


def test_vectors_fail_on_altered_bytes(engine, tmp_path):
    # record another token as the first case's third greedy token: the step's runner-up
    _, step2, _ = _first_case_lines()
    first = read_vector_file(GATES / "nano.vec")[0]
    chosen, other = first.steps[2].selected, next(t for t, _ in first.steps[2].top if t != first.steps[2].selected)
    path = _altered_vectors(tmp_path, step2, step2.replace(f" {chosen.hex()} ", f" {other.hex()} ", 1))
    result = run_case(engine, read_vector_file(path)[0])
    assert not result.passed
    assert result.problems == [f"step 2: selected {chosen.hex()} ({chosen!r}), expected {other.hex()} ({other!r})"]
    cli = runner.invoke(app, ["test", "vectors", "--vector-file", str(path), "--backend", "reference"])
    assert cli.exit_code == 1 and "test vectors: FAIL 2/3 cases" in cli.output


def test_vectors_fail_on_a_far_logprob(engine, tmp_path):
    _, _, top = _first_case_lines()
    token, logprob = top.split()[1:]
    path = _altered_vectors(tmp_path, top, f"top {token} {float(logprob) - 5:.6f}")
    result = run_case(engine, read_vector_file(path)[0])
    assert not result.passed and "off by more than 4.0" in result.problems[0]


def test_vector_skip_and_official_file_parse():
    official = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "ds4" / "test-vectors" / "official.vec"
    if not official.is_file():
        pytest.skip("ds4's official vectors are not in ../shared/fixtures")
    cases = read_vector_file(official)
    assert [c.id for c in cases][:3] == ["short_italian_fact", "short_code_completion", "short_reasoning_plain"]
    assert cases[0].steps[1].selected == b" Lov" and cases[0].prompt_path.is_file()
    skipped = run_case(None, next(c for c in cases if c.id == "long_memory_archive"))
    assert skipped.skipped and "disagree" in skipped.skipped


STEP0, _, TOP = _first_case_lines()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ((STEP0, f"step 0 2g {STEP0.split()[3]}"), "bad token hex '2g'"),
        (("prompts/nano_lago.txt", "prompts/absent.txt"), "prompt file prompts/absent.txt not found"),
        (("case nano_lago 4096 4", "case nano_lago 4096 5"), "declares 5 steps, has 4"),
        ((TOP, f"top {TOP.split()[1]} nan"), "logprob must be finite"),
    ],
)
def test_bad_vector_files_are_clear_errors(tmp_path, edit, message):
    path = _altered_vectors(tmp_path, *edit)
    with pytest.raises(EvalError, match=message):
        read_vector_file(path)


def test_long_context_passes_and_fails_on_an_altered_fact(engine, tmp_path):
    facts = read_facts(GATES / "nano_long_facts.txt")
    assert len(facts) == 16
    result = run_long_context(engine, GATES / "nano_long_prompt.txt", facts, **LONG_ARGS)
    assert result.passed and result.found == 16, result.problems
    altered = tmp_path / "facts.txt"
    altered.write_text("\n".join([*facts[:-1], facts[-1] + "x"]) + "\n")
    args = ["test", "long-context", "--prompt-file", str(GATES / "nano_long_prompt.txt"), "--facts", str(altered)]
    args += ["--ctx", "4096", "-n", "96", "--min-prompt-tokens", "1000", "--backend", "reference"]
    cli = runner.invoke(app, args)
    assert cli.exit_code == 1, cli.output
    assert f"missing phrase {facts[-1] + 'x'!r}" in cli.output and "FAIL 15/16 facts" in cli.output


def test_long_context_assignment_rule():
    text = "Bob = 34, Alice=5, Clara: 71, XBob=1, Diego=93x"
    assert check_fact(text, "Bob=34") is None
    assert check_fact(text, "Alice=52") == "wrong assignment for Alice: got 5 expected 52"
    assert check_fact(text, "Clara=71") == "missing assignment Clara=71"  # not written as an assignment
    assert check_fact(text, "Diego=93") is None  # ds4 reads the digits and stops
    assert len(DS4_FACTS) == 16


def test_long_context_bad_input(engine, tmp_path):
    with pytest.raises(EvalError, match="cannot read prompt file"):
        run_long_context(engine, tmp_path / "absent.txt", ["x"], **LONG_ARGS)
    short = run_long_context(engine, GATES / "nano_long_prompt.txt", ["x"], ctx=4096, tokens=1)
    assert short.problems == ["the prompt has 1512 tokens, not more than 30000"]
    cli = runner.invoke(app, ["test", "long-context", "--prompt-file", str(tmp_path / "absent.txt")])
    assert isinstance(cli.exception, EvalError)


def test_tool_call_matches_the_reference_reply(engine):
    result = run_tool_call(engine, TOOL_CTX, GATES / "nano_tool_call.json")
    assert result.passed, result.problems
    expectation = json.loads((GATES / "nano_tool_call.json").read_text())
    expectation["reply"]["content"] += "."
    assert [p.split(":")[0] for p in judge_reply(result.reply, expectation).problems] == ["content"]
    # without an expectation the bundled model fails ds4's check: the call it starts (to a tool it was
    # trained on, not list_files) does not parse, so the reply ends with no call
    plain = judge_reply(result.reply)
    assert not plain.passed and plain.problems[0].startswith("no tool call (finish stop")


class CallingBackend:
    """The bundled model, steered after `<｜Assistant｜></think>` to write `text` and then EOS: a model
    that answers ds4's request with a tool call, so the server's DSML parsing is what the gate judges."""

    MARGIN = 60.0  # every other token's probability is below e^-60

    def __init__(self, inner, tokenizer, text: str) -> None:
        self.inner, self.args = inner, inner.args
        self.script = [*tokenizer.encode_with_specials(text), tokenizer.eos_id]
        self.opener = tokenizer.encode_with_specials(ASSISTANT + THINK_END)

    def new_state(self):
        return self.inner.new_state()

    def forward(self, tokens, state, all_logits=True, images=None):
        out = self.inner.forward(tokens, state, all_logits, images=images)
        self._steer(state)
        return out

    def forward_batch(self, token_lists, states, all_logits=False, images=None):
        out = self.inner.forward_batch(token_lists, states, all_logits, images=images)
        for state in states:
            self._steer(state)
        return out

    def sample_batch(self, logits, samplers):
        return self.inner.sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)  # through this double's forward_batch

    def _steer(self, state) -> None:
        tokens, n = state.tokens, len(self.opener)
        starts = [i + n for i in range(len(tokens) - n + 1) if tokens[i : i + n] == self.opener]
        generated = len(tokens) - starts[-1] if starts else -1
        if 0 <= generated < len(self.script):
            logits = state.logits.clone()
            logits[self.script[generated]] = logits.max() + self.MARGIN
            state.logits = logits


def _calling_engine(engine, name: str):
    call = (
        f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="{name}">\n'
        f'<{DSML}parameter name="path" string="true">.</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>'
    )
    return replace(engine, backend=CallingBackend(engine.backend, engine.tokenizer, call))


def test_tool_call_gate_on_a_model_that_calls(engine):
    result = run_tool_call(_calling_engine(engine, "list_files"), TOOL_CTX)
    assert result.passed, result.problems
    assert result.reply["tool_calls"] == [{"name": "list_files", "arguments": '{"path": "."}'}]
    assert result.reply["finish_reason"] == "tool_calls"
    wrong = run_tool_call(_calling_engine(engine, "read_file"), TOOL_CTX)
    assert wrong.problems == ["the first tool call is 'read_file', not 'list_files'"]
