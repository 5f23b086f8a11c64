"""One captured decode step, as the GPU would run it, recorded without a GPU.

The Triton model is built over weights and a KV cache on torch's meta device (shapes and dtypes, no
memory), at the exact Flash or PRO shapes. The decode step a CUDA graph captures
(`graphs.DecodeGraphs.body`) runs once with every Triton launch intercepted (`target.intercepted`):
each is recorded with its grid and arguments instead of run. Every torch operation on the device is
recorded too (`TorchDispatchMode`): views and allocations launch nothing and are skipped, everything
else is a kernel (or a copy) in the graph. A host sync inside the step (reading a device value)
cannot happen on the meta device: it fails the recording, as it would break a capture.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dwarfstar.backends.triton.plan.target import intercepted
from dwarfstar.errors import DwarfStarError

META = torch.device("meta")
# torch operations that launch nothing: views, aliases, allocations and metadata
NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "as_strided", "t",
    "transpose", "permute", "unbind", "split", "split_with_sizes", "alias", "detach", "reshape",
    "unflatten", "flatten", "empty", "empty_strided", "empty_like", "lift_fresh", "narrow", "view_as",
    "_reshape_alias", "diagonal", "unfold", "movedim", "sym_size", "sym_stride", "sym_numel", "new_empty",
    "new_empty_strided",
    "is_same_size", "_has_compatible_shallow_copy_type", "dim", "size", "stride", "numel",
})  # fmt: skip


@dataclass
class Launch:
    """One device launch of the step: a Triton kernel, or a torch operation."""

    kind: str  # "triton" or "torch"
    name: str  # the kernel's function name, or the aten operation
    programs: int = 1  # Triton: the grid's program count
    args: dict[str, Any] = field(default_factory=dict)  # Triton: every argument by name, constexprs included
    fn: Any = None  # Triton: the JITFunction, to compile
    call: tuple = ()  # Triton: (positional args, grid, keyword args) as launched
    bytes: int = 0  # torch: bytes of its tensor operands and results
    layer: int | None = None  # the model layer that launched it, where the recording tracks layers (`step41`)


def _programs(grid, named: dict[str, Any]) -> int:
    dims = grid(named) if callable(grid) else grid
    return math.prod(int(d) for d in dims)


class _TorchLaunches(TorchDispatchMode):
    def __init__(self, launches: list[Launch]) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        no_op = any(out is x for x in tree_flatten((args, kwargs))[0])  # e.g. .float() of a float32 tensor
        if name not in NO_LAUNCH and not no_op and any(t.device.type == "meta" for t in tensors):
            moved = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "meta")
            self.launches.append(Launch("torch", name, bytes=moved))
        return out


def record(step) -> list[Launch]:
    """Run `step()` twice with every device launch intercepted, and return the second run's: as a
    graph capture follows an eager run, which made the step's one-time buffers (ticket counters,
    lookup tables)."""
    launches: list[Launch] = []

    def on_launch(fn, args, grid, kwargs):
        named = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        launches.append(Launch("triton", fn.fn.__name__, _programs(grid, named), named, fn, (args, grid, kwargs)))

    with intercepted(on_launch), _TorchLaunches(launches), torch.inference_mode():
        try:
            step()
            launches.clear()
            step()
        except NotImplementedError as exc:  # a meta tensor read on the host: a sync inside the step
            raise DwarfStarError(f"the decode step reads a device value on the host (breaks capture): {exc}") from exc
    return launches


@dataclass
class DecodeStep:
    """A recorded decode step and what it was recorded on."""

    preset: str
    args: Any  # ModelArgs
    batch: int
    ctx: int
    launches: list[Launch]
    weight_bytes: int  # weights one step reads (routed experts: batch * k of E per layer, as if distinct)
    captured: bool = True  # False: recorded as it runs, its uploads and host reads in `launches` (`eager`)
    host_reads: Any = None  # what the step read from the model file on the host (`step41.HostReads`)

    def counts(self) -> Counter:
        return Counter(f"{launch.kind}:{launch.name}" for launch in self.launches)

    @property
    def n_layers(self) -> int:
        return self.args.n_layers


def record_decode_step(
    preset: str = "flash-q2",
    batch: int = 1,
    ctx: int = 2048,
    layers: int | None = None,
    sample: bool = True,
    multiprocessors: int = 132,
    precision: str = "exact",
) -> DecodeStep:
    """The decode step a graph replays for `batch` sequences at context `ctx` on the synthetic
    `preset` model's exact shapes (`synthetic.PRESETS`), with the sampling kernel when `sample`, its
    grids sized for a GPU of `multiprocessors` SMs / CUs, its matrices at `precision` ("exact" or
    "fast", `runtime.PRECISIONS`)."""
    from dwarfstar.backends.triton.gpu_bench import decode_bytes_per_token
    from dwarfstar.backends.triton.graphs import BUCKETS, DecodeGraphs
    from dwarfstar.backends.triton.kernels.sampling import candidates_for
    from dwarfstar.backends.triton.model import TritonModel, row_bound
    from dwarfstar.backends.triton.runtime import PRECISIONS, assume_multiprocessors
    from dwarfstar.backends.triton.synthetic import meta_weights
    from dwarfstar.sampling import SamplingParams

    if batch > BUCKETS[-1]:
        raise DwarfStarError(f"a captured decode step serves at most {BUCKETS[-1]} sequences, asked for {batch}")
    assume_multiprocessors(multiprocessors)
    weights = meta_weights(preset, layers)
    bucket = next(b for b in BUCKETS if b >= batch)
    model = TritonModel(weights, max_seq_len=ctx + 1, kv_slots=bucket + 1, precision=PRECISIONS[precision])
    graphs = DecodeGraphs(model)
    states = [model.new_state() for _ in range(batch)]
    for state in states:  # as after ctx tokens: pages under every row, the position at ctx
        state.reserve(0, ctx)
        state.pos = ctx
    bounds = tuple(max(row_bound(s.cache, r, s.pos + 1) for s in states) for r in graphs.ratios)
    k = candidates_for([SamplingParams(temperature=1.0, top_p=0.95)], model.args.vocab_size) if sample else 0
    run = graphs.body(bucket, bounds, k)[0]
    return DecodeStep(preset, model.args, batch, ctx, record(run), decode_bytes_per_token(weights, batch))
