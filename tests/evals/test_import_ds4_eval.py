"""tools/import_ds4_eval.py on a ds4_eval.c-shaped file written for this test (no ds4 question text)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dwarfstar.evals import EvalError
from dwarfstar.evals.questions import load_questions

TOOL = Path(__file__).resolve().parents[2] / "tools" / "import_ds4_eval.py"
spec = importlib.util.spec_from_file_location("import_ds4_eval", TOOL)
importer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(importer)

C_SOURCE = r"""
#include "ds4.h"
static const eval_case eval_cases[] = {
    {
        .source = "GPQA Diamond",
        .id = "rec1",
        .domain = "Physics",
        .title = "Braces { and } in a title",
        .question = "Which is \"right\"?\n"
                    "Pick one.",
        .choice[0] = "first",
        .choice[1] = "sec\x6fnd",
        .choice[2] = "th\151rd",
        .answer = "B",
    },
    {
        .source = "AIME2025",
        .id = "1",
        .domain = "Math",
        .title = "Sum",
        .question = "Find $2\\times 3$.",
        .answer = "6",
    },
    {
        .source = "COMPSEC",
        .id = "compsec-001",
        .domain = "C",
        .title = "Copy",
        .question = "Code:\n 1: int f(void) { return 0; }",
        .answer = "17-20",
    },
};
static int after(void) { return 1; }
"""


def test_imports_each_kind_with_sources_and_licences(tmp_path):
    path = tmp_path / "ds4_eval.c"
    path.write_text(C_SOURCE)
    records = importer.import_questions(path)
    assert [r["answer_kind"] for r in records] == ["choice", "integer", "lines"]
    first = records[0]
    assert first["question"] == 'Which is "right"?\nPick one.'
    assert first["choices"] == ["first", "second", "third"]  # hex and octal escapes
    assert first["title"] == "Braces { and } in a title" and first["license"] == "CC BY 4.0 (GPQA)"
    assert records[1]["question"] == "Find $2\\times 3$." and records[1]["license"].startswith("MIT")
    assert records[2]["question"].endswith("{ return 0; }")
    out = tmp_path / "q.jsonl"
    done = subprocess.run([sys.executable, str(TOOL), str(path), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 questions" in done.stdout
    questions = load_questions(out)  # the set `dwarfstar eval --questions-file` reads
    assert [q.label for q in questions] == ["GPQA Diamond/rec1", "AIME2025/1", "COMPSEC/compsec-001"]
    assert json.loads(out.read_text().splitlines()[0])["source"] == "GPQA Diamond"


def test_bad_sources_are_clear_errors(tmp_path):
    path = tmp_path / "other.c"
    path.write_text("int main(void) { return 0; }\n")
    with pytest.raises(EvalError, match="no `eval_case eval_cases"):
        importer.import_questions(path)
    path.write_text(C_SOURCE.replace('.answer = "B"', '.answer = "Q"'))
    with pytest.raises(EvalError, match="case 1: answer 'Q' is not one of the letters ABC"):
        importer.import_questions(path)
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "absent.c")], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.startswith("error: cannot read")
