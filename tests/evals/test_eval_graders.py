"""ds4-eval's extractors on a table of tricky outputs, the CLI's self-test, and question-set loading."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.evals import BUNDLED_SET, EvalError
from dwarfstar.evals.extractor_cases import CASES
from dwarfstar.evals.graders import grade, line_set, lines_match
from dwarfstar.evals.questions import load_questions

_register_commands()
runner = CliRunner()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extractor_table(case):
    got = grade(case.kind, case.output, case.expected, case.n_choices)
    assert (got.picked, got.passed) == (case.picked, case.passed)


def test_line_specs():
    assert line_set("17-20,9") == {9, 17, 18, 19, 20}
    assert line_set("20-17") == {17, 18, 19, 20}  # reversed ranges count
    assert line_set("250-300") == set(range(250, 256))  # clipped to ds4's 0..255
    assert not lines_match("17-20", "")  # naming nothing never passes
    assert not lines_match("0", "0,5")


def test_self_test_extractors_runs_the_table():
    result = runner.invoke(app, ["eval", "--self-test-extractors"])
    assert result.exit_code == 0, result.output
    assert f"extractor self-test: {len(CASES)}/{len(CASES)} passed" in result.output


def test_bundled_set_covers_every_kind():
    questions = load_questions(BUNDLED_SET)
    kinds = {q.answer_kind for q in questions}
    assert kinds == {"choice", "integer", "lines"}
    assert 24 <= len(questions) <= 60
    assert any(q.answer == "0" for q in questions if q.answer_kind == "lines")  # a safe C case
    prompt = next(q for q in questions if q.answer_kind == "choice").user_prompt()
    assert "\nChoices:\nA. " in prompt and prompt.endswith("\nAnswer: <letter>")
    assert load_questions(BUNDLED_SET, limit=3) == questions[:3]


def _write(tmp_path, **overrides):
    record = {"source": "T", "id": "q1", "domain": "d", "question": "q?", "choices": [], "answer": "7"}
    record["answer_kind"] = "integer"
    record.update(overrides)
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"answer_kind": "essay"}, "unknown answer_kind 'essay'"),
        ({"answer_kind": "choice", "choices": ["a", "b"], "answer": "C"}, "not one of the letters AB"),
        ({"answer_kind": "choice", "choices": ["a"], "answer": "A"}, "needs 2..10 choices"),
        ({"answer": "seven"}, "must be digits"),
        ({"answer_kind": "lines", "answer": "line 4"}, "a lines answer is a spec"),
        ({"choices": "A,B"}, "choices must be a list of strings"),
    ],
)
def test_bad_question_sets_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(EvalError, match=message):
        load_questions(_write(tmp_path, **overrides))


def test_question_set_cli_errors(tmp_path):
    result = runner.invoke(app, ["eval", "--questions-file", str(_write(tmp_path, answer_kind="essay"))])
    assert result.exit_code != 0 and isinstance(result.exception, EvalError)
    missing = tmp_path / "set.jsonl"
    missing.write_text('{"source": "T"}\n')
    with pytest.raises(EvalError, match="missing id, domain"):
        load_questions(missing)
    with pytest.raises(EvalError, match="cannot read question set"):
        load_questions(tmp_path / "absent.jsonl")


def test_budget_rules_are_checked():
    result = runner.invoke(app, ["eval", "-n", "100", "--hard-limit-reply-budget", "100"])
    assert "must be below --tokens" in str(result.exception)
    result = runner.invoke(
        app, ["eval", "-n", "100", "--hard-limit-reply-budget", "50", "--soft-limit-reply-budget", "20"]
    )
    assert "must be at least --hard-limit-reply-budget" in str(result.exception)
