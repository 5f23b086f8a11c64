"""Starting either role: by hand (`--dist-role`, `--layers`, `--dist-addr`) or under torchrun.

Under torchrun (RANK and WORLD_SIZE set) rank 0 is the coordinator, the others are workers, the
layers split evenly by bytes unless `--layers` says otherwise, and the route's store listens on
MASTER_ADDR at MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT). By hand, a worker needs
`--layers`; the coordinator defaults to its even share of `--dist-stages` stages. Either side may
start first: the worker polls for the coordinator's store, the coordinator waits for its route.

With MTP speculation (`--mtp`, `--mtp-draft`) the coordinator drafts through its last stage, which
loads the block itself from its own `--mtp` flags (a worker started by hand on another machine
names its file there) and registers that it holds one; a coordinator that drafts refuses a last
stage without one. DSpark (`--dspark FILE`) drafts the same way, on a last stage that holds the
drafter's target layers (it captures their streams in its passes) and is refused at start-up
otherwise; the coordinator reads the drafter's settings from its own `--dspark FILE`.

Each role loads only its slice (`DistOptions.stage_layers`, which `load_engine` asks before the
weights load): its layers' weights and KV arrays, the embedding on the coordinator, the head on the
last stage. A stage given a model that holds more layers (one process's engine) runs its own only.

A DeepSeek V4.1 file makes a V4.1 route (`route41`, `stage41`): every stage names its `--layers`, a slice
must hold the kv and index sources its layers read, and it runs over gloo without speculation.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.distributed.dist_options import DistOptions
from dwarfstar.distributed.membership import (
    LayerSlice,
    Registration,
    Rendezvous,
    local_host_toward,
    model_identity,
    parse_addr,
)
from dwarfstar.distributed.mlx_ring import MLXRingLink, admit_ring, register_over_ring, ring_group
from dwarfstar.distributed.protocol import DistError
from dwarfstar.distributed.route import Route, RouteOptions
from dwarfstar.distributed.route41 import Route41, RouteBackend41
from dwarfstar.distributed.stage import StageWorker, WorkerOptions, serve_link, serve_stage
from dwarfstar.distributed.stage41 import StageWorker41
from dwarfstar.engine.load import Engine
from dwarfstar.model.file_v41 import FAMILY41, ModelFile41
from dwarfstar.model.forward import Transformer
from dwarfstar.model.model_v41 import Model41

if TYPE_CHECKING:
    from dwarfstar.speculative.dspark import DSparkDraft
    from dwarfstar.speculative.mtp import MTPDraft
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions


def local_model(engine: Engine, layers: LayerSlice) -> Transformer:
    """The engine's model, which must hold the slice's layers (loaded for it, or every layer): the
    backend, which is the shared forward pass (a stage drives its lower entry points, which run
    eagerly: Triton's decode graphs serve only its public calls)."""
    model = engine.backend
    if not isinstance(model, Transformer):
        raise DistError(
            f"the {engine.backend_name} backend wrapped by another feature (steering, streaming) "
            "cannot join a route yet"
        )
    held = model.layer_range
    if not held.start <= layers.first < layers.last <= held.stop:
        raise DistError(
            f"this process loaded layers {held.start}..{held.stop - 1}, which do not cover its slice {layers}"
        )
    return model


def v41_stage(engine: Engine, opts: DistOptions) -> tuple[Model41, LayerSlice] | None:
    """A V4.1 engine's model holding exactly this role's layers (`Model41.hold`) and the slice; None for
    a V4 engine. A V4.1 route runs on gloo links without MTP drafting."""
    if not isinstance(engine.model, ModelFile41):
        return None
    model = engine.backend
    if not isinstance(model, Model41):
        raise DistError(f"the {engine.backend_name} backend wrapped by another feature cannot join a route yet")
    if opts.data_backend != "gloo" or opts.mtp:
        raise DistError(f"a {FAMILY41} route runs over --dist-backend gloo, without MTP drafting")
    layers = opts.slice_for(engine.model)
    if model.layer_range != range(layers.first, layers.last):
        model.hold(layers.first, layers.last)
    return model, layers


def start_coordinator(engine: Engine, opts: DistOptions, ctx: int) -> Route:
    """The coordinator's route on the engine's model, waiting up to `wait_s` for it to be whole."""
    options = RouteOptions(
        opts.bits, opts.prefill_chunk, opts.prefill_window, opts.timeout_s, opts.debug, opts.data_backend
    )
    identity = model_identity(engine.model)
    v41 = v41_stage(engine, opts)
    if v41 is not None:
        host, port = parse_addr(opts.addr)
        route = Route41(*v41, Rendezvous(host, port, opts.secret, opts.wait_s), identity, ctx, options)
        route.wait_complete(opts.wait_s)
        return route
    if opts.ring:
        group = ring_group()
        opts = replace(opts, stages=group.size())
        layers = opts.slice_for(engine.model, group.rank())
        route = Route(local_model(engine, layers), layers, None, identity, ctx, options, opts.mtp)
        admit_ring(route, group, opts.secret)
        route.check_complete()
        return route
    host, port = parse_addr(opts.addr)
    rendezvous = Rendezvous(host, port, opts.secret, opts.wait_s)
    layers = opts.slice_for(engine.model)
    route = Route(local_model(engine, layers), layers, rendezvous, identity, ctx, options, opts.mtp)
    route.wait_complete(opts.wait_s)
    return route


def distribute(engine: Engine, opts: DistOptions, ctx: int) -> Route | None:
    """On a coordinator, the engine's backend becomes the route (returned, to close); else nothing."""
    if opts.role != "coordinator":
        return None
    route = start_coordinator(engine, opts, ctx)
    engine.backend = route_backend(route)
    return route


def route_backend(route: Route) -> RouteBackend | RouteBackend41:
    """The session layer's backend over a coordinator's route (V4's or V4.1's)."""
    return RouteBackend41(route) if isinstance(route, Route41) else RouteBackend(route)


def run_worker(
    engine: Engine, opts: DistOptions, ctx: int, speculation: MTPOptions | DSparkOptions | None = None
) -> None:
    """Serve this process's layers until a coordinator sends SHUTDOWN; with `speculation`, the last
    stage loads the MTP block or the DSpark drafter and drafts for the coordinator."""
    model_id, quant = model_identity(engine.model)
    v41 = v41_stage(engine, opts)
    if v41 is not None:
        if speculation is not None:
            raise DistError(f"a {FAMILY41} route runs without speculative decoding")
        host, port = parse_addr(opts.addr)
        bind = opts.bind or local_host_toward(host)
        model41, layers = v41
        registration = Registration(model_id, quant, layers.first, layers.last, ctx, bind)
        worker = WorkerOptions(host, port, bind, opts.secret, opts.wait_s, opts.data_backend)
        serve_stage(lambda: StageWorker41(model41, layers), registration, worker)
        return
    if opts.ring:
        group = ring_group()
        opts = replace(opts, stages=group.size())
        layers = opts.slice_for(engine.model, group.rank())
        model = local_model(engine, layers)
        draft = stage_draft(engine, model, layers, speculation)
        link = MLXRingLink(group, 0)
        reg = Registration(
            model_id, quant, layers.first, layers.last, ctx, "ring", mtp=draft is not None, dspark=is_dspark(draft)
        )
        register_over_ring(link, reg, opts.secret, group.rank())
        serve_link(StageWorker(model, layers, draft), link)
        return
    layers = opts.slice_for(engine.model)
    host, port = parse_addr(opts.addr)
    bind = opts.bind or local_host_toward(host)
    worker = WorkerOptions(host, port, bind, opts.secret, opts.wait_s, opts.data_backend)
    model = local_model(engine, layers)
    draft = stage_draft(engine, model, layers, speculation)
    registration = Registration(
        model_id, quant, layers.first, layers.last, ctx, bind, mtp=draft is not None, dspark=is_dspark(draft)
    )
    serve_stage(lambda: StageWorker(model, layers, draft), registration, worker)


def stage_draft(
    engine: Engine, model: Transformer, layers: LayerSlice, speculation: MTPOptions | DSparkOptions | None
) -> MTPDraft | DSparkDraft | None:
    """The draft a stage runs: the last stage's MTP block or DSpark drafter, when speculation is asked
    for; else None (a stage without the head has nothing to draft from, and says so). A DSpark
    drafter whose target layers are not all this stage's is a DistError naming them."""
    if speculation is None:
        return None
    if not layers.holds_head:
        print(f"[dist] layers {layers} do not end at the output head: the draft is the last stage's", file=sys.stderr)
        return None
    from dwarfstar.speculative.mtp_options import DSparkOptions

    if isinstance(speculation, DSparkOptions):
        from dwarfstar.distributed.drafting import check_target_layers
        from dwarfstar.speculative.dspark import DSparkDraft

        path = speculation.file_for(engine.model.path)
        draft = DSparkDraft(model, engine.model, path, speculation.confidence)
        try:
            check_target_layers(draft.target_layers, layers)
        except BaseException:
            draft.close()
            raise
        return draft
    from dwarfstar.speculative.mtp import load_draft

    return load_draft(model, engine.model, speculation.file_for(engine.model.path))


def is_dspark(draft: MTPDraft | DSparkDraft | None) -> bool:
    from dwarfstar.speculative.dspark import DSparkDraft

    return isinstance(draft, DSparkDraft)
