"""Put an expert store behind a loaded backend: the budget, the profile seeding, the backend's view.

The CLI's `--ssd-streaming*` flags become a `StreamingOptions`; `streaming_store` builds the store
for the file, which the backend's entry attaches (`backends.registry`) as the expert source the forward
pass reads every MoE through.
Without streaming, `check_fits` refuses a model larger than the memory and names the flag.
Both families' files lay their routed experts out alike (`blk.N.ffn_*_exps`); what differs is what
stays resident beside them (`resident_bytes`): a V4.1 file's Engram tables stay on the disk, and its
sequence state is V4.1's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.layout import (
    BudgetError,
    ExpertLayout,
    auto_budget_bytes,
    experts_for_bytes,
    parse_size,
    routed_tensor_names,
)
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.routing_trace import RoutingTrace
from dwarfstar.experts.store import ExpertBytes, ExpertStore
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.kvcache.payload_v41 import payload41_nbytes
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.loader import ModelFile
from dwarfstar.session.accounting import state_footprint

Model = ModelFile | ModelFile41  # a DeepSeek V4 or V4.1 file

PROFILE_SUFFIX = ".experts.npz"  # `dwarfstar profile-experts` writes MODEL.experts.npz next to the model
PREFILL_CHUNK = 4096
SCRATCH_ROWS_PER_TOKEN = 16  # float32 [chunk, dim] buffers a prefill chunk holds at once, roughly


@dataclass(frozen=True)
class StreamingOptions:
    cache_experts: str | None = None  # a size (`32GB`); None: the automatic budget
    cold: bool = False  # start empty and unseeded (measurement)
    preload_experts: int = 0  # read the N hottest experts of the profile before the first token
    policy: str = "ds4"
    direct: bool = False  # O_DIRECT reads


def profile_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + PROFILE_SUFFIX)


class BackendMemory(Protocol):
    """The memory facts of a backend's entry (`backends.registry.BackendEntry`)."""

    name: str
    float32_weights: bool  # the non-routed weights held as float32 (else as the file stores them)

    def usable_memory(self) -> int: ...


def state_bytes(model: Model, ctx: int) -> int:
    """One sequence of `ctx` tokens' state, as its family's payload holds it."""
    if isinstance(model, ModelFile41):
        return payload41_nbytes(model.args, ctx)
    return state_footprint(model.args).payload_bytes(ctx)


def resident_bytes(model: Model, backend: BackendMemory, ctx: int) -> int:
    """What stays in memory besides the cached experts: non-routed weights (float32 where the backend
    holds them so, else as the file stores them), one context's KV, and a prefill chunk's scratch."""
    routed = set(routed_tensor_names(model.args.n_layers))
    weights = 0
    for name, info in model.gguf.tensors.items():
        if name not in routed and model.holds(name):  # a pipeline stage's slice; V4.1's Engram tables not
            weights += info.n_elements * 4 if backend.float32_weights else info.nbytes
    kv = state_bytes(model, ctx)
    scratch = PREFILL_CHUNK * model.args.dim * 4 * SCRATCH_ROWS_PER_TOKEN
    return weights + kv + scratch


def check_fits(model: Model, backend: BackendMemory, ctx: int, host_layers: range = range(0)) -> None:
    """A model whose routed experts do not fit next to everything else is an error naming the flag;
    `host_layers`' routed experts stay in RAM (`--cpu-moe`) and are not counted."""
    # from the tensor table, not an `ExpertLayout` (which reads offsets in one file): a split set too
    host = set(routed_tensor_names(host_layers.stop)) - set(routed_tensor_names(host_layers.start))
    names = set(routed_tensor_names(model.args.n_layers)) - host
    routed = sum(info.nbytes for name, info in model.gguf.tensors.items() if name in names and model.holds(name))
    need = routed + resident_bytes(model, backend, ctx)
    usable = backend.usable_memory()
    if need > usable:
        raise DwarfStarError(
            f"{model.path.name} needs {need / (1 << 30):.1f} GiB on the {backend.name} backend but "
            f"{usable / (1 << 30):.1f} GiB is usable; run with --ssd-streaming to keep the routed experts "
            f"({routed / (1 << 30):.1f} GiB) on disk and cache what fits"
        )


def plan_capacity(
    model: Model, layout: ExpertLayout, backend: BackendMemory, ctx: int, options: StreamingOptions
) -> int:
    if options.cache_experts is not None:
        budget = parse_size(options.cache_experts)
        what = f"--ssd-streaming-cache-experts {options.cache_experts}"
    else:
        budget = auto_budget_bytes(backend.usable_memory(), resident_bytes(model, backend, ctx))
        what = f"the automatic budget ({budget / (1 << 30):.2f} GiB: 80% of usable memory minus resident weights)"
    capacity = experts_for_bytes(budget, layout.max_expert_bytes)
    if capacity < layout.n_active:
        raise BudgetError(
            f"{what} holds {capacity} experts of {layout.max_expert_bytes / (1 << 20):.2f} MiB, fewer than the "
            f"{layout.n_active} one token uses per layer; give a larger --ssd-streaming-cache-experts"
        )
    return min(capacity, layout.total_experts)


def reference_expert(expert: ExpertBytes) -> tuple[torch.Tensor, ...]:
    """The reference's view: each part dequantized to float32 [out, in] (a copy, never a view)."""
    return tuple(
        dequantize(data, part.ggml_type, part.shape[0] * part.shape[1]).view(part.shape)
        for part, data in zip(expert.parts, expert.data, strict=True)
    )


def build_store(model: Model, capacity: int, options: StreamingOptions) -> ExpertStore:
    layout = ExpertLayout.of(model.gguf, model.args)
    policy = make_policy(options.policy, layout.total_experts)
    store = ExpertStore(layout, capacity, policy, direct=options.direct)
    profile = profile_path(model.path)
    if not options.cold and profile.is_file():
        trace = RoutingTrace.load(profile, layout.n_layers, layout.n_experts)
        policy.seed(trace.counts())
        store.preload(trace.hot_keys()[: options.preload_experts])
    return store


def streaming_store(model: Model, backend: BackendMemory, ctx: int, options: StreamingOptions) -> ExpertStore:
    """The store the backend's routed experts stream through (its `stats` are the telemetry); the
    backend's entry attaches it (`BackendEntry.attach_experts`)."""
    layout = ExpertLayout.of(model.gguf, model.args)
    return build_store(model, plan_capacity(model, layout, backend, ctx, options), options)
