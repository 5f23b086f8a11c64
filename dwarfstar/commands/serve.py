"""`dwarfstar serve`: the OpenAI / Responses / Anthropic server, and `dwarfstar bench serve`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.cli import app
from dwarfstar.commands.bench import bench_app
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
from dwarfstar.commands.experts import SsdCacheExperts, SsdCold, SsdPreload, SsdStreaming, streaming_options
from dwarfstar.commands.speculate import MTPAlignOption, MTPDraftOption, MTPFileOption, MTPMarginOption, MTPOptions
from dwarfstar.commands.steer import DirSteeringAttn, DirSteeringFfn, DirSteeringFile, steering_options
from dwarfstar.engine import BACKENDS, PRECISION_HELP
from dwarfstar.errors import DwarfStarError
from dwarfstar.serving.config import API_KEY_ENV, TEMPLATES


def default_model() -> Path | None:
    """The bundled default model when this install has one (`dwarfstar.model.bundled`), else None."""
    try:
        from dwarfstar.model.bundled import default_model_path
    except ImportError:
        return None
    return Path(default_model_path())


def model_path(model: Path | None) -> Path:
    model = model or default_model()
    if model is None:
        raise DwarfStarError("no model given and none bundled: pass -m/--model FILE.gguf")
    return model


@app.command()
def serve(
    model: Annotated[
        Path | None, typer.Option("-m", "--model", help="GGUF model file (default: the bundled one).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    ctx: Annotated[int, typer.Option("-c", "--ctx", help="Context size of each session, in tokens.")] = 32768,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
    precision: Annotated[str, typer.Option(help=PRECISION_HELP)] = "exact",
    kv_disk_dir: Annotated[Path | None, typer.Option(help="Directory of the disk KV cache (off if unset).")] = None,
    kv_disk_space_mb: Annotated[int, typer.Option(help="Disk KV cache budget in MiB.")] = 4096,
    kv_cache_min_tokens: Annotated[int, typer.Option(help="Shortest state the disk cache keeps.")] = 512,
    cors: Annotated[bool, typer.Option(help="Allow browser clients from any origin.")] = False,
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_ENV, help=f"Require this key (Bearer or x-api-key); also ${API_KEY_ENV}."),
    ] = None,
    nothink: Annotated[bool, typer.Option(help="No thinking unless a request asks for it.")] = False,
    max_sessions: Annotated[int, typer.Option(help="Live KV sessions, and so requests served at once.")] = 4,
    kv_memory_mb: Annotated[
        int | None,
        typer.Option(help="Live sessions' memory budget, MiB (0: no limit; default: a share of the machine's memory)."),
    ] = None,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a session; more get 429.")] = 32,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill chunk (and checkpoint spacing) in tokens.")] = 4096,
    template: Annotated[str, typer.Option(help=f"Prompt layout: {', '.join(TEMPLATES)}.")] = "ds4",
    model_alias: Annotated[
        list[str] | None, typer.Option(help="Also accept these model names (fnmatch patterns, repeatable).")
    ] = None,
    trace: Annotated[Path | None, typer.Option(help="Append one JSON line per request to this file.")] = None,
    ssd_streaming: SsdStreaming = False,
    ssd_streaming_cache_experts: SsdCacheExperts = None,
    ssd_streaming_cold: SsdCold = False,
    ssd_streaming_preload_experts: SsdPreload = 0,
    dir_steering_file: DirSteeringFile = None,
    dir_steering_ffn: DirSteeringFfn = None,
    dir_steering_attn: DirSteeringAttn = None,
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
    mtp: MTPFileOption = None,
    mtp_draft: MTPDraftOption = None,
    mtp_margin: MTPMarginOption = 0.0,
    mtp_align: MTPAlignOption = "next",
) -> None:
    """Serve the model over HTTP for the OpenAI SDK, Codex, Claude Code and opencode."""
    import uvicorn

    from dwarfstar.engine import load_engine
    from dwarfstar.serving.app import KEEP_ALIVE_SECONDS, create_app
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service

    steering = steering_options(dir_steering_file, dir_steering_ffn, dir_steering_attn)
    streaming = streaming_options(
        ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_cold, ssd_streaming_preload_experts
    )
    dist = dist_options(
        dist_role, layers, dist_addr, dist_bind, dist_stages, dist_activation_bits, dist_prefill_chunk,
        dist_prefill_window, dist_timeout, dist_secret, dist_backend, debug,
    )  # fmt: skip
    if template not in TEMPLATES:
        raise DwarfStarError(f"--template must be one of {', '.join(TEMPLATES)}")
    if max_sessions < 1 or max_queue < 0 or prefill_chunk < 1:
        raise DwarfStarError("--max-sessions and --prefill-chunk must be positive, --max-queue not negative")
    config = ServerConfig(
        ctx=ctx,
        api_key=api_key or None,
        cors=cors,
        think_by_default=not nothink,
        template=template,
        max_sessions=max_sessions,
        kv_memory_mb=kv_memory_mb,
        max_queue=max_queue,
        prefill_chunk=prefill_chunk,
        trace=trace,
        kv_disk_dir=kv_disk_dir,
        kv_disk_space_mb=kv_disk_space_mb,
        kv_cache_min_tokens=kv_cache_min_tokens,
        model_aliases=tuple(model_alias or ()),
        mtp=MTPOptions.from_flags(mtp, mtp_draft, mtp_margin, mtp_align),
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = model_path(model)
    engine = load_engine(
        path, backend, ctx=ctx, precision=precision, streaming=streaming, steering=steering,
        kv_slots=max_sessions,  # every live session in the batch-decoding block
        layers=dist.stage_layers(path),  # a stage loads only its slice
    )  # fmt: skip
    join_route(engine, dist, ctx, config.mtp)  # a worker serves its layers here and exits
    service = Service(engine, config)
    typer.echo(f"{service.models.id} on {engine.backend_name} (loaded in {engine.load_seconds:.1f} s)", err=True)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        typer.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    uvicorn.run(
        create_app(service),
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )


@bench_app.command("serve")
def bench_serve(
    model: Annotated[
        Path | None, typer.Option("-m", "--model", help="GGUF model file (default: the bundled one).")
    ] = None,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
    clients: Annotated[str, typer.Option(help="Concurrent client counts, comma-separated.")] = "1,2,4,8",
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Tokens each request generates.")] = 64,
    ctx: Annotated[int, typer.Option(help="Context size in tokens.")] = 4096,
    repeats: Annotated[int, typer.Option(help="Rounds per client count; medians are reported.")] = 3,
    dir_steering_file: DirSteeringFile = None,
    dir_steering_ffn: DirSteeringFfn = None,
    dir_steering_attn: DirSteeringAttn = None,
) -> None:
    """Time to first token and aggregate decode tok/s against a live server, batched vs serialised."""
    from dwarfstar.serving.bench import run_bench

    steering = steering_options(dir_steering_file, dir_steering_ffn, dir_steering_attn)
    counts = [int(c) for c in clients.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise DwarfStarError("--clients must list positive counts, e.g. 1,2,4,8")
    if repeats < 1:
        raise DwarfStarError(f"--repeats must be at least 1, got {repeats}")
    server_args = [] if steering is None else steering.flags()
    for line in run_bench(
        model_path(model),
        backend=backend,
        clients=counts,
        tokens=tokens,
        ctx=ctx,
        repeats=repeats,
        server_args=server_args,
    ):
        typer.echo(line)
