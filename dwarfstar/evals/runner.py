"""One eval question on a live session: ds4-eval's prompt, generation with thinking budgets, the grade.

Budgets (DS4_SURFACE §1.6), acting only while the model is still reasoning, with R the tokens left:
- hard: when R <= `hard_reply_budget`, `</think>` is forced (all of its tokens, one per step), so
  every question keeps a reserve to write its answer in instead of failing for reasoning too long;
- soft: when R <= `soft_reply_budget` and `</think>` is one token, it is taken if it ranks among the
  `soft_close_rank` most likely tokens: the model's own wish to stop, accepted early.
The hard budget must be below the token limit and at most the soft one, as ds4 requires.

The context is sized from the largest rendered prompt plus the token limit, refusing more than
ds4's 1,000,000.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dwarfstar.evals import DEFAULT_TOKENS, EvalError
from dwarfstar.evals.eval_trace import CaseRecord, ThinkClose
from dwarfstar.evals.questions import SYSTEM_PROMPT, Question
from dwarfstar.prompt.render import render_conversation
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.prefix import common_prefix_len
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer
from dwarfstar.tokenizer.specials import THINK_END
from dwarfstar.tokenizer.tokenizer import Tokenizer

MAX_CONTEXT = 1_000_000  # ds4-eval's cap


@dataclass(frozen=True)
class EvalSettings:
    max_tokens: int = DEFAULT_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.05
    seed: int | None = None
    think: bool = True
    soft_reply_budget: int = 1024
    soft_close_rank: int = 3
    hard_reply_budget: int = 512

    def check(self) -> None:
        if not 1 <= self.max_tokens <= MAX_CONTEXT:
            raise EvalError(f"--tokens must be in 1..{MAX_CONTEXT}, got {self.max_tokens}")
        if self.hard_reply_budget >= self.max_tokens:
            raise EvalError(
                f"--hard-limit-reply-budget ({self.hard_reply_budget}) must be below --tokens ({self.max_tokens})"
            )
        if self.soft_reply_budget < self.hard_reply_budget:
            raise EvalError(
                f"--soft-limit-reply-budget ({self.soft_reply_budget}) must be at least "
                f"--hard-limit-reply-budget ({self.hard_reply_budget})"
            )
        if self.hard_reply_budget < 0 or self.soft_close_rank < 0:
            raise EvalError("the reply budgets and --soft-limit-think-close-rank cannot be negative")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, min_p=self.min_p, seed=self.seed)

    @property
    def think_mode(self) -> str:
        return "think" if self.think else "nothink"


def prompt_ids(tokenizer: Tokenizer, question: Question, think: bool) -> list[int]:
    """BOS, the system prompt, `<｜User｜>question<｜Assistant｜>` and `<think>` (or `</think>`)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question.user_prompt()}]
    return tokenizer.encode_prompt(render_conversation(messages, thinking=think).parts)


def auto_context(tokenizer: Tokenizer, questions: Sequence[Question], settings: EvalSettings, model_max: int) -> int:
    """The largest prompt plus the token limit; an error above 1M tokens or the model's limit."""
    sizes = [(len(prompt_ids(tokenizer, q, settings.think)), q) for q in questions]
    largest, question = max(sizes, key=lambda item: item[0])
    ctx = largest + settings.max_tokens
    if ctx > MAX_CONTEXT:
        raise EvalError(
            f"the largest prompt ({largest} tokens, {question.label}) + --tokens ({settings.max_tokens}) "
            f"exceeds the {MAX_CONTEXT} token context cap"
        )
    if ctx > model_max:
        raise EvalError(f"the eval needs a context of {ctx} tokens; this model holds at most {model_max}")
    return ctx


def close_rank(logits: torch.Tensor, token: int, max_rank: int) -> int:
    """`token`'s 1-based rank among the `max_rank` most likely, 0 when it is not among them."""
    if max_rank <= 0:
        return 0
    top = torch.topk(logits.float().flatten(), min(max_rank, logits.numel())).indices.tolist()
    return top.index(token) + 1 if token in top else 0


