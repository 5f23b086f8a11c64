"""The one-shot speculative reply `run` prints with the speculation flags (`SpeculativeFlags`), and
`dwarfstar bench mtp` (the MTP block and DSpark against plain decoding; a DeepSeek V4.1 model, which has
no MTP block, with DSpark only)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.flags import ModelFlags, MTPFile, comma_list

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dwarfstar.engine.load import Engine
    from dwarfstar.model.image_spans import ImageSpan
    from dwarfstar.sampling import SamplingParams
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions

BENCH_PROMPT = "Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti"
PROMPT_WORDS = 20  # words of a held-out paragraph that `bench mtp --prompts N` continues


def held_out_prompts(n: int, text_file: Path | None = None) -> list[str]:
    """`n` prompts: the first words of paragraphs spread over the held-out tail of the bench text
    (the book's last 5%, which the bundled model and its drafts never trained on)."""
    import numpy as np

    from dwarfstar.commands.prompt_tools import default_bench_text, read_text_file
    from dwarfstar.errors import DwarfStarError
    from dwarfstar.train.corpus import split_text

    path = text_file or default_bench_text()
    try:
        tail = split_text(read_text_file(path)).heldout
    except ValueError as exc:
        raise DwarfStarError(f"{path}: {exc}") from None
    paragraphs = [p.split() for p in tail.split("\n\n") if len(p.split()) >= 2 * PROMPT_WORDS]
    if len(paragraphs) < n:
        raise DwarfStarError(
            f"the held-out tail of {path} has {len(paragraphs)} paragraphs of {2 * PROMPT_WORDS}+ words, "
            f"fewer than --prompts {n}: ask for fewer or give a longer --text-file"
        )
    picks = np.linspace(0, len(paragraphs) - 1, n).round().astype(int)
    return [" ".join(paragraphs[i][:PROMPT_WORDS]) for i in picks]


def speculative_reply(
    engine: Engine,
    options: MTPOptions | DSparkOptions,
    ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    ctx: int,
    thinking: bool,
    images: Sequence[ImageSpan] = (),
) -> None:
    """Prefill `ids` (with their image blocks), stream the reply to stdout as `run` does, then a line of
    speculation figures."""
    from dwarfstar.console.terminal import StreamPrinter, note
    from dwarfstar.session.session import Session
    from dwarfstar.speculative.decode import load_speculation
    from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer

    spec = load_speculation(options, engine.backend, engine.model).start(Session(engine.backend, ctx=ctx))
    start = time.perf_counter()
    spec.prefill(ids, images=images)
    prefill_s = time.perf_counter() - start
    text, printer = IncrementalDetokenizer(engine.tokenizer), StreamPrinter(thinking)
    eos = engine.model.args.eos_token_id
    start, count = time.perf_counter(), 0
    for token in spec.generate(max_tokens, params, [eos]):
        count += 1
        if token != eos:
            printer.feed(text.push(token))
    printer.feed(text.flush())
    printer.finish()
    decode_s = time.perf_counter() - start
    stats = spec.stats
    per_position = ", ".join(f"{a:.2f}" for a in stats.acceptance()) or "-"
    note(
        f"prefill {len(ids)} tokens {prefill_s:.2f} s | decode {count} tokens {count / max(decode_s, 1e-9):.2f} tok/s"
        f" | {options.describe()}: {stats.steps} steps, {stats.mean_accepted:.2f} accepted"
        f" per step, acceptance by position {per_position}"
    )


@bench_app.command("mtp")
def bench_mtp(
    model: ModelFlags,
    mtp: MTPFile = None,
    drafts: Annotated[str, typer.Option(help="MTP draft counts to measure, comma-separated (none: no MTP).")] = "1,2,3",
    dspark: Annotated[
        Path | None, typer.Option("--dspark", metavar="FILE", help="Also measure this DSpark drafter.")
    ] = None,
    dspark_confidence: Annotated[float, typer.Option(help="Its confidence cut (0: none).")] = 0.0,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Greedy tokens per run.")] = 64,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Text to continue (no chat template).")] = BENCH_PROMPT,
    prompts: Annotated[
        int,
        typer.Option(
            "--prompts",
            min=1,
            help="Continue this many held-out paragraph openings of the book instead of --prompt, "
            "the figures summed over them.",
        ),
    ] = 1,
    text_file: Annotated[
        Path | None, typer.Option("--text-file", help="The text --prompts draws from (default: the book).")
    ] = None,
) -> None:
    """Greedy decode speed without speculation, with the MTP block (each draft count, both
    alignments) and with a DSpark drafter, in one run over the same prompts: acceptance per draft
    position, mean accepted drafts per step, tok/s, and whether the text is plain greedy's. A DeepSeek
    V4.1 model has no MTP block: it takes `--drafts none`, with `--dspark FILE` for its drafter."""
    from dwarfstar.engine.load import load_engine
    from dwarfstar.errors import DwarfStarError
    from dwarfstar.model.file_v41 import FAMILY41
    from dwarfstar.model.loader import is_v41
    from dwarfstar.sampling import GREEDY
    from dwarfstar.session.session import Session
    from dwarfstar.speculative.decode import ALIGNMENTS, SpecStats, load_speculation
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    counts = [] if drafts == "none" else comma_list(drafts, int, "--drafts", "draft counts")
    runs = [(f"mtp {n} {a}", MTPOptions(mtp, n, 0.0, a)) for n in counts for a in ALIGNMENTS]
    if dspark is not None:
        runs.append((f"dspark {dspark_confidence:g}", DSparkOptions(dspark, dspark_confidence)))
    path = model.path()
    if counts and is_v41(path):
        raise DwarfStarError(
            f"{path} is {FAMILY41}, which has no MTP block to measure: give --drafts none, with --dspark FILE "
            "for its DSpark drafter"
        )
    texts = [prompt] if prompts == 1 and text_file is None else held_out_prompts(prompts, text_file)
    tokenizer = Tokenizer.from_gguf(path)
    id_lists = [tokenizer.encode(text) for text in texts]
    ctx = max(len(ids) for ids in id_lists) + tokens + 8
    engine = load_engine(model.spec(ctx=ctx))
    want, seconds = [], 0.0
    for ids in id_lists:
        session = Session(engine.backend, ctx=ctx)
        session.prefill(ids)
        start = time.perf_counter()
        want.append(list(session.generate(tokens, GREEDY)))
        seconds += time.perf_counter() - start
    base = sum(map(len, want)) / seconds
    typer.echo(
        f"backend {engine.backend_name} | {len(id_lists)} prompt(s), {sum(map(len, id_lists))} tokens | "
        f"plain greedy: {base:.2f} tok/s over {sum(map(len, want))} tokens"
    )
    columns = ("acceptance by position", "accepted/step", "tokens/step", "rollbacks", "tok/s", "speed-up")
    typer.echo(f"drafter       {columns[0]:<31} {columns[1]:<14} {columns[2]:<12} {columns[3]:<10} {columns[4]:<7} "
               f"{columns[5]:<9} same text")  # fmt: skip
    for name, options in runs:
        speculation, stats, got, seconds = load_speculation(options, engine.backend, engine.model), SpecStats(), [], 0.0
        for ids in id_lists:
            spec = speculation.start(Session(engine.backend, ctx=ctx))
            spec.prefill(ids)
            start = time.perf_counter()
            got.append(list(spec.generate(tokens, GREEDY)))
            seconds += time.perf_counter() - start
            stats.add(spec.stats)
        speed = sum(map(len, got)) / seconds
        accept = " ".join(f"{a:.2f}" for a in stats.acceptance())
        typer.echo(
            f"{name:<13} {accept:<31} {stats.mean_accepted:<14.2f} {stats.emitted / stats.steps:<12.2f} "
            f"{stats.rollbacks:<10} {speed:<7.2f} {speed / base:<9.2f} {'yes' if got == want else 'NO'}"
        )
