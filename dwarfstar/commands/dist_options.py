"""The distributed-route options of `run`, `serve` and `bench`, defined once (see dwarfstar/distributed/)."""

from __future__ import annotations

from typing import Annotated

import typer

from dwarfstar.distributed.launch import ROLES, SECRET_ENV, TRANSPORTS, DistOptions, distribute, run_worker
from dwarfstar.distributed.route import Route
from dwarfstar.engine import Engine
from dwarfstar.speculative.options import MTPOptions

DistRole = Annotated[
    str | None,
    typer.Option(help=f"Run as one stage of a layer pipeline: {' or '.join(ROLES)} (torchrun sets it from RANK)."),
]
DistLayers = Annotated[
    str | None, typer.Option("--layers", help="This stage's layers A:B, or A:output for the last (default: by bytes).")
]
DistAddr = Annotated[str | None, typer.Option(help="The coordinator's HOST:PORT; it listens there and nowhere else.")]
DistBind = Annotated[
    str | None, typer.Option(help="A worker's own listening address (default: the one reaching the coordinator).")
]
DistStages = Annotated[int, typer.Option(min=1, help="Stages in the even default split (torchrun: WORLD_SIZE).")]
DistBits = Annotated[int, typer.Option(help="Activation bits between stages: 32 (bit-exact), 16 or 8.")]
DistPrefillChunk = Annotated[int, typer.Option(min=1, help="Tokens per route pass of a long prefill.")]
DistPrefillWindow = Annotated[int, typer.Option(min=1, help="Prefill chunks in flight along the route.")]
DistTimeout = Annotated[float, typer.Option(help="Seconds a stage may take per message before it is dropped.")]
DistSecret = Annotated[str, typer.Option(envvar=SECRET_ENV, help="Shared secret every worker registration must prove.")]
DistBackend = Annotated[
    str,
    typer.Option(help=f"Transport: {', '.join(TRANSPORTS)} (GPUs: nccl; mlx: the mx.distributed ring, mlx.launch)."),
]
DistDebug = Annotated[bool, typer.Option("--debug", help="Print per-hop telemetry of every route pass.")]


def dist_options(
    role: str | None,
    layers: str | None,
    addr: str | None,
    bind: str | None,
    stages: int,
    bits: int,
    prefill_chunk: int,
    prefill_window: int,
    timeout_s: float,
    secret: str,
    data_backend: str,
    debug: bool,
) -> DistOptions:
    return DistOptions.resolved(
        role=role,
        layers=layers,
        addr=addr,
        bind=bind,
        stages=stages,
        bits=bits,
        prefill_chunk=prefill_chunk,
        prefill_window=prefill_window,
        timeout_s=timeout_s,
        wait_s=timeout_s,
        secret=secret,
        data_backend=data_backend,
        debug=debug,
    )


def join_route(engine: Engine, opts: DistOptions, ctx: int, speculation: MTPOptions | None = None) -> Route | None:
    """A worker serves its layers here and exits when its coordinator shuts it down; a coordinator's
    engine gets the route as its backend (the returned route, to close at the end). With MTP
    `speculation` the last worker loads the block and drafts, and the coordinator requires it."""
    if opts.role == "worker":
        run_worker(engine, opts, ctx, speculation)
        raise typer.Exit(0)
    opts.mtp = speculation is not None
    return distribute(engine, opts, ctx)
