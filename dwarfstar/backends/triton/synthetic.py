"""Full-size synthetic models made directly in device memory, for benchmarks without the real weights.

`synthetic_weights("flash-q2")` builds every tensor of DeepSeek V4 Flash with its real shape and the
block types of ds4's published files (Q8_0 projections; F16 embeddings, mHC, compressors, indexer and
router; routed experts IQ2_XXS/Q2_K for q2, Q4_K for q4): random block payloads with sane fp16 scales,
so activations stay finite and every kernel does the work it does on the real model. Nothing touches
a file. Flash q2 takes about 81 GiB, q4 about 153 GiB (too much for one 141 GB GPU: pass `layers`),
PRO q2 about 430 GB (pass `layers`).

`synthetic_state(model, ctx)` is a sequence state as if `ctx` tokens had been seen (random rows, a
full raw window, frontiers with the right pending slots), so decode at long context can be timed
without running the prefill first.
"""

from __future__ import annotations

import numpy as np
import torch

from dwarfstar.backends.triton.model import TritonModel
from dwarfstar.backends.triton.v41.weights import Weights41, build_weights41
from dwarfstar.backends.triton.weights import ModelWeights, QWeight, aligned_row_bytes, build_weights, random_qweight
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41, layer_plan
from dwarfstar.model.state import SequenceState
from dwarfstar.model.synthetic import MXFP4, Q2, ExpertRecipe, _random_values, _short_name, tensor_type
from dwarfstar.model.tensors import TensorSpec, expected_tensors

META = torch.device("meta")

Q4 = ExpertRecipe(GGMLType.Q4_K, GGMLType.Q4_K)
PRESETS: dict[str, tuple[ModelArgs, ExpertRecipe]] = {
    "flash-q2": (ModelArgs.flash(), Q2),
    "flash-q4": (ModelArgs.flash(), Q4),
    "flash-mxfp4": (ModelArgs.flash(), MXFP4),
    "pro-q2": (ModelArgs.pro(), Q2),
}


def synthetic_args(preset: str, layers: int | None = None) -> tuple[ModelArgs, ExpertRecipe]:
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic model {preset!r}; choose one of {', '.join(PRESETS)}")
    args, recipe = PRESETS[preset]
    if layers is not None:
        if not 1 <= layers <= args.n_layers:
            raise ValueError(f"{preset} has 1..{args.n_layers} layers, asked for {layers}")
        args = args.with_(n_layers=layers, n_hash_layers=min(args.n_hash_layers, layers))
    return args, recipe


def synthetic_weights(
    preset: str, layers: int | None = None, device: torch.device | str = "cuda", seed: int = 0
) -> ModelWeights:
    args, recipe = synthetic_args(preset, layers)
    specs = {spec.name: spec for spec in expected_tensors(args)}
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)

    def matrix(name: str) -> QWeight:
        spec = specs[name]
        return random_qweight(tensor_type(spec, "ds4", recipe), spec.shape, device, gen)

    def vector(name: str) -> torch.Tensor:
        spec = specs[name]
        if spec.types == frozenset({GGMLType.I32}):  # token -> experts: k distinct experts per token
            ranks = torch.rand(args.vocab_size, args.n_routed_experts, device=device, generator=gen).argsort(1)
            return ranks[:, : args.n_activated_experts].to(torch.int32)
        shape = (int(np.prod(spec.shape[:-1], dtype=np.int64)) if len(spec.shape) > 1 else 1, spec.shape[-1])
        values = _random_values(_short_name(name), spec, shape, cpu_gen)
        return values.reshape(spec.shape).to(device)

    return build_weights(args, matrix, vector)


def _meta_matrix(spec: TensorSpec, recipe: ExpertRecipe) -> QWeight:
    """A matrix of `spec`'s shape in ds4's block type (`recipe`'s experts), aligned rows, no memory."""
    ggml_type = tensor_type(spec, "ds4", recipe)
    rows, cols = int(np.prod(spec.shape[:-1], dtype=np.int64)), spec.shape[-1]
    data = torch.empty(rows, aligned_row_bytes(ggml_type, cols), dtype=torch.uint8, device=META)
    return QWeight(data, ggml_type, rows, cols, spec.shape[0] if len(spec.shape) == 3 else 1)


def meta_weights(preset: str, layers: int | None = None) -> ModelWeights:
    """The preset's weights on torch's meta device: every tensor with its real shape, block type and
    aligned row bytes, and no memory (what `plan` records a decode step on)."""
    args, recipe = synthetic_args(preset, layers)
    specs = {spec.name: spec for spec in expected_tensors(args)}

    def vector(name: str) -> torch.Tensor:
        spec = specs[name]
        if spec.types == frozenset({GGMLType.I32}):  # token -> experts
            return torch.empty(args.vocab_size, args.n_activated_experts, dtype=torch.int32, device=META)
        return torch.empty(spec.shape, device=META)

    return build_weights(args, lambda name: _meta_matrix(specs[name], recipe), vector)


def meta_weights41(layers: int | None = None) -> Weights41:
    """V4.1 Flash's weights on the meta device in ds4's published types (Q8_0 projections, F16 where ds4
    keeps it, IQ2_XXS gate/up and Q2_K down experts): Flash's 40 layers, or its layout scaled to
    `layers` (`config_v41.layer_plan`, at least 4)."""
    args = ModelArgs41() if layers is None else ModelArgs41().with_plan(layer_plan(layers))
    return build_weights41(
        args, lambda spec: _meta_matrix(spec, Q2), lambda spec: torch.empty(spec.shape, device=META), META
    )


def synthetic_state(model: TritonModel, ctx: int, seed: int = 0) -> SequenceState:
    """A state as after `ctx` tokens: random raw window and rows, frontiers holding the pending slots."""
    args, device = model.args, model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    state = model.new_state()
    for il, specs in enumerate(state.cache.compressors):
        state.store_window(il, torch.randn(min(ctx, args.window), args.head_dim, device=device, generator=gen), ctx)
        for kind, spec in specs.items():
            n = ctx // spec.ratio
            state.write(il, f"{kind}_rows", torch.randn(n, spec.dim, device=device, generator=gen))
            filled = ctx % spec.ratio + (spec.ratio if spec.overlap and n else 0)
            start = 0 if spec.overlap and n else spec.current_offset
            width = spec.frontier_shape[1]
            for name in (f"{kind}_kv", f"{kind}_gate"):
                state.write(il, name, torch.randn(filled, width, device=device, generator=gen), start)
    state.pos = ctx
    state.tokens = torch.randint(3, args.vocab_size, (ctx,), generator=torch.Generator().manual_seed(seed)).tolist()
    return state
