"""`dwarfstar run`: one-shot prompts, the interactive chat, and ds4's diagnostic dumps.

With `-p`/`--prompt-file` it answers once; with neither it opens the chat (dwarfstar/console/repl.py). A
prompt that starts with BOS is taken as already rendered, as in ds4. `--dump-logits` is a contract
other checks depend on: `--prompt-tokens 0,17,42 --dump-logits OUT.npy` writes float32
[n_prompt, vocab] logits after each prompt position and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import app
from dwarfstar.commands.flags import DEBUG, ChatFlags, Ctx, Vision, comma_list, output
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.console.chat import Chat
    from dwarfstar.engine.load import Engine
    from dwarfstar.model.image_spans import ImageSpan
    from dwarfstar.tokenizer.tokenizer import Tokenizer

INTERRUPTED_EXIT = 130  # the shell's code for a run stopped by Ctrl+C


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise DwarfStarError("give -p/--prompt or --prompt-file, not both")
    if prompt_file is None:
        return prompt
    try:
        return prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DwarfStarError(f"cannot read {prompt_file}: {exc}") from None


def one_shot_prompt(chat: Chat, tokenizer: Tokenizer, text: str) -> tuple[list[int], bool, list[ImageSpan]]:
    """The prompt ids, whether the reply starts in reasoning, and the image blocks among the ids (the
    images attached with --image). A text that opens with BOS is a rendered prompt (control tokens
    honoured, no template), as in ds4."""
    from dwarfstar.tokenizer.specials import BOS, THINK_START

    if text.startswith(BOS):
        if chat.images:
            raise DwarfStarError("--image needs a text prompt: a rendered one (starting with BOS) has no place for it")
        return tokenizer.encode_with_specials(text), text.rstrip().endswith(THINK_START), []
    ids, spans = chat.prompt(pending=text)
    return ids, chat.thinking, spans


def write_logits(engine: Engine, ids: list[int], ctx: int, out: Path) -> None:
    import numpy as np

    from dwarfstar.session.session import Session

    session = Session(engine.backend, ctx=ctx)
    logits = engine.backend.forward(ids, session.state, all_logits=True)
    np.save(out, logits.float().cpu().numpy())
    typer.echo(f"wrote logits {tuple(logits.shape)} to {out}", err=True)


DumpTokens = Annotated[
    bool, typer.Option(help="Print the prompt's tokens (as written, no template) and exit.", rich_help_panel=DEBUG)
]
DumpLogprobs = Annotated[
    Path | None, output(help="Write the greedy continuation with top-K logprobs per step (JSON), exit.", panel=DEBUG)
]
LogprobsTopK = Annotated[
    int, typer.Option(min=1, help="Alternatives per step in --dump-logprobs.", rich_help_panel=DEBUG)
]
DumpLogits = Annotated[
    Path | None,
    output(help="Write float32 logits (n_prompt x vocab) after each prompt token (.npy), exit.", panel=DEBUG),
]


@app.command()
def run(
    flags: ChatFlags,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Answer this once and exit.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Like -p, with the text of FILE.")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="Raw prompt as token ids: 0,17,42.")] = None,
    system: Annotated[
        str | None,
        typer.Option(
            "-s", "--system", help='System prompt (default: ds4\'s "You are a helpful assistant"); "" for none.'
        ),
    ] = None,
    ctx: Ctx = 32768,
    dump_tokens: DumpTokens = False,
    dump_logprobs: DumpLogprobs = None,
    logprobs_top_k: LogprobsTopK = 20,
    dump_logits: DumpLogits = None,
    vision: Vision = None,
    image: Annotated[
        list[Path] | None, typer.Option("--image", help="An image for the first message (repeatable; needs --vision).")
    ] = None,
) -> None:
    """Chat with the model: one prompt with -p, else an interactive session."""
    from dwarfstar.commands.engines import closing_lines, start
    from dwarfstar.console.repl import run_repl

    spec = flags.spec(ctx, vision=vision)
    if image and vision is None:
        raise DwarfStarError("--image needs a vision encoder: --vision FILE")
    if image and (prompt_tokens is not None or dump_tokens or dump_logits or dump_logprobs):
        raise DwarfStarError("--image goes with a text prompt or the chat, not --prompt-tokens or dumps")
    text = read_prompt(prompt, prompt_file)
    if text is not None and prompt_tokens is not None:
        raise DwarfStarError("give a text prompt or --prompt-tokens, not both")
    ids = None if prompt_tokens is None else comma_list(prompt_tokens, int, "--prompt-tokens", "integers")
    if dump_tokens:
        if text is None:
            raise DwarfStarError("--dump-tokens needs -p or --prompt-file")
        from dwarfstar.console.diagnostics import dump_tokens as dump
        from dwarfstar.tokenizer.tokenizer import Tokenizer

        sys.stdout.write(dump(Tokenizer.from_gguf(spec.model), text))
        return
    one_shot = text is not None or prompt_tokens is not None
    if spec.drafter is not None and not one_shot and (spec.dist is None or spec.dist.role != "worker"):
        raise DwarfStarError("speculation (--mtp, --dspark) needs a one-shot prompt: -p or --prompt-tokens")
    if (dump_logits or dump_logprobs) and not one_shot:
        raise DwarfStarError("the dumps need a prompt: -p, --prompt-file or --prompt-tokens")
    engine, route = start(spec)
    try:
        chat = open_chat(engine, spec, flags, system)
        for path in image or ():
            chat.attach(path)
        try:
            if not one_shot:
                run_repl(chat)
            elif ids is not None:
                answer(chat, spec, ids, False, (dump_logits, dump_logprobs), logprobs_top_k)
            else:
                ids, thinking, spans = one_shot_prompt(chat, engine.tokenizer, text)
                answer(chat, spec, ids, thinking, (dump_logits, dump_logprobs), logprobs_top_k, spans)
        finally:
            closing_lines(engine, chat.backend, spec.power, chat.prefill_speed, chat.decode_speed)
            if chat.trace:
                chat.trace.close()
    finally:
        if route is not None:
            route.close()


def open_chat(engine, spec, flags: ChatFlags, system: str | None) -> Chat:
    """The chat on the engine: paced by --power, in the thinking mode the flags and the context allow."""
    from dwarfstar.console.chat import DEFAULT_SYSTEM, Chat, allowed_mode
    from dwarfstar.console.diagnostics import Trace
    from dwarfstar.console.terminal import note
    from dwarfstar.session.throttle import throttle

    mode, warning = allowed_mode(flags.sampling.mode(), spec.ctx)
    if warning:
        note(f"warning: {warning}", "yellow")
    return Chat(
        engine,
        throttle(engine.backend, spec.power),
        ctx=min(spec.ctx, engine.model.args.max_seq_len),
        system=DEFAULT_SYSTEM if system is None else system,
        mode=mode,
        params=flags.sampling.params(),
        max_tokens=flags.tokens,
        trace=Trace(flags.trace) if flags.trace else None,
        loop_guard=flags.loop_guard.options(),
        level=flags.sampling.level(engine.model.args.reasoning_efforts),
    )


def answer(
    chat: Chat,
    spec,
    ids: list[int],
    thinking: bool,
    dumps: tuple[Path | None, Path | None],
    top_k: int,
    images: list[ImageSpan] | None = None,
):
    """One prompt's answer (with its image blocks), streamed (speculative with --mtp), or one of the dumps."""
    from dwarfstar.commands.speculate import speculative_reply
    from dwarfstar.console.diagnostics import MAX_LOGPROBS_TOP_K, greedy_logprobs, write_logprobs
    from dwarfstar.console.terminal import Interrupt, note

    engine, (dump_logits, dump_logprobs) = chat.engine, dumps
    if dump_logits:
        write_logits(engine, ids, chat.session.ctx, dump_logits)
    elif spec.drafter is not None:
        speculative_reply(
            engine, spec.drafter, ids, chat.sampler.params, chat.max_tokens, chat.session.ctx, thinking, images or ()
        )
    elif dump_logprobs:
        k = min(top_k, MAX_LOGPROBS_TOP_K)
        chat.session.prefill(ids)
        steps = greedy_logprobs(chat.session, engine.tokenizer, chat.max_tokens, k, chat.eos)
        write_logprobs(dump_logprobs, len(ids), chat.session.ctx, k, steps)
        note(f"wrote {len(steps)} steps to {dump_logprobs}")
    else:
        with Interrupt() as stop:
            stats = chat.complete(ids, thinking, stop, images=images or ())
        if stats.finish in ("interrupted", "cancelled"):
            note(f"[{stats.finish}]", "dim")
            raise typer.Exit(INTERRUPTED_EXIT)
        if stats.finish == "repetition":
            note("[loop guard: the reply repeated itself and was stopped]", "yellow")
