"""`dwarfstar test vectors`: ds4's logprob vectors (`ds4_test --logprob-vectors`, DS4_SURFACE §5.1, §5.3).

A vector file (`# ds4-official-logprob-vectors-v1`) holds cases:

    case <id> <ctx> <steps> <prompt-file>
    step <index> <selected-token-hex> <top-count>
    top <token-hex> <logprob>          (top-count lines)
    end

Each case renders `BOS<｜User｜>prompt<｜Assistant｜></think>` (no system prompt, thinking off), runs it
in a session of `ctx` tokens and decodes greedily for `steps` tokens. Every step must select a token
with exactly the recorded bytes, every recorded top token must be among our 20 most likely (matched by
bytes, since the file holds no ids), with |our logprob - recorded| <= 4. Tokens are compared by bytes
because the official vectors come from the DeepSeek API, which names tokens only by their text.

ds4 skips `long_memory_archive`: the public API and the official graph (Hadamard + FP4 indexer)
disagree on it, and ds4 keeps the official graph. The same case is skipped here, with that reason.

A relative prompt path is looked up from the vector file's folder, dropping its leading folders until
it exists: ds4 writes paths from its repository root (`tests/test-vectors/prompts/x.txt`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dwarfstar.engine.load import Engine
from dwarfstar.evals import EvalError, read_input
from dwarfstar.prompt.render import render_conversation
from dwarfstar.session.session import Session

VECTOR_MAGIC = "# ds4-official-logprob-vectors-v1"
LOCAL_TOP = 20
MAX_LOGPROB_DELTA = 4.0
DS4_SKIPS = {"long_memory_archive": "skipped as in ds4: the public API and the official graph disagree on it"}


@dataclass
class VectorStep:
    selected: bytes
    top: list[tuple[bytes, float]]


@dataclass
class VectorCase:
    id: str
    ctx: int
    prompt_path: Path
    steps: list[VectorStep] = field(default_factory=list)
    declared_steps: int = 0


@dataclass
class CaseResult:
    id: str
    passed: bool
    skipped: str = ""  # the reason, when skipped
    problems: list[str] = field(default_factory=list)
    selected: list[bytes] = field(default_factory=list)
    max_delta: float = 0.0


def _hex(text: str, where: str) -> bytes:
    try:
        data = bytes.fromhex(text)
    except ValueError:
        raise EvalError(f"{where}: bad token hex {text!r}") from None
    if not data:
        raise EvalError(f"{where}: empty token hex")
    return data


def _int(text: str, where: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise EvalError(f"{where}: {what} is not an integer: {text!r}") from None
    if value < 0:
        raise EvalError(f"{where}: {what} cannot be negative")
    return value


def resolve_prompt(vector_file: Path, name: str) -> Path:
    path = Path(name)
    if path.is_absolute():
        candidates = [path]
    else:
        parts = path.parts
        candidates = [vector_file.parent.joinpath(*parts[i:]) for i in range(len(parts))]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise EvalError(f"{vector_file}: prompt file {name} not found (looked for {candidates[0]})")


def read_vector_file(path: Path) -> list[VectorCase]:
    lines = read_input(path, "vector file").splitlines()
    if not lines or lines[0].strip() != VECTOR_MAGIC:
        raise EvalError(f"{path} is not a ds4 vector file (first line must be {VECTOR_MAGIC!r})")
    cases: list[VectorCase] = []
    case: VectorCase | None = None
    tops_left = 0
    for number, line in enumerate(lines, 1):
        where = f"{path}:{number}"
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        kind = words[0]
        if kind == "case" and len(words) == 5 and case is None:
            case = VectorCase(words[1], _int(words[2], where, "ctx"), resolve_prompt(path, words[4]))
            case.declared_steps = _int(words[3], where, "steps")
            if case.ctx < 1:
                raise EvalError(f"{where}: ctx must be positive")
        elif kind == "step" and len(words) == 4 and case is not None and tops_left == 0:
            if _int(words[1], where, "step index") != len(case.steps):
                raise EvalError(f"{where}: step {words[1]} out of order (expected {len(case.steps)})")
            case.steps.append(VectorStep(_hex(words[2], where), []))
            tops_left = _int(words[3], where, "top count")
        elif kind == "top" and len(words) == 3 and case is not None and tops_left > 0:
            try:
                logprob = float(words[2])
            except ValueError:
                raise EvalError(f"{where}: logprob is not a number: {words[2]!r}") from None
            if not math.isfinite(logprob):
                raise EvalError(f"{where}: logprob must be finite")
            case.steps[-1].top.append((_hex(words[1], where), logprob))
            tops_left -= 1
        elif kind == "end" and case is not None and tops_left == 0:
            if len(case.steps) != case.declared_steps:
                raise EvalError(f"{where}: case {case.id} declares {case.declared_steps} steps, has {len(case.steps)}")
            cases.append(case)
            case = None
        else:
            raise EvalError(f"{where}: unexpected line {line.strip()[:60]!r}")
    if case is not None:
        raise EvalError(f"{path}: case {case.id} has no 'end'")
    if not cases:
        raise EvalError(f"{path} holds no cases")
    return cases


def vector_prompt_ids(engine: Engine, prompt: str) -> list[int]:
    """`BOS<｜User｜>prompt<｜Assistant｜></think>`: ds4's vector rendering."""
    parts = render_conversation([{"role": "user", "content": prompt}], thinking=False).parts
    return engine.tokenizer.encode_prompt(parts)


def run_case(engine: Engine, case: VectorCase, max_delta: float = MAX_LOGPROB_DELTA) -> CaseResult:
    if case.id in DS4_SKIPS:
        return CaseResult(case.id, passed=True, skipped=DS4_SKIPS[case.id])
    result = CaseResult(case.id, passed=True)
    session = Session(engine.backend, ctx=case.ctx)
    session.prefill(vector_prompt_ids(engine, read_input(case.prompt_path, "prompt file")))
    token_bytes = engine.tokenizer.token_bytes
    for i, step in enumerate(case.steps):
        logits = session.logits.float().flatten().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        top = logprobs.topk(LOCAL_TOP)
        local = {token_bytes(int(t)): float(v) for v, t in zip(top.values, top.indices, strict=True)}
        chosen = int(logits.argmax())
        result.selected.append(token_bytes(chosen))
        if token_bytes(chosen) != step.selected:
            result.problems.append(
                f"step {i}: selected {token_bytes(chosen).hex()} ({token_bytes(chosen)!r}), "
                f"expected {step.selected.hex()} ({step.selected!r})"
            )
        for want, logprob in step.top:
            if want not in local:
                result.problems.append(f"step {i}: top token {want.hex()} ({want!r}) is not in our top {LOCAL_TOP}")
                continue
            delta = abs(local[want] - logprob)
            result.max_delta = max(result.max_delta, delta)
            if delta > max_delta:
                result.problems.append(
                    f"step {i}: logprob of {want!r} is {local[want]:.3f}, expected {logprob:.3f} "
                    f"(off by more than {max_delta})"
                )
        if i + 1 < len(case.steps):
            session.decode(chosen)
    result.passed = not result.problems
    return result
