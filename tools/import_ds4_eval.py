"""Turn the 92 questions embedded in ds4's `ds4_eval.c` into a `dwarfstar eval` question set (JSONL).

    .venv/bin/python tools/import_ds4_eval.py PATH/TO/ds4_eval.c [-o build/evals/ds4_eval.jsonl]
    .venv/bin/dwarfstar eval --questions-file build/evals/ds4_eval.jsonl

The questions are third-party data (GPQA Diamond, CC BY 4.0; SuperGPQA, ODC-BY; an AIME 2025 mirror,
MIT; ds4's COMPSEC cases, MIT), so DwarfStar commits none of their text: this runs on the user's
machine, on the ds4 checkout they have, and writes each question with its source and licence.

ds4 keeps them as C designated initializers, `{ .source = "...", .id = "...", .domain = "...",
.title = "...", .question = "...", .choice[0] = "...", ..., .answer = "..." }`, in the array
`eval_cases[]`; a value may be several adjacent string literals. The answer kind follows ds4's rule:
choices make a multiple-choice question, the source COMPSEC a C line spec, anything else an integer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dwarfstar.evals import EvalError  # noqa: E402
from dwarfstar.evals.questions import parse_question  # noqa: E402

LICENSES = {
    "GPQA Diamond": "CC BY 4.0 (GPQA)",
    "SuperGPQA": "ODC-BY (SuperGPQA)",
    "AIME2025": "MIT (AIME 2025 mirror, test-time-compute/aime_2025)",
    "COMPSEC": "MIT (antirez/ds4 ds4_eval.c)",
}
ARRAY_START = re.compile(r"eval_case\s+eval_cases\s*\[\s*\]\s*=\s*\{")
FIELD = re.compile(r'\.(\w+)(?:\[(\d+)\])?\s*=\s*((?:"(?:[^"\\\n]|\\.)*"\s*)+)')
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{1,2}|[0-7]{1,3}|.)")
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "?": "?", "a": "\a", "0": "\0"}


def c_string(literals: str) -> str:
    """The value of adjacent C string literals (UTF-8 source, C escapes)."""
    raw = "".join(LITERAL.findall(literals))

    def unescape(match: re.Match) -> str:
        code = match.group(1)
        if code[0] == "x":
            return chr(int(code[1:], 16))
        if code[0] in "01234567" and (len(code) > 1 or code != "0"):
            return chr(int(code, 8))
        if code in SIMPLE_ESCAPES:
            return SIMPLE_ESCAPES[code]
        raise EvalError(f"unknown C escape \\{code}")

    return ESCAPE.sub(unescape, raw)


def case_blocks(source: str) -> list[str]:
    """The text of each `{ ... }` initializer in eval_cases[], braces inside strings ignored."""
    start = ARRAY_START.search(source)
    if start is None:
        raise EvalError("no `eval_case eval_cases[] = {` array in this file: is it ds4_eval.c?")
    blocks, depth, in_string, escaped, begin = [], 0, False, False, 0
    for pos in range(start.end(), len(source)):
        ch = source[pos]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
            begin = pos if depth == 1 else begin
        elif ch == "}":
            if depth == 0:
                return blocks  # the array's closing brace
            depth -= 1
            if depth == 0:
                blocks.append(source[begin + 1 : pos])
    raise EvalError("eval_cases[] is not closed")


def to_record(block: str, number: int) -> dict:
    fields: dict[str, str] = {}
    choices: dict[int, str] = {}
    for name, index, literals in FIELD.findall(block):
        if name == "choice":
            choices[int(index)] = c_string(literals)
        else:
            fields[name] = c_string(literals)
    if sorted(choices) != list(range(len(choices))):
        raise EvalError(f"case {number}: choices are not numbered 0..{len(choices) - 1}")
    source = fields.get("source", "")
    kind = "choice" if choices else "lines" if source == "COMPSEC" else "integer"
    record = {
        "source": source,
        "id": fields.get("id", ""),
        "domain": fields.get("domain", ""),
        "title": fields.get("title", ""),
        "question": fields.get("question", ""),
        "choices": [choices[i] for i in range(len(choices))],
        "answer": fields.get("answer", ""),
        "answer_kind": kind,
        "license": LICENSES.get(source, "see ds4_eval.c"),
    }
    parse_question(record, f"ds4_eval.c case {number}")  # the same checks `dwarfstar eval` makes
    return record


def import_questions(path: Path) -> list[dict]:
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read {path}: {exc}") from None
    records = [to_record(block, n) for n, block in enumerate(case_blocks(source), 1)]
    if not records:
        raise EvalError(f"{path}: eval_cases[] is empty")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ds4_eval_c", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "build" / "evals" / "ds4_eval.jsonl")
    args = parser.parse_args()
    try:
        records = import_questions(args.ds4_eval_c)
    except EvalError as exc:
        sys.exit(f"error: {exc}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    counts: dict[str, int] = {}
    for record in records:
        counts[record["source"]] = counts.get(record["source"], 0) + 1
    print(f"wrote {len(records)} questions to {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
