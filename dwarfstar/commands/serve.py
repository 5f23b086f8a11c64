"""`dwarfstar serve`: the OpenAI / Responses / Anthropic server, and `dwarfstar bench serve`.

`serve` checks its flags, then binds its port (a port out of range or already in use is an error
before the model loads), then loads the model and hands the bound socket to uvicorn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import app, bench_app
from dwarfstar.commands.flags import (
    GENERATION,
    Ctx,
    EngineFlags,
    LoopGuardFlags,
    ModelFlags,
    SteeringFlags,
    ThinkLevel,
    Vision,
    output,
)
from dwarfstar.errors import DwarfStarError
from dwarfstar.serving.config import API_KEY_ENV, TEMPLATES

if TYPE_CHECKING:
    import socket

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one), or a one-line error."""
    import socket

    if not 0 <= port <= 65535:
        raise DwarfStarError(f"--port must be 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise DwarfStarError(f"cannot listen on {host}: {getattr(exc, 'strerror', None) or exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise DwarfStarError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


@app.command()
def serve(
    engine_flags: EngineFlags,
    loop_guard: LoopGuardFlags,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one).")] = 8000,
    ctx: Ctx = 32768,
    think: Annotated[
        bool,
        typer.Option("--think/--no-think", help="Think unless a request says not to.", rich_help_panel=GENERATION),
    ] = True,
    think_level: ThinkLevel = None,
    tool_guard: Annotated[
        bool,
        typer.Option(
            "--tool-guard/--no-tool-guard",
            help="Keep a tool-call block to the declared tools and their parameters, its tags greedy "
            "(a request's field tool_guard overrides).",
            rich_help_panel=GENERATION,
        ),
    ] = True,
    max_sessions: Annotated[int, typer.Option(help="Live KV sessions, and so requests served at once.")] = 4,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a session; more get 429.")] = 32,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill chunk (and checkpoint spacing) in tokens.")] = 4096,
    kv_memory_mb: Annotated[
        int | None,
        typer.Option(help="Live sessions' memory budget, MiB (0: no limit; default: a share of the machine's memory)."),
    ] = None,
    kv_disk_dir: Annotated[Path | None, typer.Option(help="Directory of the disk KV cache (off if unset).")] = None,
    kv_disk_space_mb: Annotated[int, typer.Option(help="Disk KV cache budget in MiB.")] = 4096,
    kv_cache_min_tokens: Annotated[int, typer.Option(help="Shortest state the disk cache keeps.")] = 512,
    cors: Annotated[bool, typer.Option("--cors", help="Allow browser clients from any origin.")] = False,
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_ENV, help=f"Require this key (Bearer or x-api-key); also ${API_KEY_ENV}."),
    ] = None,
    template: Annotated[str, typer.Option(help=f"Prompt layout: {', '.join(TEMPLATES)}.")] = "ds4",
    model_alias: Annotated[
        list[str] | None, typer.Option(help="Also accept these model names (fnmatch patterns, repeatable).")
    ] = None,
    trace: Annotated[Path | None, output(help="Append one JSON line per request to this file.")] = None,
    vision: Vision = None,
    allow_image_urls: Annotated[
        bool,
        typer.Option(
            "--allow-image-urls",
            help="Fetch images that requests name by http(s) URL (off: the server makes no outbound requests).",
        ),
    ] = False,
) -> None:
    """Serve the model over HTTP for the OpenAI SDK, Codex, Claude Code and opencode."""
    import logging

    import uvicorn

    from dwarfstar.commands.engines import start
    from dwarfstar.engine.load import spec_backend
    from dwarfstar.serving.app import KEEP_ALIVE_SECONDS, create_app
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service

    if template not in TEMPLATES:
        raise DwarfStarError(f"--template must be one of {', '.join(TEMPLATES)}")
    if max_sessions < 1 or max_queue < 0 or prefill_chunk < 1:
        raise DwarfStarError("--max-sessions and --prefill-chunk must be positive, --max-queue not negative")
    if think_level and not think:
        raise DwarfStarError("--think-level 1..100 thinks by default: give it without --no-think")
    spec = engine_flags.spec(ctx=ctx, kv_slots=max_sessions, vision=vision)  # kv_slots: every live session batched
    config = ServerConfig(
        ctx=ctx, api_key=api_key or None, cors=cors, think_by_default=think and think_level != 0,
        think_level=think_level, template=template,
        max_sessions=max_sessions, kv_memory_mb=kv_memory_mb, max_queue=max_queue, prefill_chunk=prefill_chunk,
        trace=trace, kv_disk_dir=kv_disk_dir, kv_disk_space_mb=kv_disk_space_mb,
        kv_cache_min_tokens=kv_cache_min_tokens, model_aliases=tuple(model_alias or ()), mtp=spec.drafter,
        loop_guard=loop_guard.options(), tool_guard=tool_guard, allow_image_urls=allow_image_urls,
    )  # fmt: skip
    spec_backend(spec)  # a backend that cannot run here, before the port
    worker = spec.dist is not None and spec.dist.role == "worker"  # serves its layers, not HTTP
    sock = None if worker else listen(host, port)
    try:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        engine, _route = start(spec)  # a worker serves its layers here and exits
        service = Service(engine, config)
        typer.echo(
            f"{service.models.id} on {engine.backend_name} (loaded in {engine.load_seconds:.1f} s), "
            f"listening on {host}:{sock.getsockname()[1]}",
            err=True,
        )
        if host not in LOCAL_HOSTS and config.api_key is None:
            typer.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(service),
                log_level="info",
                timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_SECONDS,
            )
        )
        server.run(sockets=[sock])
    finally:
        if sock is not None:
            sock.close()


@bench_app.command("serve")
def bench_serve(
    model: ModelFlags,
    steering: SteeringFlags,
    clients: Annotated[str, typer.Option(help="Concurrent client counts, comma-separated.")] = "1,2,4,8",
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Tokens each request generates.")] = 64,
    ctx: Ctx = 4096,
    repeats: Annotated[int, typer.Option(help="Rounds per client count; medians are reported.")] = 3,
) -> None:
    """Time to first token and aggregate decode tok/s against a live server, batched vs serialised."""
    from dwarfstar.serving.load_bench import run_bench

    options = steering.options()
    try:
        counts = [int(c) for c in clients.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise DwarfStarError("--clients must list positive counts, e.g. 1,2,4,8")
    if repeats < 1:
        raise DwarfStarError(f"--repeats must be at least 1, got {repeats}")
    flags = ["--precision", model.precision] + ([] if options is None else options.flags())
    for line in run_bench(
        model.path(), backend=model.backend, clients=counts, tokens=tokens, ctx=ctx, repeats=repeats, server_args=flags
    ):
        typer.echo(line)
