"""Question sets for `dwarfstar eval`: JSONL, one question per line, and ds4-eval's prompts.

Each line is an object with `source`, `id`, `domain`, `question`, `choices` (a list, empty unless the
kind is `choice`), `answer` and `answer_kind` (`choice`, `integer` or `lines`); `title` (shown in
the TUI and the trace; default: the question's first words) and `license` are optional. Loading checks
every field, so a bad set fails before any model is loaded.

The prompts are ds4-eval's (DS4_SURFACE §5.4): one system prompt for every question, and the question
followed by its lettered choices and a closing instruction that names the answer line's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dwarfstar.evals import EvalError, read_input
from dwarfstar.evals.graders import ANSWER_KINDS, MAX_CHOICES, Grade, grade

SYSTEM_PROMPT = (
    "You are solving a hard benchmark question. Reason carefully. "
    "The final answer must follow the requested format exactly."
)
_FINAL_LINE = "At the end, write exactly one final line in this format and do not write anything after it:\n"
INSTRUCTIONS = {
    "choice": "\nSolve the question. " + _FINAL_LINE + "Answer: <letter>",
    "lines": "\n" + _FINAL_LINE + "Answer: <line number or comma-separated line numbers>",
    "integer": "\nSolve the problem. " + _FINAL_LINE + "Answer: <integer>",
}
TITLE_CHARS = 60
_LINE_SPEC = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")
_REQUIRED = ("source", "id", "domain", "question", "choices", "answer", "answer_kind")


@dataclass(frozen=True)
class Question:
    source: str
    id: str
    domain: str
    question: str
    answer: str
    answer_kind: str
    choices: tuple[str, ...] = ()
    title: str = ""
    license: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        return f"{self.source}/{self.id}"

    def user_prompt(self) -> str:
        text = self.question + "\n"
        if self.choices:
            text += "\nChoices:\n" + "".join(f"{chr(ord('A') + i)}. {c}\n" for i, c in enumerate(self.choices))
        return text + INSTRUCTIONS[self.answer_kind]

    def grade(self, output: str) -> Grade:
        return grade(self.answer_kind, output, self.answer, len(self.choices))


def _check(question: Question, where: str) -> None:
    kind = question.answer_kind
    if kind not in ANSWER_KINDS:
        raise EvalError(f"{where}: unknown answer_kind {kind!r}; choose one of {', '.join(ANSWER_KINDS)}")
    if kind == "choice":
        if not 2 <= len(question.choices) <= MAX_CHOICES:
            raise EvalError(f"{where}: a choice question needs 2..{MAX_CHOICES} choices, got {len(question.choices)}")
        letters = [chr(ord("A") + i) for i in range(len(question.choices))]
        if question.answer not in letters:
            raise EvalError(f"{where}: answer {question.answer!r} is not one of the letters {''.join(letters)}")
    elif question.choices:
        raise EvalError(f"{where}: only choice questions have choices")
    if kind == "integer" and not question.answer.isdigit():
        raise EvalError(f"{where}: an integer answer must be digits, got {question.answer!r}")
    if kind == "lines" and not _LINE_SPEC.match(question.answer):
        raise EvalError(f"{where}: a lines answer is a spec such as 17-20 or 9,15 (0: safe), got {question.answer!r}")


def parse_question(record: object, where: str) -> Question:
    if not isinstance(record, dict):
        raise EvalError(f"{where}: each line must be a JSON object")
    missing = [name for name in _REQUIRED if name not in record]
    if missing:
        raise EvalError(f"{where}: missing {', '.join(missing)}")
    texts = {name: record[name] for name in _REQUIRED if name != "choices"}
    texts.update({name: record.get(name, "") for name in ("title", "license")})
    bad = [name for name, value in texts.items() if not isinstance(value, str)]
    choices = record["choices"]
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        bad.append("choices")
    if bad:
        raise EvalError(f"{where}: {', '.join(bad)} must be {'a list of strings' if bad == ['choices'] else 'strings'}")
    extra = {k: v for k, v in record.items() if k not in (*_REQUIRED, "title", "license")}
    title = texts["title"] or " ".join(texts["question"].split())[:TITLE_CHARS].rstrip()
    question = Question(
        source=texts["source"],
        id=texts["id"],
        domain=texts["domain"],
        question=texts["question"],
        answer=texts["answer"].strip(),
        answer_kind=texts["answer_kind"],
        choices=tuple(choices),
        title=title,
        license=texts["license"],
        extra=extra,
    )
    _check(question, where)
    return question


def load_questions(path: Path, limit: int | None = None) -> list[Question]:
    """The questions of a JSONL file, the first `limit` of them when given."""
    lines = read_input(path, "question set").splitlines()
    questions: list[Question] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise EvalError(f"{where}: not JSON ({exc})") from None
        question = parse_question(record, where)
        if question.label in seen:
            raise EvalError(f"{where}: duplicate question {question.label}")
        seen.add(question.label)
        questions.append(question)
    if not questions:
        raise EvalError(f"{path} holds no questions")
    if limit is not None:
        if limit < 1:
            raise EvalError(f"--questions must be at least 1, got {limit}")
        questions = questions[:limit]
    return questions
