"""`dwarfstar eval`: ds4-eval's capability benchmark on a JSONL question set (dwarfstar/evals/).

Without `--questions-file` it runs the bundled set written for this project
(`dwarfstar/data/evals/dwarfstar_v1.jsonl`); `tools/import_ds4_eval.py` turns ds4's 92 questions into
the same format on the user's machine. `--regrade-trace` and `--self-test-extractors` need no model.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app, given
from dwarfstar.commands.flags import MinP, ModelFlags, Seed, Temp, Think, TopP, output
from dwarfstar.evals import BUNDLED_SET, DEFAULT_TOKENS

if TYPE_CHECKING:
    from dwarfstar.engine.load import Engine
    from dwarfstar.evals.eval_trace import CaseRecord
    from dwarfstar.evals.runner import EvalSettings

SOFT_BUDGET, HARD_BUDGET = 1024, 512  # ds4-eval's reply budgets, at most a half and a quarter of -n when not given


def self_test_extractors() -> int:
    """Run the table of tricky outputs; returns the number of cases graded differently than written."""
    from dwarfstar.evals.extractor_cases import CASES
    from dwarfstar.evals.graders import grade

    failures = 0
    for case in CASES:
        got = grade(case.kind, case.output, case.expected, case.n_choices)
        if (got.picked, got.passed) != (case.picked, case.passed):
            failures += 1
            typer.echo(
                f"FAIL {case.name}: picked {got.picked} passed {got.passed}, "
                f"expected picked {case.picked} passed {case.passed}"
            )
    typer.echo(f"extractor self-test: {len(CASES) - failures}/{len(CASES)} passed")
    return failures


def print_regrade(path: Path) -> int:
    """Grade a trace's outputs again and print what changed; returns how many changed."""
    from dwarfstar.evals.eval_trace import regrade_trace

    results = regrade_trace(path)
    changed = 0
    for result in results:
        record, now = result.record, result.now
        status = "passed" if now.passed else "failed"
        mark = ""
        if result.changed:
            changed += 1
            mark = f"  CHANGED (was {record.status}, picked {record.picked})"
        typer.echo(
            f"{record.index:3d} {status:<7} picked {now.picked:<8} expected {record.expected:<8} "
            f"{record.source}/{record.id}{mark}"
        )
    passed = sum(r.now.passed for r in results)
    typer.echo(f"regraded {len(results)} cases: {passed} passed, {changed} changed from the trace")
    return changed


def _next_question(states: list[str], display, start: int) -> int | None:
    if display.requested is not None:
        index, display.requested = display.requested, None
        return index
    order = list(range(start, len(states))) + list(range(start))
    return next((i for i in order if states[i] == "pending"), None)


SoftBudget = Annotated[
    int, typer.Option(help="In the last N tokens, accept </think> when it ranks high enough (at most -n / 2).")
]
CloseRank = Annotated[int, typer.Option(help="How high </think> must rank for the soft limit to take it.")]
HardBudget = Annotated[
    int, typer.Option(help="Force </think> when N tokens remain (below --tokens, at most the soft budget; -n / 4).")
]


