"""ds4-eval's trace file: a header, then one block per question, and `--regrade-trace`.

Layout (DS4_SURFACE §5.4): `# ds4-eval trace` and `key: value` header lines, a blank line, then per
question `===== CASE i/n SOURCE/ID =====`, `key: value` lines (status, picked, expected, token counts,
time, sampling, thinking mode and how `</think>` came), the choices (`choices:` and `  A. text` lines)
or `answer_kind: ...`, and the `SYSTEM_PROMPT`, `QUESTION_PROMPT` and `MODEL_OUTPUT` blocks, each
`NAME_BEGIN bytes=N`, the N bytes of UTF-8 text (plus a newline when it does not end in one) and
`NAME_END`. The byte count is what a reader trusts, so an output that contains `MODEL_OUTPUT_END`
itself still reads back whole.

ds4 writes `answer_kind: exact_integer` for both its integer and its C questions and tells them apart
by the source `COMPSEC`; this trace writes `answer_kind: line_spec` for `lines` questions and reads
both spellings.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from dwarfstar.evals import EvalError
from dwarfstar.evals.graders import Grade, grade

TRACE_MAGIC = "# ds4-eval trace"
_CASE = re.compile(rb"^===== CASE (\d+)/(\d+) (.*) =====$")
_BLOCK = re.compile(rb"^([A-Z_]+)_BEGIN bytes=(\d+)$")
_CHOICE = re.compile(r"^  ([A-J])\. (.*)$")
KIND_NAMES = {"integer": "exact_integer", "lines": "line_spec"}
DS4_LINES_SOURCE = "COMPSEC"


@dataclass
class ThinkClose:
    kind: str = "none"  # natural, soft_forced, hard_forced or none
    token_index: int = 0
    remaining_budget: int = 0
    rank: int = 0


@dataclass
class CaseRecord:
    index: int  # 1-based, as written
    total: int
    source: str
    id: str
    domain: str
    title: str
    status: str  # passed, failed, skipped, stopped, error
    picked: str
    expected: str
    answer_kind: str
    choices: tuple[str, ...]
    prompt_tokens: int
    generated_tokens: int
    elapsed_sec: float
    temperature: float
    top_p: float
    min_p: float
    think_mode: str
    system_prompt: str
    question_prompt: str
    output: str
    think_close: ThinkClose = field(default_factory=ThinkClose)
    error: str = ""

    def regrade(self) -> Grade:
        return grade(self.answer_kind, self.output, self.expected, len(self.choices))


def _block(out: BinaryIO, name: str, text: str) -> None:
    data = text.encode("utf-8")
    out.write(f"{name}_BEGIN bytes={len(data)}\n".encode())
    if data:
        out.write(data if data.endswith(b"\n") else data + b"\n")
    out.write(f"{name}_END\n".encode())


def write_header(out: BinaryIO, settings: dict[str, object]) -> None:
    lines = [TRACE_MAGIC, f"started_unix: {int(time.time())}"] + [f"{k}: {v}" for k, v in settings.items()]
    out.write(("\n".join(lines) + "\n\n").encode("utf-8"))
    out.flush()


def write_case(out: BinaryIO, record: CaseRecord) -> None:
    close = record.think_close
    lines = [
        f"===== CASE {record.index}/{record.total} {record.source}/{record.id} =====",
        f"timestamp_unix: {int(time.time())}",
        f"source: {record.source}",
        f"id: {record.id}",
        f"domain: {record.domain}",
        f"title: {record.title}",
        f"status: {record.status}",
        f"picked: {record.picked or '?'}",
        f"expected: {record.expected}",
        f"prompt_tokens: {record.prompt_tokens}",
        f"generated_tokens: {record.generated_tokens}",
        f"elapsed_sec: {record.elapsed_sec:.3f}",
        f"temperature: {record.temperature:.6g}",
        f"top_p: {record.top_p:.6g}",
        f"min_p: {record.min_p:.6g}",
        f"think_mode_effective: {record.think_mode}",
    ]
    if close.kind != "none":
        lines += [
            f"think_close: {close.kind}",
            f"think_close_token_index: {close.token_index}",
            f"think_close_remaining_budget: {close.remaining_budget}",
            f"think_close_rank: {close.rank}",
        ]
    else:
        lines.append("think_close: none")
    if record.error:
        lines.append(f"error: {record.error}")
    if record.choices:
        lines.append("choices:")
        lines += [f"  {chr(ord('A') + i)}. {c}" for i, c in enumerate(record.choices)]
    else:
        lines.append(f"answer_kind: {KIND_NAMES[record.answer_kind]}")
    out.write(("\n".join(lines) + "\n").encode("utf-8"))
    _block(out, "SYSTEM_PROMPT", record.system_prompt)
    _block(out, "QUESTION_PROMPT", record.question_prompt)
    _block(out, "MODEL_OUTPUT", record.output)
    out.write(b"\n")
    out.flush()


def _number(fields: dict[str, str], key: str, kind: type, where: str) -> int | float:
    try:
        return kind(fields.get(key, "0"))
    except ValueError:
        raise EvalError(f"{where}: {key} is not a number: {fields[key]!r}") from None


def _record(
    fields: dict[str, str], choices: list[str], blocks: dict[str, str], head: re.Match, where: str
) -> CaseRecord:
    missing = [k for k in ("source", "id", "status", "expected") if k not in fields]
    if missing or "MODEL_OUTPUT" not in blocks:
        raise EvalError(f"{where}: case lacks {', '.join(missing or ['MODEL_OUTPUT'])}")
    if choices:
        kind = "choice"
    else:
        named = fields.get("answer_kind", "exact_integer")
        if named not in KIND_NAMES.values():
            raise EvalError(f"{where}: unknown answer_kind {named!r}")
        lines = named == "line_spec" or fields["source"] == DS4_LINES_SOURCE
        kind = "lines" if lines else "integer"
    close = ThinkClose(
        fields.get("think_close", "none"),
        *(int(_number(fields, f"think_close_{k}", int, where)) for k in ("token_index", "remaining_budget", "rank")),
    )
    return CaseRecord(
        index=int(head.group(1)),
        total=int(head.group(2)),
        source=fields["source"],
        id=fields["id"],
        domain=fields.get("domain", ""),
        title=fields.get("title", ""),
        status=fields["status"],
        picked=fields.get("picked", "?"),
        expected=fields["expected"],
        answer_kind=kind,
        choices=tuple(choices),
        prompt_tokens=int(_number(fields, "prompt_tokens", int, where)),
        generated_tokens=int(_number(fields, "generated_tokens", int, where)),
        elapsed_sec=float(_number(fields, "elapsed_sec", float, where)),
        temperature=float(_number(fields, "temperature", float, where)),
        top_p=float(_number(fields, "top_p", float, where)),
        min_p=float(_number(fields, "min_p", float, where)),
        think_mode=fields.get("think_mode_effective", ""),
        system_prompt=blocks.get("SYSTEM_PROMPT", ""),
        question_prompt=blocks.get("QUESTION_PROMPT", ""),
        output=blocks["MODEL_OUTPUT"],
        think_close=close,
        error=fields.get("error", ""),
    )


def read_trace(path: Path) -> tuple[dict[str, str], list[CaseRecord]]:
    """The header fields and the cases of a trace written by ds4-eval or `dwarfstar eval`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EvalError(f"cannot read trace {path}: {exc}") from None
    if not data.startswith(TRACE_MAGIC.encode()):
        raise EvalError(f"{path} is not an eval trace (it does not start with {TRACE_MAGIC!r})")
    header: dict[str, str] = {}
    cases: list[CaseRecord] = []
    pos = 0
    head = None
    fields: dict[str, str] = {}
    choices: list[str] = []
    blocks: dict[str, str] = {}
    in_choices = False

    def finish() -> None:
        if head is not None:
            cases.append(_record(fields, choices, blocks, head, f"{path} case {head.group(1)}"))

    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        where = f"{path} (byte {pos})"
        line, pos = data[pos:end], end + 1
        if (found := _CASE.match(line)) is not None:
            finish()
            head, fields, choices, blocks, in_choices = found, {}, [], {}, False
            continue
        if (found := _BLOCK.match(line)) is not None and head is not None:
            name, size = found.group(1).decode(), int(found.group(2))
            body = data[pos : pos + size]
            if len(body) < size:
                raise EvalError(f"{where}: {name} block is cut short ({len(body)} of {size} bytes)")
            pos += size
            if size and not body.endswith(b"\n"):
                pos += 1  # the newline the writer added
            closing = f"{name}_END\n".encode()
            if not data.startswith(closing, pos) and data[pos:] != closing[:-1]:
                raise EvalError(f"{where}: {name} block does not end with {name}_END after {size} bytes")
            pos += len(closing)
            blocks[name] = body.decode("utf-8", errors="replace")
            continue
        text = line.decode("utf-8", errors="replace")
        if head is not None and in_choices and (choice := _CHOICE.match(text)):
            choices.append(choice.group(2))
            continue
        in_choices = False
        if not text or text.startswith("#"):
            continue
        key, sep, value = text.partition(": ")
        if not sep and text.endswith(":"):
            key, value = text[:-1], ""
        elif not sep:
            raise EvalError(f"{where}: expected 'key: value', got {text[:60]!r}")
        if head is None:
            header[key] = value
        elif key == "choices":
            in_choices = True
        else:
            fields[key] = value
    finish()
    return header, cases


@dataclass
class Regraded:
    record: CaseRecord
    now: Grade

    @property
    def changed(self) -> bool:
        was_passed = self.record.status == "passed"
        graded = self.record.status in ("passed", "failed")
        return graded and (self.now.picked != self.record.picked or self.now.passed != was_passed)


def regrade_trace(path: Path) -> list[Regraded]:
    """Grade every recorded output again with today's graders; no model is needed."""
    _, cases = read_trace(path)
    return [Regraded(case, case.regrade()) for case in cases]
