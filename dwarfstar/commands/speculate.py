"""The one-shot speculative reply `run` prints with the MTP flags (`SpeculativeFlags`), and
`dwarfstar bench mtp`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.flags import ModelFlags, MTPFile, comma_list

if TYPE_CHECKING:
    from dwarfstar.engine.load import Engine
    from dwarfstar.sampling import SamplingParams
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions

BENCH_PROMPT = "Quel ramo del lago di Como, che volge a mezzogiorno, tra due catene non interrotte di monti"


def speculative_reply(
    engine: Engine,
    options: MTPOptions | DSparkOptions,
    ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    ctx: int,
    thinking: bool,
) -> None:
    """Prefill `ids`, stream the reply to stdout as `run` does, then a line of speculation figures."""
    from dwarfstar.console.terminal import StreamPrinter, note
    from dwarfstar.session.session import Session
    from dwarfstar.speculative.decode import load_speculation
    from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer

    spec = load_speculation(options, engine.backend, engine.model).start(Session(engine.backend, ctx=ctx))
    start = time.perf_counter()
    spec.prefill(ids)
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
    drafts: Annotated[str, typer.Option(help="Draft counts to measure, comma-separated.")] = "1,2,3",
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Greedy tokens per run.")] = 64,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Text to continue (no chat template).")] = BENCH_PROMPT,
) -> None:
    """Greedy decode speed with and without MTP speculation: acceptance per draft position, mean
    accepted drafts per step, tok/s, for each draft count and both alignments."""
    from dwarfstar.engine.load import load_engine
    from dwarfstar.sampling import GREEDY
    from dwarfstar.session.session import Session
    from dwarfstar.speculative.decode import ALIGNMENTS, load_speculation
    from dwarfstar.speculative.mtp_options import MTPOptions
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    counts = comma_list(drafts, int, "--drafts", "draft counts")
    path = model.path()
    ids = Tokenizer.from_gguf(path).encode(prompt)
    ctx = len(ids) + tokens + 8
    engine = load_engine(model.spec(ctx=ctx))
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
            loaded = load_speculation(MTPOptions(mtp, n, 0.0, alignment), engine.backend, engine.model)
            spec = loaded.start(Session(engine.backend, ctx=ctx))
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
