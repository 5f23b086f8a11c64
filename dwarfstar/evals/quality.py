"""`dwarfstar test quality`: ds4's 100-prompt quality set (gguf-tools/quality-testing, §5.6).

Each prompt is rendered as ds4's scorer does (`BOS<｜User｜>prompt<｜Assistant｜></think>`, no system
prompt, thinking off). A target continuation is then scored token by token, teacher-forced: its total
and mean negative log-likelihood (`nll`, `avg_nll`), whether our greedy first token is its first token
(`first_match`), and how many of its leading tokens our greedy choice reproduces before the first
difference (`greedy_lcp`). The per-case table is ds4's TSV
(`id prompt_tokens target_tokens nll avg_nll first_match greedy_lcp`).

The targets are either official continuations, from the `manifest.tsv` that ds4's
`collect_official.py` writes (`id<TAB>prompt_path<TAB>continuation_path`; they need a DeepSeek API key
and are not public), or another GGUF's greedy continuation (`--against REF.gguf`): q2 scored on the
continuations of q4, say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dwarfstar.engine.load import Engine
from dwarfstar.evals import EvalError, read_input
from dwarfstar.evals.vectors import vector_prompt_ids
from dwarfstar.session.session import Session

BUNDLED_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "evals" / "ds4_quality_prompts.jsonl"
TARGET_TOKENS = 24  # the length of ds4's official continuations
DEFAULT_CTX = 4096
TSV_HEADER = "id\tprompt_tokens\ttarget_tokens\tnll\tavg_nll\tfirst_match\tgreedy_lcp"


@dataclass(frozen=True)
class QualityCase:
    id: str
    prompt: str


@dataclass(frozen=True)
class CaseScore:
    id: str
    prompt_tokens: int
    target_tokens: int
    nll: float
    first_match: bool
    greedy_lcp: int

    @property
    def avg_nll(self) -> float:
        return self.nll / self.target_tokens if self.target_tokens else 0.0

    def tsv(self) -> str:
        return (
            f"{self.id}\t{self.prompt_tokens}\t{self.target_tokens}\t{self.nll:.9f}\t{self.avg_nll:.9f}\t"
            f"{int(self.first_match)}\t{self.greedy_lcp}"
        )


def read_quality_prompts(path: Path, limit: int | None = None) -> list[QualityCase]:
    lines = read_input(path, "quality prompts").splitlines()
    cases = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise EvalError(f"{path}:{number}: not JSON ({exc})") from None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("id"), str)
            or not isinstance(record.get("prompt"), str)
        ):
            raise EvalError(f'{path}:{number}: each line is {{"id": ..., "prompt": ...}} with strings')
        cases.append(QualityCase(record["id"], record["prompt"]))
    if not cases:
        raise EvalError(f"{path} holds no prompts")
    return cases[:limit] if limit else cases


def _manifest_path(manifest: Path, name: str) -> Path:
    path = Path(name)
    for candidate in (path, manifest.parent / path):
        if candidate.is_file():
            return candidate
    raise EvalError(f"{manifest}: file {name} not found")


def read_manifest(manifest: Path, limit: int | None = None) -> list[tuple[QualityCase, str]]:
    """Prompts and official continuations from ds4's `manifest.tsv`."""
    lines = read_input(manifest, "manifest").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 3:
            raise EvalError(f"{manifest}:{number}: a row is id, prompt path and continuation path, tab-separated")
        prompt, continuation = (_manifest_path(manifest, f).read_text(encoding="utf-8") for f in fields[1:3])
        rows.append((QualityCase(fields[0], prompt), continuation))
    if not rows:
        raise EvalError(f"{manifest} lists no cases")
    return rows[:limit] if limit else rows


def greedy_continuation(
    engine: Engine, case: QualityCase, tokens: int = TARGET_TOKENS, ctx: int = DEFAULT_CTX
) -> list[int]:
    """The reference model's own greedy continuation, EOS excluded: the targets of `--against`."""
    session = Session(engine.backend, ctx=ctx)
    session.prefill(vector_prompt_ids(engine, case.prompt))
    out: list[int] = []
    for _ in range(tokens):
        token = int(session.logits.argmax())
        if token == engine.tokenizer.eos_id:
            break
        out.append(token)
        session.decode(token)
    return out


def score_case(engine: Engine, case: QualityCase, target: list[int], ctx: int = DEFAULT_CTX) -> CaseScore:
    ids = vector_prompt_ids(engine, case.prompt)
    if len(ids) + len(target) + 1 >= ctx:
        raise EvalError(f"{case.id}: {len(ids)} prompt + {len(target)} target tokens exceed ctx={ctx}")
    session = Session(engine.backend, ctx=ctx)
    session.prefill(ids)
    nll, lcp, first, matching = 0.0, 0, False, True
    for i, token in enumerate(target):
        logits = session.logits.float().flatten().cpu()
        greedy = int(logits.argmax())
        if i == 0:
            first = greedy == token
        if matching and greedy == token:
            lcp += 1
        else:
            matching = False
        nll -= float(torch.log_softmax(logits, dim=-1)[token])
        if i + 1 < len(target):
            session.decode(token)
    return CaseScore(case.id, len(ids), len(target), nll, first, lcp)


def summary(scores: list[CaseScore]) -> str:
    tokens = sum(s.target_tokens for s in scores)
    avg = sum(s.nll for s in scores) / tokens if tokens else 0.0
    first = sum(s.first_match for s in scores)
    lcp = sum(s.greedy_lcp for s in scores) / len(scores) if scores else 0.0
    return f"summary cases={len(scores)} tokens={tokens} avg_nll={avg:.9f} first_match={first} avg_lcp={lcp:.3f}"
