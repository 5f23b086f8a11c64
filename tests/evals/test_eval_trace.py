"""The eval trace: ds4's layout written and read back, `--regrade-trace` on a committed trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.evals import EvalError, graders
from dwarfstar.evals.eval_trace import CaseRecord, read_trace, regrade_trace, write_case, write_header

_register_commands()
runner = CliRunner()
DATA = Path(__file__).resolve().parent.parent / "data" / "gates"
NANO_TRACE = DATA / "nano_eval.trace"  # `dwarfstar eval` on the bundled model (tests/data/gates/README.md)

# A trace as ds4-eval writes it: its C question says `answer_kind: exact_integer` under source COMPSEC.
DS4_TRACE = """# ds4-eval trace
started_unix: 1
model: ds4flash.gguf
questions: 2

===== CASE 1/2 COMPSEC/compsec-001 =====
source: COMPSEC
id: compsec-001
status: passed
picked: 18
expected: 17-20
prompt_tokens: 900
generated_tokens: 30
elapsed_sec: 1.500
think_close: natural
think_close_token_index: 20
think_close_remaining_budget: 100
think_close_rank: 0
answer_kind: exact_integer
SYSTEM_PROMPT_BEGIN bytes=3
sys
SYSTEM_PROMPT_END
QUESTION_PROMPT_BEGIN bytes=0
QUESTION_PROMPT_END
MODEL_OUTPUT_BEGIN bytes=26
line 3?</think>
Answer: 18
MODEL_OUTPUT_END

===== CASE 2/2 GPQA Diamond/rec1 =====
source: GPQA Diamond
id: rec1
status: failed
picked: A
expected: C
choices:
  A. one
  B. two
  C. three
answer_kind_unused: x
MODEL_OUTPUT_BEGIN bytes=9
Answer: A
MODEL_OUTPUT_END

"""


def _record(output: str, **fields) -> CaseRecord:
    base = dict(
        index=1,
        total=1,
        source="S",
        id="x",
        domain="d",
        title="t",
        status="passed",
        picked="B",
        expected="B",
        answer_kind="choice",
        choices=("one", "two"),
        prompt_tokens=10,
        generated_tokens=5,
        elapsed_sec=0.25,
        temperature=0.0,
        top_p=1.0,
        min_p=0.05,
        think_mode="think",
        system_prompt="sys",
        question_prompt="q",
        output=output,
    )
    base.update(fields)
    return CaseRecord(**base)


def test_committed_trace_regrades_to_its_recorded_results():
    header, cases = read_trace(NANO_TRACE)
    assert header["model"].endswith("nano.gguf") and len(cases) == 3
    assert [c.answer_kind for c in cases] == ["choice", "integer", "lines"]
    results = regrade_trace(NANO_TRACE)
    assert [(r.now.picked, r.now.passed) for r in results] == [(c.picked, c.status == "passed") for c in cases]
    result = runner.invoke(app, ["eval", "--regrade-trace", str(NANO_TRACE)])
    assert result.exit_code == 0, result.output
    assert "0 changed from the trace" in result.output


def test_changed_grader_shows_as_a_diff(monkeypatch):
    monkeypatch.setattr(graders, "extract_choice", lambda output, n: "B")  # a grader that always says B
    result = runner.invoke(app, ["eval", "--regrade-trace", str(NANO_TRACE)])
    assert result.exit_code == 1
    assert "passed  picked B" in result.output and "CHANGED (was failed, picked ?)" in result.output
    assert "1 changed from the trace" in result.output


def test_ds4_trace_reads_compsec_as_lines(tmp_path):
    path = tmp_path / "ds4.trace"
    path.write_text(DS4_TRACE)
    _, cases = read_trace(path)
    assert cases[0].answer_kind == "lines" and cases[0].output == "line 3?</think>\nAnswer: 18"
    assert cases[0].think_close.kind == "natural" and cases[0].think_close.remaining_budget == 100
    assert cases[1].choices == ("one", "two", "three")
    assert [r.changed for r in regrade_trace(path)] == [False, False]


def test_written_trace_reads_back(tmp_path):
    tricky = "reasoning\nMODEL_OUTPUT_END\n</think>Answer: B"  # the end marker inside the output
    path = tmp_path / "run.trace"
    with path.open("wb") as out:
        write_header(out, {"model": "m.gguf", "questions": 2})
        write_case(out, _record(tricky))
        write_case(out, _record("Answer: 0", index=2, answer_kind="lines", choices=(), expected="0", picked="0"))
    header, cases = read_trace(path)
    assert header["questions"] == "2"
    assert cases[0].output == tricky and cases[0].choices == ("one", "two")
    assert cases[1].answer_kind == "lines" and "answer_kind: line_spec" in path.read_text()
    assert not any(r.changed for r in regrade_trace(path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hello\n", "not an eval trace"),
        (DS4_TRACE.replace("bytes=26", "bytes=20"), "does not end with MODEL_OUTPUT_END"),
        (DS4_TRACE.replace("elapsed_sec: 1.500", "elapsed_sec: soon"), "elapsed_sec is not a number"),
    ],
)
def test_bad_traces_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(EvalError, match=message):
        read_trace(path)
