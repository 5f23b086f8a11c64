"""`dwarfstar agent`: the coding agent (dwarfstar/agent/), in the terminal UI or, with --plain, line mode.

It works in the directory it was started in. Sessions are KV files under `~/.dwarfstar/kvcache`
(or `--kv-dir`, or `$DWARFSTAR_KVCACHE`). The model, sampling, thinking, expert-streaming, steering,
MTP speculation and distributed-route flags are `run`'s; with `--mtp`/`--mtp-draft` every reply is
speculative (agent/policy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.agent.commands import Commands
from dwarfstar.agent.files import Workspace
from dwarfstar.agent.loop import Agent
from dwarfstar.agent.output import Printer
from dwarfstar.agent.plain import confirm_from, run_plain
from dwarfstar.agent.policy import SampledPolicy, SpeculativePolicy
from dwarfstar.agent.store import SessionStore, default_directory
from dwarfstar.agent.tools import Toolbox
from dwarfstar.agent.transcript import DEFAULT_SYSTEM, Transcript, system_text
from dwarfstar.agent.worker import Worker
from dwarfstar.chat import allowed_mode
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
from dwarfstar.commands.run import think_mode
from dwarfstar.commands.speculate import MTPAlignOption, MTPDraftOption, MTPFileOption, MTPMarginOption
from dwarfstar.commands.steer import DirSteeringAttn, DirSteeringFfn, DirSteeringFile, steering_options
from dwarfstar.diagnostics import Trace
from dwarfstar.engine import load_engine
from dwarfstar.hub import resolve_model
from dwarfstar.repl import dwarfstar_home
from dwarfstar.session.kvfile import ModelIdentity
from dwarfstar.session.sampling import SamplingParams
from dwarfstar.speculative.options import MTPOptions
from dwarfstar.terminal import loading, note, summary_line
from dwarfstar.throttle import ThrottledBackend, throttle


@app.command()
def agent(
    model: ModelOption = None,
    prompt: Annotated[
        str | None, typer.Option("-p", "--prompt", help="Submit this first; with --plain run it and exit.")
    ] = None,
    plain: Annotated[bool, typer.Option("--plain", help="Line mode for pipes and scripts, no terminal UI.")] = False,
    system: Annotated[
        str, typer.Option("-sys", "--system", help='Extra system text after the agent\'s prompt; "" for none.')
    ] = DEFAULT_SYSTEM,
    kv_dir: Annotated[
        Path | None, typer.Option(help="Session directory (default $DWARFSTAR_KVCACHE or ~/.dwarfstar/kvcache).")
    ] = None,
    think: ThinkOption = True,
    think_max: ThinkMaxOption = False,
    temp: TempOption = 1.0,
    top_p: TopPOption = 1.0,
    top_k: TopKOption = 0,
    min_p: MinPOption = 0.05,
    seed: SeedOption = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Most tokens per model reply.")] = 50000,
    ctx: CtxOption = 100000,
    backend: BackendOption = "auto",
    precision: PrecisionOption = "exact",
    power: PowerOption = 100,
    trace: TraceOption = None,
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
    """A coding agent in this directory, running the model in-process; its sessions are KV files."""
    steering = steering_options(dir_steering_file, dir_steering_ffn, dir_steering_attn)
    streaming = streaming_options(
        ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_cold, ssd_streaming_preload_experts
    )
    speculation = MTPOptions.from_flags(mtp, mtp_draft, mtp_margin, mtp_align)
    dist = dist_options(
        dist_role, layers, dist_addr, dist_bind, dist_stages, dist_activation_bits, dist_prefill_chunk,
        dist_prefill_window, dist_timeout, dist_secret, dist_backend, debug,
    )  # fmt: skip
    path = resolve_model(model)
    with loading(path) as progress:
        engine = load_engine(
            path, backend, qat=not no_qat_rounding, ctx=ctx, progress=progress, precision=precision,
            streaming=streaming, steering=steering, layers=dist.stage_layers(path),
        )  # fmt: skip
    if ctx > engine.model.args.max_seq_len:
        note(f"--ctx {ctx} is more than this model holds; using {engine.model.args.max_seq_len}", "yellow")
        ctx = engine.model.args.max_seq_len
    route = join_route(engine, dist, ctx, speculation)  # a worker serves its layers and exits; a coordinator routes
    try:
        mode, warning = allowed_mode(think_mode(think, think_max), ctx)
        if warning:
            note(f"warning: {warning}", "yellow")
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        tracer = Trace(trace) if trace else None
        paced = throttle(engine.backend, power)
        workspace = Workspace(Path.cwd())
        printer = Printer()

        def fresh() -> Transcript:
            return Transcript(system_text(str(workspace.root), system), mode)

        eos = engine.backend.args.eos_token_id
        policy = SampledPolicy(params, eos)
        if speculation is not None:
            policy = SpeculativePolicy(params, eos, speculation.load(engine))
        live = Agent(
            tokenizer=engine.tokenizer,
            backend=paced,
            ctx=ctx,
            policy=policy,
            toolbox=Toolbox(workspace),
            transcript=fresh(),
            max_tokens=tokens,
            trace=tracer,
            experts=engine.experts,
        )
        if isinstance(policy, SpeculativePolicy):
            policy.start(live.session)  # here, so that a backend that cannot speculate says so before any work
        store = SessionStore(
            kv_dir or default_directory(), engine.backend.args, ModelIdentity.of(engine.model), ctx, live.session.chunk,
            engine.tokenizer, engine.backend.new_state, steering=None if steering is None else steering.tag(),
        )  # fmt: skip
        worker = Worker(live, store, printer)
        if not plain:
            workspace.confirm = worker.ask  # under --plain a write outside the workspace is refused
        commands = Commands(worker, printer, fresh, confirm_from(None, printer))
        code = 0
        try:
            worker.call(worker.start)
            if plain:
                code = run_plain(worker, commands, printer, prompt)
            else:
                from dwarfstar.agent.tui import run_tui

                code = run_tui(worker, commands, printer, path.name, prompt, dwarfstar_home())
        finally:
            worker.close()
            if live.prefill_speed.tokens:
                idle = (power, paced.duty.slept_s) if isinstance(paced, ThrottledBackend) else None
                note(summary_line(engine.load_seconds, live.prefill_speed, live.decode_speed, idle))
            if isinstance(policy, SpeculativePolicy):
                note(policy.describe())
            if engine.experts is not None:
                note(describe(engine.experts.stats.summary(len(engine.experts.where), engine.experts.capacity)))
            if tracer:
                tracer.close()
    finally:
        if route is not None:
            route.close()  # its workers exit with it
    if code:
        raise typer.Exit(code)
