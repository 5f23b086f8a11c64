"""The MTP speculation flags (`--mtp`, `--mtp-draft`, `--mtp-margin`, `--mtp-align`) and the one-shot
speculative reply `run` prints with them, plus `dwarfstar bench mtp`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.bench import bench_app
from dwarfstar.engine import BACKENDS, Engine, load_engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.hub import resolve_model
from dwarfstar.session.sampling import GREEDY, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import ALIGNMENTS, MAX_DRAFT
from dwarfstar.speculative.options import MTPOptions
from dwarfstar.terminal import note
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer
from dwarfstar.tokenizer.tokenizer import Tokenizer

BENCH_PROMPT = "Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti"

MTPFileOption = Annotated[
    Path | None,
    typer.Option(
        "--mtp",
        metavar="FILE",
        help="ds4's separate MTP GGUF (default: the model file's in-file nextn block; the bundled model's own).",
    ),
]
MTPDraftOption = Annotated[
    int | None,
    typer.Option(
        "--mtp-draft", metavar="N", help=f"Speculate with the MTP block drafting N tokens a step (1..{MAX_DRAFT})."
    ),
]
MTPMarginOption = Annotated[
    float,
    typer.Option(
        "--mtp-margin", help="Stop drafting at a draft whose top-1/top-2 logit gap is below this (0..1000; 0: never)."
    ),
]
MTPAlignOption = Annotated[
    str,
    typer.Option(
        "--mtp-align",
        help="next: hidden state i with token i+1 (DeepSeek-V3 training, vLLM); same: with token i (ds4).",
    ),
]


def speculative_reply(
    engine: Engine, options: MTPOptions, ids: list[int], params: SamplingParams, max_tokens: int, ctx: int
) -> None:
    """Prefill `ids`, stream the reply's text to stdout, then a line of speculation figures."""
    spec = options.speculator(engine, ctx)
    start = time.perf_counter()
    spec.prefill(ids)
    prefill_s = time.perf_counter() - start
    text = IncrementalDetokenizer(engine.tokenizer)
    start, count = time.perf_counter(), 0
    for token in spec.generate(max_tokens, params, [engine.model.args.eos_token_id]):
        count += 1
        sys.stdout.write(text.push(token))
        sys.stdout.flush()
    sys.stdout.write(text.flush() + "\n")
    decode_s = time.perf_counter() - start
    stats = spec.stats
    per_position = ", ".join(f"{a:.2f}" for a in stats.acceptance()) or "-"
    note(
        f"prefill {len(ids)} tokens {prefill_s:.2f} s | decode {count} tokens {count / max(decode_s, 1e-9):.2f} tok/s"
        f" | mtp N={options.n_draft} {options.alignment}: {stats.steps} steps, {stats.mean_accepted:.2f} accepted"
        f" per step, acceptance by position {per_position}"
    )


@bench_app.command("mtp")
def bench_mtp(
    model: Annotated[Path | None, typer.Option("-m", "--model", help="GGUF model (default: the bundled one).")] = None,
    mtp: MTPFileOption = None,
    drafts: Annotated[str, typer.Option(help="Draft counts to measure, comma-separated.")] = "1,2,3",
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Greedy tokens per run.")] = 64,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Text to continue (no chat template).")] = BENCH_PROMPT,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
) -> None:
    """Greedy decode speed with and without MTP speculation: acceptance per draft position, mean
    accepted drafts per step, tok/s, for each draft count and both alignments."""
    mtp_bench(model, mtp, drafts, tokens, prompt, backend)


def mtp_bench(model: Path | None, mtp: Path | None, drafts: str, tokens: int, prompt: str, backend: str) -> None:
    """The MTP bench's table (`bench mtp`, and `bench --mtp`: the group's own options, bench_ctx.py)."""
    counts = [int(n) for n in drafts.split(",") if n.strip()]
    if not counts:
        raise DwarfStarError("--drafts needs at least one draft count")
    path = resolve_model(model)
    ids = Tokenizer.from_gguf(path).encode(prompt)
    ctx = len(ids) + tokens + 8
    engine = load_engine(path, backend, ctx=ctx)
    session = Session(engine.backend, ctx=ctx)
    session.prefill(ids)
    start = time.perf_counter()
    want = list(session.generate(tokens, GREEDY))
    base = len(want) / (time.perf_counter() - start)
    typer.echo(
        f"backend {engine.backend_name} | prompt {len(ids)} tokens | "
        f"plain greedy: {base:.2f} tok/s over {len(want)} tokens"
    )
    typer.echo(
        "N  align  acceptance by position     accepted/step  tokens/step  rollbacks  tok/s   speed-up  same text"
    )
    for n in counts:
        for alignment in ALIGNMENTS:
            spec = MTPOptions(mtp, n, 0.0, alignment).speculator(engine, ctx)
            spec.prefill(ids)
            start = time.perf_counter()
            got = list(spec.generate(tokens, GREEDY))
            speed = len(got) / (time.perf_counter() - start)
            stats = spec.stats
            accept = " ".join(f"{a:.2f}" for a in stats.acceptance())
            typer.echo(
                f"{n:<2} {alignment:<6} {accept:<26} {stats.mean_accepted:<14.2f} {stats.emitted / stats.steps:<12.2f} "
                f"{stats.rollbacks:<10} {speed:<7.2f} {speed / base:<9.2f} {'yes' if got == want else 'NO'}"
            )
