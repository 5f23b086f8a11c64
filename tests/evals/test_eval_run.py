"""`dwarfstar eval` on the bundled model: thinking budgets, the context rule, the report; the quality gate."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.evals import BUNDLED_SET, EvalError
from dwarfstar.evals import quality as q
from dwarfstar.evals.eval_trace import read_trace
from dwarfstar.evals.questions import load_questions
from dwarfstar.evals.runner import MAX_CONTEXT, EvalSettings, auto_context, prompt_ids, report_lines, run_question
from dwarfstar.model.bundled import default_model_path
from dwarfstar.sampling import Sampler
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.specials import THINK_END

_register_commands()
runner = CliRunner()
GATES = Path(__file__).resolve().parent.parent / "data" / "gates"
VOCAB_RANK = 200_000  # a rank every token has: the soft limit then closes as soon as it may


@pytest.fixture(scope="module")
def engine():
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=2048))


@pytest.fixture(scope="module")
def question():
    return load_questions(BUNDLED_SET, limit=1)[0]


@pytest.fixture
def never_sampled_close(engine, monkeypatch):
    """Sampling never picks `</think>`, so only the budgets can close the reasoning: the bundled model,
    trained on thinking turns, closes it by itself within two tokens of these prompts (see
    test_the_model_closes_its_reasoning_itself). The budgets read the logits unchanged."""
    close = engine.tokenizer.token_id(THINK_END)
    sample = engine.backend.sample_batch

    def without_close(logits, samplers):
        logits = logits.clone()
        logits[:, close] = float("-inf")
        return sample(logits, samplers)

    monkeypatch.setattr(engine.backend, "sample_batch", without_close)


def _run(engine, question, **settings):
    settings = EvalSettings(**settings)
    session = Session(engine.backend, ctx=1024)
    return run_question(session, engine.tokenizer, question, settings, Sampler(settings.sampling), 1, 1)


def test_prompt_is_ds4_evals(engine, question):
    text = engine.tokenizer.decode(prompt_ids(engine.tokenizer, question, think=True))
    assert text.startswith("<｜begin▁of▁sentence｜>You are solving a hard benchmark question.")
    assert text.endswith("Answer: <letter><｜Assistant｜><think>")


def test_the_model_closes_its_reasoning_itself(engine, question):
    record = _run(engine, question, max_tokens=24, hard_reply_budget=8, soft_reply_budget=8)
    close = record.think_close
    assert close.kind == "natural" and close.token_index <= 24 - 8 and close.remaining_budget > 8
    assert record.output.count(THINK_END) == 1


def test_hard_budget_forces_think_close(engine, question, never_sampled_close):
    record = _run(engine, question, max_tokens=24, hard_reply_budget=8, soft_reply_budget=8)
    close = record.think_close
    assert (close.kind, close.token_index, close.remaining_budget) == ("hard_forced", 17, 8)
    assert record.generated_tokens == 24 and record.output.count(THINK_END) == 1
    assert record.status in ("passed", "failed") and record.expected == "B"


def test_soft_budget_takes_a_high_ranked_think_close(engine, question, never_sampled_close):
    record = _run(
        engine, question, max_tokens=24, hard_reply_budget=4, soft_reply_budget=20, soft_close_rank=VOCAB_RANK
    )
    close = record.think_close
    assert (close.kind, close.token_index, close.remaining_budget) == ("soft_forced", 5, 20)
    assert close.rank > 0
    never = _run(engine, question, max_tokens=24, hard_reply_budget=4, soft_reply_budget=20, soft_close_rank=0)
    assert never.think_close.kind == "hard_forced"  # rank 0: the soft limit never takes it


def test_nothink_has_no_budget(engine, question):
    record = _run(engine, question, max_tokens=12, hard_reply_budget=4, soft_reply_budget=4, think=False)
    assert record.think_close.kind == "none" and THINK_END not in record.output


def test_context_is_sized_from_the_largest_prompt(engine):
    questions = load_questions(BUNDLED_SET)
    settings = EvalSettings(max_tokens=100, hard_reply_budget=10, soft_reply_budget=10)
    largest = max(len(prompt_ids(engine.tokenizer, q, True)) for q in questions)
    assert auto_context(engine.tokenizer, questions, settings, 65536) == largest + 100
    too_big = replace(settings, max_tokens=MAX_CONTEXT)
    with pytest.raises(EvalError, match="exceeds the 1000000 token context cap"):
        auto_context(engine.tokenizer, questions, too_big, 2_000_000)
    with pytest.raises(EvalError, match="this model holds at most 65536"):
        auto_context(engine.tokenizer, questions, replace(settings, max_tokens=70000), 65536)


def test_eval_command_plain_run_writes_trace_and_report(tmp_path):
    trace = tmp_path / "run.trace"
    args = ["eval", "--plain", "--questions-file", str(GATES / "eval_mixed.jsonl"), "--questions", "2", "-n", "12"]
    args += ["--hard-limit-reply-budget", "4", "--soft-limit-reply-budget", "4", "--backend", "reference"]
    result = runner.invoke(app, [*args, "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    header, cases = read_trace(trace)
    assert header["questions"] == "2" and [c.id for c in cases] == ["mc-011", "int-004"]
    # the reasoning closed, by the model or by the hard budget at its 8th token, once per answer
    assert all(c.think_close.kind in ("natural", "hard_forced") and c.think_close.token_index <= 8 for c in cases)
    assert all(c.output.count(THINK_END) == 1 for c in cases)
    assert re.search(r"^eval: [0-2]/2 passed", result.output, re.MULTILINE)
    assert "DwarfStar/mc-011" in result.output and "DwarfStar/int-004" in result.output


def test_report_lines():
    _, cases = read_trace(GATES / "nano_eval.trace")
    lines = report_lines(cases, 6.5)
    assert lines[0] == "eval: 0/3 passed, 3 failed, runtime 6.5 s"
    assert lines[2].split()[:3] == ["1", "failed", "95"] and lines[2].endswith("?        B        DwarfStar/mc-011")


def test_quality_self_comparison_and_a_different_target(engine):
    cases = q.read_quality_prompts(q.BUNDLED_PROMPTS, limit=2)
    assert len(q.read_quality_prompts(q.BUNDLED_PROMPTS)) == 100 and cases[0].id == "case_000"
    target = q.greedy_continuation(engine, cases[0], tokens=8)
    own = q.score_case(engine, cases[0], target)
    assert own.first_match and own.greedy_lcp == len(target) == 8 and own.avg_nll > 0
    shifted = [target[1], *target[1:]]  # the second token twice: the first no longer matches
    other = q.score_case(engine, cases[0], shifted)
    assert not other.first_match and other.greedy_lcp == 0 and other.nll > own.nll
    assert own.tsv().split("\t")[:3] == ["case_000", str(own.prompt_tokens), "8"]
    assert q.summary([own, other]).startswith("summary cases=2 tokens=16 ")
