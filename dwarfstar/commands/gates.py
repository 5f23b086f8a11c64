"""`dwarfstar test`: ds4_test's gates on real weights (vectors, long-context, tool-call, quality).

Each gate prints one line per case and exits 1 when a check fails, so scripts (`tools/gpu_check.sh`,
`tools/real_model_check.sh`) can run them one after another. The model defaults as in `run`
(`DS4_TEST_MODEL`, else ./ds4flash.gguf, else the bundled model); ds4's environment variables name
the vector file and the long prompt too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import test_app
from dwarfstar.commands.flags import MODEL, ModelFlags, output
from dwarfstar.commands.flags import Backend as BackendOption
from dwarfstar.commands.flags import Precision as PrecisionOption  # ds4's fast and --quality kernels: ours

ModelOption = Annotated[
    Path | None,
    typer.Option(
        "-m", "--model", envvar="DS4_TEST_MODEL", help="GGUF model (default: as in run).", rich_help_panel=MODEL
    ),
]


def _engine(model: Path | None, backend: str, ctx: int, precision: str = "exact"):
    from dwarfstar.commands.engines import start
    from dwarfstar.engine.load import require_v4

    engine = start(ModelFlags(model, backend, precision).spec(ctx=ctx))[0]
    require_v4(engine, "dwarfstar test")  # its vectors and stories are V4's
    return engine


def _verdict(name: str, passed: bool, detail: str) -> None:
    typer.secho(f"{name}: {'PASS' if passed else 'FAIL'} {detail}", fg="green" if passed else "red")
    if not passed:
        raise typer.Exit(1)


@test_app.command("vectors")
def vectors(
    vector_file: Annotated[
        Path, typer.Option(envvar="DS4_TEST_VECTOR_FILE", help="ds4 vector file (tests/test-vectors/official.vec).")
    ],
    model: ModelOption = None,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    max_delta: Annotated[float, typer.Option(help="Largest |logprob - recorded| allowed.")] = 4.0,
) -> None:
    """Official logprob vectors: greedy tokens equal by bytes, recorded tops in our top 20, |dlogprob| <= 4."""
    from dwarfstar.evals.vectors import read_vector_file, run_case

    cases = read_vector_file(vector_file)
    engine = _engine(model, backend, max(c.ctx for c in cases), precision)
    failed = 0
    for case in cases:
        result = run_case(engine, case, max_delta)
        if result.skipped:
            typer.echo(f"vector {case.id}: skipped ({result.skipped})")
            continue
        tokens = " | ".join(t.decode("utf-8", errors="replace") for t in result.selected)
        status = "ok" if result.passed else "FAIL"
        typer.echo(f"vector {case.id}: {status} [{tokens}] max |dlogprob| {result.max_delta:.3f}")
        for problem in result.problems:
            typer.echo(f"  {problem}")
        failed += not result.passed
    _verdict("test vectors", failed == 0, f"{len(cases) - failed}/{len(cases)} cases")


@test_app.command("long-context")
def long_context(
    prompt_file: Annotated[
        Path,
        typer.Option(
            envvar="DS4_TEST_LONG_PROMPT", help="Rendered story prompt (tests/long_context_story_prompt.txt)."
        ),
    ],
    facts: Annotated[
        Path | None, typer.Option(help="Facts, one a line (Name=number or a phrase); default: ds4's 16.")
    ] = None,
    model: ModelOption = None,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    ctx: Annotated[int, typer.Option(help="Session context.")] = 100_000,
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Greedy tokens to generate.")] = 350,
    min_prompt_tokens: Annotated[int, typer.Option(help="The prompt must be longer than this.")] = 30_000,
) -> None:
    """Long-context recall: every fact of the story must be in the greedy answer."""
    from dwarfstar.console.terminal import PrefillProgress
    from dwarfstar.evals.long_context import read_facts, run_long_context

    wanted = read_facts(facts)
    engine = _engine(model, backend, ctx, precision)
    with PrefillProgress() as bar:
        result = run_long_context(engine, prompt_file, wanted, ctx, tokens, min_prompt_tokens, bar.update)
    typer.echo(f"prompt {result.prompt_tokens} tokens; output:\n{result.output}")
    for problem in result.problems:
        typer.echo(f"  {problem}")
    _verdict("test long-context", result.passed, f"{result.found}/{len(wanted)} facts")


@test_app.command("tool-call")
def tool_call(
    model: ModelOption = None,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    ctx: Annotated[int, typer.Option(help="Server context.")] = 32768,
    expect: Annotated[
        Path | None, typer.Option(help="Expected reply (JSON) for a model that does not call tools: exact match.")
    ] = None,
) -> None:
    """Tool-call quality: ds4's list_files request through the server must come back as a parsed call."""
    import json

    from dwarfstar.evals.tool_call import run_tool_call

    engine = _engine(model, backend, ctx, precision)
    result = run_tool_call(engine, ctx, expect)
    typer.echo(json.dumps(result.reply, ensure_ascii=False)[:2000])
    for problem in result.problems:
        typer.echo(f"  {problem}")
    detail = "matches the expected reply" if expect else "a parsed list_files call"
    _verdict("test tool-call", result.passed, detail if result.passed else f"{len(result.problems)} problems")


@test_app.command("quality")
def quality(
    model: ModelOption = None,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    prompts: Annotated[Path | None, typer.Option(help="Prompts JSONL (default: ds4's 100).")] = None,
    manifest: Annotated[
        Path | None, typer.Option(help="ds4's manifest.tsv of official continuations (collect_official.py).")
    ] = None,
    against: Annotated[Path | None, typer.Option(help="Score on this GGUF's greedy continuations instead.")] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N prompts.")] = None,
    ctx: Annotated[int, typer.Option(help="Session context.")] = 4096,
    out: Annotated[Path | None, output(help="Write ds4's per-case TSV here.")] = None,
    max_avg_nll: Annotated[float | None, typer.Option(help="Fail when the overall avg_nll is above this.")] = None,
) -> None:
    """The 100-prompt quality set: avg_nll, first-token matches and greedy common prefix on target continuations."""
    from dwarfstar.errors import DwarfStarError
    from dwarfstar.evals import quality as q

    if (manifest is None) == (against is None):
        raise DwarfStarError("give --manifest (official continuations) or --against REF.gguf, one of them")
    if manifest is not None:
        if prompts is not None:
            raise DwarfStarError("--manifest holds its own prompts; --prompts goes with --against")
        engine = _engine(model, backend, ctx, precision)
        rows = [(case, engine.tokenizer.encode(text)) for case, text in q.read_manifest(manifest, limit)]
    else:
        cases = q.read_quality_prompts(prompts or q.BUNDLED_PROMPTS, limit)
        reference = _engine(against, backend, ctx, precision)
        rows = [(case, q.greedy_continuation(reference, case, ctx=ctx)) for case in cases]
        del reference
        engine = _engine(model, backend, ctx, precision)
    scores = []
    lines = [q.TSV_HEADER]
    for case, target in rows:
        score = q.score_case(engine, case, target, ctx)
        scores.append(score)
        lines.append(score.tsv())
        typer.echo(f"{case.id} target={score.target_tokens} avg_nll={score.avg_nll:.6f} lcp={score.greedy_lcp}")
    if out:
        out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    line = q.summary(scores)
    tokens = sum(s.target_tokens for s in scores)
    overall = sum(s.nll for s in scores) / tokens if tokens else 0.0
    _verdict("test quality", max_avg_nll is None or overall <= max_avg_nll, line)
