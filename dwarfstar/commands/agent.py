"""`dwarfstar agent`: the coding agent (dwarfstar/agent/), in the terminal UI or, with --plain, line mode.

It works in the directory it was started in. Sessions are KV files under `~/.dwarfstar/kvcache`
(or `--kv-dir`, or `$DWARFSTAR_KVCACHE`). The model, sampling, thinking, expert-streaming, steering,
MTP speculation, distributed-route and `--vision` flags are `run`'s; with `--mtp`/`--mtp-draft` every
reply is speculative (agent/policy.py). With a vision encoder (`--vision FILE`) the model gets the
`view_image` tool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import app, given
from dwarfstar.commands.flags import ChatFlags, Ctx, Vision


@app.command()
def agent(
    flags: ChatFlags,
    prompt: Annotated[
        str | None, typer.Option("-p", "--prompt", help="Submit this first; with --plain run it and exit.")
    ] = None,
    plain: Annotated[bool, typer.Option("--plain", help="Line mode for pipes and scripts, no terminal UI.")] = False,
    system: Annotated[
        str | None,
        typer.Option(
            "-s", "--system", help='Extra system text after the agent\'s prompt (default: one line); "" for none.'
        ),
    ] = None,
    kv_dir: Annotated[
        Path | None, typer.Option(help="Session directory (default $DWARFSTAR_KVCACHE or ~/.dwarfstar/kvcache).")
    ] = None,
    ctx: Ctx = 100000,
    vision: Vision = None,
) -> None:
    """A coding agent in this directory, running the model in-process; its sessions are KV files."""
    from dwarfstar.commands.engines import start
    from dwarfstar.console.terminal import note

    spec = flags.spec(ctx, vision=vision)
    engine, route = start(spec)  # a worker serves its layers and exits; a coordinator routes
    try:
        held = engine.model.args.max_seq_len
        if ctx > held and given("ctx"):  # the default is the model's size when it holds less
            note(f"--ctx {ctx} is more than this model holds; using {held}", "yellow")
        code = run_agent(engine, spec, flags, min(ctx, held), system, kv_dir, plain, prompt)
    finally:
        if route is not None:
            route.close()  # its workers exit with it
    if code:
        raise typer.Exit(code)


def run_agent(engine, spec, flags: ChatFlags, ctx: int, system, kv_dir, plain, prompt) -> int:
    """The agent's loop on a loaded engine, in the terminal UI or in line mode; its exit code."""
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
    from dwarfstar.commands.engines import closing_lines
    from dwarfstar.console.chat import allowed_mode
    from dwarfstar.console.diagnostics import Trace
    from dwarfstar.console.repl import dwarfstar_home
    from dwarfstar.console.terminal import note
    from dwarfstar.kvcache.kvfile import ModelIdentity
    from dwarfstar.session.throttle import throttle
    from dwarfstar.speculative.decode import load_speculation

    mode, warning = allowed_mode(flags.sampling.mode(), ctx)
    level = flags.sampling.level(engine.model.args.reasoning_efforts)
    if warning:
        note(f"warning: {warning}", "yellow")
    params = flags.sampling.params()
    tracer = Trace(flags.trace) if flags.trace else None
    paced = throttle(engine.backend, spec.power)
    workspace = Workspace(Path.cwd())
    printer = Printer()
    extra = DEFAULT_SYSTEM if system is None else system

    def fresh() -> Transcript:
        return Transcript(system_text(str(workspace.root), extra), mode, level=level)

    eos = engine.backend.args.eos_token_id
    policy = SampledPolicy(params, eos)
    images = engine.images
    if spec.drafter is not None:
        policy = SpeculativePolicy(params, eos, load_speculation(spec.drafter, engine.backend, engine.model))
    live = Agent(
        tokenizer=engine.tokenizer,
        backend=paced,
        ctx=ctx,
        policy=policy,
        toolbox=Toolbox(workspace, vision=images is not None),
        transcript=fresh(),
        max_tokens=flags.tokens,
        trace=tracer,
        experts=engine.experts,
        loop_guard=flags.loop_guard.options(),
        images=images,
    )
    if isinstance(policy, SpeculativePolicy):
        policy.start(live.session)  # here, so that a backend that cannot speculate says so before any work
    steered = None if spec.steering is None else spec.steering.tag()
    store = SessionStore(
        kv_dir or default_directory(), engine.backend.args, ModelIdentity.of(engine.model), ctx, live.session.chunk,
        engine.tokenizer, engine.backend.new_state, steering=steered,
    )  # fmt: skip
    worker = Worker(live, store, printer)
    if not plain:
        workspace.confirm = worker.ask  # under --plain a write outside the workspace is refused
    commands = Commands(worker, printer, fresh, confirm_from(None, printer))
    try:
        worker.call(worker.start)
        if plain:
            return run_plain(worker, commands, printer, prompt)
        from dwarfstar.agent.tui import run_tui

        return run_tui(worker, commands, printer, spec.model.name, prompt, dwarfstar_home())
    finally:
        worker.close()
        closing_lines(engine, paced, spec.power, live.prefill_speed, live.decode_speed)
        if isinstance(policy, SpeculativePolicy):
            note(policy.describe())
        if tracer:
            tracer.close()