@app.command("eval", rich_help_panel=TOOLS)
def eval_command(
    model: ModelFlags,
    questions_file: Annotated[Path, typer.Option(help="Question set (JSONL).")] = BUNDLED_SET,
    questions: Annotated[int | None, typer.Option(help="Run only the first N questions.")] = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Most tokens generated per question.")] = DEFAULT_TOKENS,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    min_p: MinP = 0.05,
    seed: Seed = None,
    think: Think = True,
    soft_limit_reply_budget: SoftBudget = SOFT_BUDGET,
    soft_limit_think_close_rank: CloseRank = 3,
    hard_limit_reply_budget: HardBudget = HARD_BUDGET,
    trace: Annotated[Path | None, output(help="Write ds4-eval's trace (prompts, outputs, grades) to FILE.")] = None,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain streamed text instead of the split-screen TUI.")
    ] = False,
    pause_ms: Annotated[int, typer.Option(min=0, help="TUI: pause after each question, in ms.")] = 350,
    regrade_trace: Annotated[
        Path | None, typer.Option(help="Grade the outputs of an old trace again (no model).")
    ] = None,
    self_test: Annotated[
        bool, typer.Option("--self-test-extractors", help="Check the graders on a table of tricky outputs.")
    ] = False,
) -> None:
    """ds4-eval: run a question set, grade the answers after </think>, write a trace and a report."""
    if self_test:
        raise typer.Exit(1 if self_test_extractors() else 0)
    if regrade_trace is not None:
        raise typer.Exit(1 if print_regrade(regrade_trace) else 0)
    from dwarfstar.console.terminal import loading, note
    from dwarfstar.engine.load import load_engine
    from dwarfstar.evals.questions import load_questions
    from dwarfstar.evals.runner import EvalSettings, auto_context
    from dwarfstar.model.loader import open_model
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    settings = EvalSettings(
        max_tokens=tokens,
        temperature=temp,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        think=think,
        # a budget the user left alone shrinks with a small -n, so `-n 200` runs
        soft_reply_budget=soft_limit_reply_budget
        if given("soft_limit_reply_budget")
        else min(SOFT_BUDGET, tokens // 2),
        soft_close_rank=soft_limit_think_close_rank,
        hard_reply_budget=hard_limit_reply_budget
        if given("hard_limit_reply_budget")
        else min(HARD_BUDGET, tokens // 4),
    )
    settings.check()
    selected = load_questions(questions_file, questions)
    path = model.path()
    model_file = open_model(path)  # the context is sized before the weights are loaded for it
    tokenizer = Tokenizer.from_gguf_metadata(model_file.gguf.metadata)
    ctx = auto_context(tokenizer, selected, settings, model_file.args.max_seq_len)
    with loading(path) as bar:
        engine = load_engine(model.spec(ctx=ctx), bar)
    note(f"eval: {len(selected)} questions, ctx {ctx}, {engine.backend_name} backend")
    header = {
        "model": path,
        "backend": engine.backend_name,
        "ctx": ctx,
        "max_tokens": tokens,
        "max_prompt_tokens": ctx - tokens,
        "questions": len(selected),
        "temperature": f"{temp:.6g}",
        "top_p": f"{top_p:.6g}",
        "min_p": f"{min_p:.6g}",
        "seed": seed if seed is not None else "random",
        "think_mode_requested": settings.think_mode,
        "soft_limit_reply_budget": settings.soft_reply_budget,
        "hard_limit_reply_budget": settings.hard_reply_budget,
        "soft_limit_think_close_rank": soft_limit_think_close_rank,
    }
    run_eval(engine, ctx, selected, settings, trace, header, not plain and sys.stdin.isatty() and sys.stdout.isatty(),
             pause_ms)  # fmt: skip


def run_eval(engine: Engine, ctx: int, selected, settings: EvalSettings, trace, header, tui: bool, pause_ms: int):
    """The questions in the TUI's order (or one after another), the trace, and the report."""
    from dwarfstar.evals.eval_trace import write_case, write_header
    from dwarfstar.evals.runner import Progress, Stop, report_lines, run_question
    from dwarfstar.evals.tui import EvalTui, PlainDisplay
    from dwarfstar.sampling import Sampler
    from dwarfstar.session.session import Session

    session = Session(engine.backend, ctx=ctx)
    sampler = Sampler(settings.sampling)
    display = EvalTui(selected, engine.model.path.name) if tui else PlainDisplay()
    out = trace.open("wb") if trace else None
    if out:
        write_header(out, header)
    records: list[CaseRecord | None] = [None] * len(selected)
    states = ["pending"] * len(selected)
    start = time.perf_counter()
    try:
        with display:
            index = _next_question(states, display, 0)
            while index is not None and not display.quit:
                progress = Progress(display.phase, display.text, display.check)
                display.start(index + 1, len(selected), selected[index])
                try:
                    record = run_question(
                        session,
                        engine.tokenizer,
                        selected[index],
                        settings,
                        sampler,
                        index + 1,
                        len(selected),
                        progress,
                    )
                except Stop as stop:
                    if stop.reason == "quit":
                        states[index] = "stopped"
                        break
                    index = _next_question(states, display, index)
                    continue
                records[index], states[index] = record, record.status
                display.finish(record)
                if out:
                    write_case(out, record)
                if tui and pause_ms:
                    time.sleep(pause_ms / 1000)
                index = _next_question(states, display, index + 1)
    finally:
        if out:
            out.close()
    done = [r for r in records if r is not None]
    for line in report_lines(done, time.perf_counter() - start):
        typer.echo(line)
    if len(done) < len(selected):
        typer.echo(f"{len(selected) - len(done)} questions not run")
