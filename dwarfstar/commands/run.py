"""`dwarfstar run`: one-shot prompts, the interactive chat, and ds4's diagnostic dumps.

With `-p`/`--prompt-file` it answers once; with neither it opens the chat (dwarfstar/repl.py). A
prompt that starts with BOS is taken as already rendered, as in ds4. `--dump-logits` is a contract
other checks depend on: `--prompt-tokens 0,17,42 --dump-logits OUT.npy` writes float32
[n_prompt, vocab] logits after each prompt position and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from dwarfstar.chat import DEFAULT_SYSTEM, Chat, ThinkMode, allowed_mode
from dwarfstar.cli import app
from dwarfstar.commands.dist_options import (
    DistAddr,
    DistBackend,
    DistBind,
    DistBits,
    DistDebug,
    DistLayers,
    DistPrefillChunk,
    DistPrefillWindow,
    DistRole,
    DistSecret,
    DistStages,
    DistTimeout,
    dist_options,
    join_route,
)
from dwarfstar.commands.experts import SsdCacheExperts, SsdCold, SsdPreload, SsdStreaming, describe, streaming_options
from dwarfstar.commands.options import (
    BackendOption,
    CtxOption,
    MinPOption,
    ModelOption,
    NoQatOption,
    PowerOption,
    PrecisionOption,
    SeedOption,
    TempOption,
    ThinkMaxOption,
    ThinkOption,
    TopKOption,
    TopPOption,
    TraceOption,
)
from dwarfstar.commands.speculate import (
    MTPAlignOption,
    MTPDraftOption,
    MTPFileOption,
    MTPMarginOption,
    MTPOptions,
    speculative_reply,
)
from dwarfstar.commands.steer import DirSteeringAttn, DirSteeringFfn, DirSteeringFile, steering_options
from dwarfstar.diagnostics import MAX_LOGPROBS_TOP_K, Trace, dump_tokens, greedy_logprobs, write_logprobs
from dwarfstar.engine import Engine, load_engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.hub import resolve_model
from dwarfstar.repl import run_repl
from dwarfstar.session.sampling import SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.terminal import Interrupt, loading, note, summary_line
from dwarfstar.throttle import ThrottledBackend, throttle
from dwarfstar.tokenizer.specials import BOS, THINK_START
from dwarfstar.tokenizer.tokenizer import Tokenizer

INTERRUPTED_EXIT = 130  # the shell's code for a run stopped by Ctrl+C


def parse_token_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise DwarfStarError(f"--prompt-tokens must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise DwarfStarError("--prompt-tokens is empty")
    return ids


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise DwarfStarError("give -p/--prompt or --prompt-file, not both")
    if prompt_file is None:
        return prompt
    try:
        return prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DwarfStarError(f"cannot read {prompt_file}: {exc}") from None


def think_mode(think: bool, think_max: bool) -> ThinkMode:
    if think_max:
        return ThinkMode.THINK_MAX
    return ThinkMode.THINK if think else ThinkMode.NOTHINK


def one_shot_ids(chat: Chat, tokenizer: Tokenizer, text: str) -> tuple[list[int], bool]:
    """The prompt ids and whether the reply starts in reasoning. A text that opens with BOS is a
    rendered prompt (control tokens honoured, no template), as in ds4."""
    if text.startswith(BOS):
        return tokenizer.encode_with_specials(text), text.rstrip().endswith(THINK_START)
    return chat.prompt_ids(pending=text), chat.thinking


def write_logits(engine: Engine, ids: list[int], ctx: int, out: Path) -> None:
    session = Session(engine.backend, ctx=min(ctx, engine.model.args.max_seq_len))
    logits = engine.backend.forward(ids, session.state, all_logits=True)
    np.save(out, logits.float().cpu().numpy())
    typer.echo(f"wrote logits {tuple(logits.shape)} to {out}", err=True)


@app.command()
def run(
    model: ModelOption = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Answer this once and exit.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Like -p, with the text of FILE.")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="Raw prompt as token ids: 0,17,42.")] = None,
    system: Annotated[str, typer.Option("-sys", "--system", help='System prompt; "" for none.')] = DEFAULT_SYSTEM,
    think: ThinkOption = True,
    think_max: ThinkMaxOption = False,
    temp: TempOption = 1.0,
    top_p: TopPOption = 1.0,
    top_k: TopKOption = 0,
    min_p: MinPOption = 0.05,
    seed: SeedOption = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Most tokens to generate per reply.")] = 50000,
    ctx: CtxOption = 32768,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    power: PowerOption = 100,
    trace: TraceOption = None,
    dump_tokens_: Annotated[
        bool, typer.Option("--dump-tokens", help="Print the prompt's tokens (as written, no template) and exit.")
    ] = False,
    dump_logprobs: Annotated[
        Path | None, typer.Option(help="Write the greedy continuation with top-K logprobs per step (JSON), exit.")
    ] = None,
    logprobs_top_k: Annotated[int, typer.Option(min=1, help="Alternatives per step in --dump-logprobs.")] = 20,
    dump_logits: Annotated[
        Path | None, typer.Option(help="Write float32 logits (n_prompt x vocab) after each prompt token (.npy), exit.")
    ] = None,
    no_qat_rounding: NoQatOption = False,
    ssd_streaming: SsdStreaming = False,
    ssd_streaming_cache_experts: SsdCacheExperts = None,
    ssd_streaming_cold: SsdCold = False,
    ssd_streaming_preload_experts: SsdPreload = 0,
    dir_steering_file: DirSteeringFile = None,
    dir_steering_ffn: DirSteeringFfn = None,
    dir_steering_attn: DirSteeringAttn = None,
    mtp: MTPFileOption = None,
    mtp_draft: MTPDraftOption = None,
    mtp_margin: MTPMarginOption = 0.0,
    mtp_align: MTPAlignOption = "next",
    dist_role: DistRole = None,
    layers: DistLayers = None,
    dist_addr: DistAddr = None,
    dist_bind: DistBind = None,
    dist_stages: DistStages = 2,
    dist_activation_bits: DistBits = 32,
    dist_prefill_chunk: DistPrefillChunk = 4096,
    dist_prefill_window: DistPrefillWindow = 1,
    dist_timeout: DistTimeout = 600.0,
    dist_secret: DistSecret = "",
    dist_backend: DistBackend = "gloo",
    debug: DistDebug = False,
) -> None:
    """Chat with the model: one prompt with -p, else an interactive session."""
    dist = dist_options(
        dist_role, layers, dist_addr, dist_bind, dist_stages, dist_activation_bits, dist_prefill_chunk,
        dist_prefill_window, dist_timeout, dist_secret, dist_backend, debug,
    )  # fmt: skip
    speculation = MTPOptions.from_flags(mtp, mtp_draft, mtp_margin, mtp_align)
    steering = steering_options(dir_steering_file, dir_steering_ffn, dir_steering_attn)
    streaming = streaming_options(
        ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_cold, ssd_streaming_preload_experts
    )
    text = read_prompt(prompt, prompt_file)
    if text is not None and prompt_tokens is not None:
        raise DwarfStarError("give a text prompt or --prompt-tokens, not both")
    path = resolve_model(model)
    if dump_tokens_:
        if text is None:
            raise DwarfStarError("--dump-tokens needs -p or --prompt-file")
        sys.stdout.write(dump_tokens(Tokenizer.from_gguf(path), text))
        return
    if speculation is not None and text is None and prompt_tokens is None and dist.role != "worker":
        raise DwarfStarError("MTP speculation (--mtp, --mtp-draft) needs a one-shot prompt: -p or --prompt-tokens")
    if (dump_logits or dump_logprobs) and text is None and prompt_tokens is None:
        raise DwarfStarError("the dumps need a prompt: -p, --prompt-file or --prompt-tokens")

    with loading(path) as progress:
        engine = load_engine(
            path,
            backend,
            qat=not no_qat_rounding,
            ctx=ctx,
            progress=progress,
            precision=precision,
            streaming=streaming,
            steering=steering,
            layers=dist.stage_layers(path),  # a stage loads only its slice
        )
    route = join_route(engine, dist, min(ctx, engine.model.args.max_seq_len), speculation)
    mode, warning = allowed_mode(think_mode(think, think_max), ctx)
    if warning:
        note(f"warning: {warning}", "yellow")
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    tracer = Trace(trace) if trace else None
    paced = throttle(engine.backend, power)
    chat = Chat(
        engine,
        paced,
        ctx=min(ctx, engine.model.args.max_seq_len),
        system=system,
        mode=mode,
        params=params,
        max_tokens=tokens,
        trace=tracer,
    )
    try:
        if text is None and prompt_tokens is None:
            run_repl(chat)
        else:
            if prompt_tokens is not None:
                ids, thinking = parse_token_list(prompt_tokens), False
            else:
                ids, thinking = one_shot_ids(chat, engine.tokenizer, text)
            if dump_logits:
                write_logits(engine, ids, ctx, dump_logits)
                return
            if speculation is not None:
                speculative_reply(engine, speculation, ids, params, tokens, chat.session.ctx)
                return
            if dump_logprobs:
                k = min(logprobs_top_k, MAX_LOGPROBS_TOP_K)
                chat.session.prefill(ids)
                steps = greedy_logprobs(chat.session, engine.tokenizer, tokens, k, chat.eos)
                write_logprobs(dump_logprobs, len(ids), chat.session.ctx, k, steps)
                note(f"wrote {len(steps)} steps to {dump_logprobs}")
                return
            with Interrupt() as stop:
                stats = chat.complete(ids, thinking, stop)
            if stats.finish in ("interrupted", "cancelled"):
                note(f"[{stats.finish}]", "dim")
                raise typer.Exit(INTERRUPTED_EXIT)
    finally:
        if chat.prefill_speed.tokens:
            idle = (power, paced.duty.slept_s) if isinstance(paced, ThrottledBackend) else None
            note(summary_line(engine.load_seconds, chat.prefill_speed, chat.decode_speed, idle))
        if engine.experts is not None:
            note(describe(engine.experts.stats.summary(len(engine.experts.where), engine.experts.capacity)))
        if tracer:
            tracer.close()
        if route is not None:
            route.close()
