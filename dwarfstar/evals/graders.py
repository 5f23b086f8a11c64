"""ds4-eval's answer extractors and graders (DS4_SURFACE §5.4), for three answer kinds.

Every extractor reads only what follows the first `</think>` (the whole output when there is none),
so an answer the model considered while reasoning never counts. Then:

- `choice`: the first standalone letter A..(last choice) within 96 characters from the first
  case-insensitive "answer", else the last standalone letter of the text. Letters are compared in
  upper case, as ds4 does, so a lone "a" after "answer" reads as A. "Standalone" means no ASCII
  letter on either side.
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
CHOICE_WINDOW = 96  # ds4's reach after "answer" for a letter
NUMBER_WINDOW = 160  # and for a number or a line spec
MAX_LINE = 255  # ds4 grades line numbers 0..255 (its C files are short)

_ANSWER = re.compile("answer", re.IGNORECASE | re.ASCII)
_DIGITS = re.compile(r"[0-9]+")
_LINE_ITEM = re.compile(r"([0-9]+)(?:[ \t\r\f\v]*-[ \t\r\f\v]*([0-9]+))?")


@dataclass(frozen=True)
class Grade:
    picked: str  # the normalized answer read from the output, or "?"
    passed: bool


def visible_text(output: str) -> str:
    """What follows the first `</think>`: the reply a reader sees."""
    at = output.find(THINK_CLOSE)
    return output if at < 0 else output[at + len(THINK_CLOSE) :]


def _is_letter(text: str, i: int) -> bool:
    return 0 <= i < len(text) and text[i].isascii() and text[i].isalpha()


def _standalone_choice(text: str, i: int, last: str) -> str | None:
    letter = text[i].upper()
    if "A" <= letter <= last and text[i].isascii() and not _is_letter(text, i - 1) and not _is_letter(text, i + 1):
        return letter
    return None


def extract_choice(output: str, n_choices: int) -> str:
    text = visible_text(output)
    last = chr(ord("A") + n_choices - 1)
    found = _ANSWER.search(text)
    if found:
        for i in range(found.start(), min(len(text), found.start() + CHOICE_WINDOW)):
            letter = _standalone_choice(text, i, last)
            if letter:
                return letter
    for i in range(len(text) - 1, -1, -1):
        letter = _standalone_choice(text, i, last)
        if letter:
            return letter
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