class Stop(Exception):
    """The TUI asked to leave the running question: `reason` is "quit" or "switch"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Progress:
    """What a question reports as it runs; the TUI and the plain printer read it."""

    on_phase: Callable[[str], None] = lambda phase: None  # "prefill", "thinking", "answer"
    on_text: Callable[[str, bool], None] = lambda text, thinking: None
    check: Callable[[], None] = lambda: None  # raises Stop


def _stop_check(progress: Progress) -> Callable[[], bool]:
    def should_stop() -> bool:
        progress.check()  # raises Stop; the session is left at a chunk boundary
        return False

    return should_stop


def _blank_record(question: Question, settings: EvalSettings, prompt_tokens: int, index: int, total: int) -> CaseRecord:
    """A question's record before it runs: skipped, nothing generated."""
    return CaseRecord(
        index=index,
        total=total,
        source=question.source,
        id=question.id,
        domain=question.domain,
        title=question.title,
        status="skipped",
        picked="?",
        expected=question.answer,
        answer_kind=question.answer_kind,
        choices=question.choices,
        prompt_tokens=prompt_tokens,
        generated_tokens=0,
        elapsed_sec=0.0,
        temperature=settings.temperature,
        top_p=settings.top_p,
        min_p=settings.min_p,
        think_mode=settings.think_mode,
        system_prompt=SYSTEM_PROMPT,
        question_prompt=question.user_prompt(),
        output="",
    )


def run_question(
    session: Session,
    tokenizer: Tokenizer,
    question: Question,
    settings: EvalSettings,
    sampler: Sampler,
    index: int,
    total: int,
    progress: Progress | None = None,
) -> CaseRecord:
    """Prefill the question's prompt (reusing what the session holds), generate, grade."""
    progress = progress or Progress()
    ids = prompt_ids(tokenizer, question, settings.think)
    record = _blank_record(question, settings, len(ids), index, total)
    limit = min(settings.max_tokens, session.ctx - len(ids))
    if limit < 1:
        record.error = "prompt leaves no generation room" if len(ids) <= session.ctx else "prompt does not fit context"
        return record
    start = time.perf_counter()
    progress.on_phase("prefill")
    keep = common_prefix_len(session.tokens, ids)  # the system prompt is the same for every question
    session.truncate(keep)
    session.prefill(ids[keep:], should_stop=_stop_check(progress))
    eos = tokenizer.eos_id
    close_ids = tokenizer.encode_with_specials(THINK_END) if settings.think else []  # one special token
    thinking = settings.think
    progress.on_phase("thinking" if thinking else "answer")
    detok = IncrementalDetokenizer(tokenizer)
    text, forced = "", []
    for step in range(limit):
        progress.check()
        remaining = limit - step
        token, kind, rank = None, "none", 0
        if thinking and close_ids:
            if forced:
                token = forced.pop(0)
            elif remaining <= settings.hard_reply_budget:
                kind, token, forced = "hard_forced", close_ids[0], list(close_ids[1:])
            elif remaining <= settings.soft_reply_budget and len(close_ids) == 1:
                rank = close_rank(session.logits, close_ids[0], settings.soft_close_rank)
                if rank:
                    kind, token = "soft_forced", close_ids[0]
        if token is None:
            token = session.backend.sample_batch(session.logits.reshape(1, -1), [sampler])[0]
        if token == eos:
            break
        if kind != "none" and record.think_close.kind == "none":
            record.think_close = ThinkClose(kind, step + 1, remaining, rank)
        session.decode(token)
        record.generated_tokens += 1
        piece = detok.push(token)
        text += piece
        progress.on_text(piece, thinking)
        if thinking and THINK_END in text:
            thinking = False
            progress.on_phase("answer")
            if record.think_close.kind == "none":
                record.think_close = ThinkClose("natural", step + 1, remaining, 0)
    tail = detok.flush()
    progress.on_text(tail, thinking)
    record.output = text + tail
    record.elapsed_sec = time.perf_counter() - start
    graded = question.grade(record.output)
    record.picked, record.status = graded.picked, "passed" if graded.passed else "failed"
    return record


def report_lines(records: Sequence[CaseRecord], runtime_s: float) -> list[str]:
    """ds4-eval's final report: one line per question with tokens, time, status and answers."""
    passed = sum(r.status == "passed" for r in records)
    failed = sum(r.status == "failed" for r in records)
    head = f"eval: {passed}/{len(records)} passed" + (f", {failed} failed" if failed else "")
    lines = [
        head + f", runtime {runtime_s:.1f} s",
        f"{'#':>3} {'state':<8} {'prompt':>8} {'gen':>8} {'total':>8} {'time':>8} {'given':<8} {'correct':<8} test",
    ]
    for r in records:
        lines.append(
            f"{r.index:>3} {r.status:<8} {r.prompt_tokens:>8} {r.generated_tokens:>8} "
            f"{r.prompt_tokens + r.generated_tokens:>8} {r.elapsed_sec:>7.1f}s {r.picked or '-':<8} "
            f"{r.expected:<8} {r.source}/{r.id}"
        )
    return lines
