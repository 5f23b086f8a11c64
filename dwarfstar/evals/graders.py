"""ds4-eval's answer extractors and graders (DS4_SURFACE §5.4), for three answer kinds.

Every extractor reads only what follows the first `</think>` (the whole output when there is none),
so an answer the model considered while reasoning never counts. Then:

- `choice`: the letter only in a form the prompt asks for or a reader takes as the answer, never a
  letter picked out of prose (ds4 falls back to any standalone letter, so Italian or English prose
  with the article "a" reads as choice A). In order, the first form found wins:
  1. an answer label ("Answer", "Final answer", "The answer is", "Risposta", "la risposta è", any
     case) followed, after only punctuation or markup (`: `, ` - (`, `:** **`), by the letter, which
     ends the line or is followed by `.`, `)` or `:` and the choice's text (`Answer: B. Manzoni`);
     the last such label in the text counts, as the prompt asks for a final line;
  2. the last boxed letter, `\\boxed{C}` or `\\boxed{\\text{C}}`;
  3. the last bold letter, `**D**` or `**(D)**`;
  4. the last line that holds nothing but the letter (markup, brackets and a period allowed), in
     upper case; a reply that is one letter in any case.
  A letter past the last choice is no answer. This deviates from ds4's extractor on purpose
  (issue 35): the letter prose happens to contain is no answer.
- `integer`: the first run of digits within 160 characters from the first "answer", else the last
  run of digits of the text; leading zeros are dropped (`007` is `7`, `000` is `0`).
- `lines` (ds4's C security review): the numbers and `a-b` ranges on the "answer" line (at most 160
  characters, up to the newline), written as `a,b-c`; when that line holds no number, the integer
  extractor's pick. The expected spec is a set of lines (`17-20`, `9,15`; `0` means the code is
  safe); an answer passes when every line it names is in that set and it names at least one.
  ds4 skips the first digit of a number that follows another after only spaces (`9 15` reads
  `9,5`); here both numbers count, the reading its own comment intends.

Nothing extracted is `?`, which never passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_KINDS = ("choice", "integer", "lines")
MAX_CHOICES = 10
THINK_CLOSE = "</think>"
NOTHING = "?"
NUMBER_WINDOW = 160  # ds4's reach after "answer" for a number or a line spec
MAX_LINE = 255  # ds4 grades line numbers 0..255 (its C files are short)

_ANSWER = re.compile("answer", re.IGNORECASE | re.ASCII)
_DIGITS = re.compile(r"[0-9]+")
_LINE_ITEM = re.compile(r"([0-9]+)(?:[ \t\r\f\v]*-[ \t\r\f\v]*([0-9]+))?")
_ANSWER_LINE = re.compile(
    r"(?:answer|risposta)(?:[ \t]+(?:is|è))?[^\w\n]*?"  # the label, then punctuation or markup only
    r"(?<![A-Za-z])([A-Za-z])"  # the letter
    r"[*_`)\]}$]*(?:[.):][ \t]+\S[^\n]*|[.,;:!)]*[*_`)\]}$ \t]*)$",  # the line ends, or the choice's text follows
    re.IGNORECASE | re.MULTILINE,
)
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{\s*)?\(?([A-Za-z])\)?\s*\}")
_BOLD = re.compile(r"(?:\*\*|__)\s*\(?([A-Z])\)?\.?\s*(?:\*\*|__)")
_LONE = re.compile(r"^[ \t*_`(\[>#]*([A-Za-z])[ \t*_`)\].]*$", re.MULTILINE)


@dataclass(frozen=True)
class Grade:
    picked: str  # the normalized answer read from the output, or "?"
    passed: bool


def visible_text(output: str) -> str:
    """What follows the first `</think>`: the reply a reader sees."""
    at = output.find(THINK_CLOSE)
    return output if at < 0 else output[at + len(THINK_CLOSE) :]


def _letters(pattern: re.Pattern[str], text: str) -> list[str]:
    return [m.group(1).upper() for m in pattern.finditer(text)]


def extract_choice(output: str, n_choices: int) -> str:
    text = visible_text(output)
    choices = {chr(ord("A") + i) for i in range(n_choices)}
    lone = [m.group(1) for m in _LONE.finditer(text)]
    whole = [letter.upper() for letter in lone if text.strip(" \t\n*_`()[].") == letter]
    for found in (
        _letters(_ANSWER_LINE, text),
        _letters(_BOXED, text),
        _letters(_BOLD, text),
        [letter for letter in lone if letter.isupper()] + whole,
    ):
        if found:
            return found[-1] if found[-1] in choices else NOTHING
    return NOTHING


def normalize_integer(digits: str) -> str:
    return digits.lstrip("0") or ("0" if digits else "")


def extract_integer(output: str) -> str:
    text = visible_text(output)
    found = _ANSWER.search(text)
    if found:
        first = _DIGITS.search(text[found.start() : found.start() + NUMBER_WINDOW])
        if first:
            return normalize_integer(first.group())
    runs = _DIGITS.findall(text)
    return normalize_integer(runs[-1]) if runs else NOTHING


def extract_lines(output: str) -> str:
    text = visible_text(output)
    found = _ANSWER.search(text)
    if found:
        line = text[found.start() : found.start() + NUMBER_WINDOW].split("\n", 1)[0]
        items = [f"{a}-{b}" if b else a for a, b in _LINE_ITEM.findall(line)]
        if items:
            return ",".join(items)
    return extract_integer(output)


def line_set(spec: str) -> set[int]:
    """The lines a spec such as `17-20,9` names, clipped to 0..MAX_LINE; reversed ranges count."""
    lines: set[int] = set()
    for a, b in _LINE_ITEM.findall(spec):
        low, high = sorted((int(a), int(b or a)))
        lines.update(range(max(low, 0), min(high, MAX_LINE) + 1))
    return lines


def lines_match(expected: str, picked: str) -> bool:
    want, got = line_set(expected), line_set(picked)
    return bool(want) and bool(got) and got <= want


def grade(kind: str, output: str, expected: str, n_choices: int = 0) -> Grade:
    """Read the answer of `kind` from a model output and compare it with the expected one."""
    if kind == "choice":
        picked = extract_choice(output, n_choices)
        return Grade(picked, picked != NOTHING and picked == expected.strip().upper()[:1])
    if kind == "integer":
        picked = extract_integer(output)
        return Grade(picked, picked != NOTHING and picked == normalize_integer(expected.strip()))
    if kind == "lines":
        picked = extract_lines(output)
        return Grade(picked, picked != NOTHING and lines_match(expected, picked))
    raise ValueError(f"unknown answer kind {kind!r}")  # question sets are validated on load
