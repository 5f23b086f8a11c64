"""Load what an `EngineSpec` describes (a model file on a compute backend, with its tokenizer):
`load_engine(spec)`, what the CLI, the server and the tests share.

Backend choice: `auto` takes MLX on Apple silicon, Triton where a GPU is present, and the torch
reference otherwise. A backend that cannot run here is a clear error, never a silent fallback.
`triton` without a GPU runs only when TRITON_INTERPRET=1 asks for Triton's interpreter (slow: for
debugging kernels), which `auto` never picks.

Precision: `exact` keeps every product in fp32; `fast` lets the Triton backend's prefill products use
bf16 operands with fp32 accumulation. No GPU run has shown `fast` to be accurate yet, so `exact` is
the default, and the backends without the notion (reference, MLX) refuse `fast`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dwarfstar.engine_spec import BACKENDS, EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import attach_streaming, check_fits
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.session.session import Backend
from dwarfstar.tokenizer.tokenizer import Tokenizer


@dataclass
class Engine:
    model: ModelFile
    backend: Backend
    backend_name: str
    tokenizer: Tokenizer
    load_seconds: float
    experts: ExpertStore | None = None  # the routed-expert cache, with --ssd-streaming


def available_backends() -> list[str]:
    names = ["reference"]
    try:
        from dwarfstar.backends.triton import triton_available

        if triton_available():
            names.append("triton")
    except ImportError:
        pass
    try:
        from dwarfstar.backends.mlx import mlx_available

        if mlx_available():
            names.append("mlx")
    except ImportError:
        pass
    return names


def pick_backend(requested: str) -> str:
    if requested not in BACKENDS:
        raise DwarfStarError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    available = available_backends()
    if requested == "auto":
        if "mlx" in available:
            from dwarfstar.backends.mlx import metal_available

            if metal_available():  # MLX also runs on a Linux CPU, but there the reference is faster
                return "mlx"
        return "triton" if "triton" in available else "reference"
    if requested == "triton" and "triton" not in available:
        from dwarfstar.backends.triton import interpreter_requested

        if interpreter_requested():
            return requested
        raise DwarfStarError(
            f"backend 'triton' needs a CUDA or ROCm GPU (available: {', '.join(available)}); "
            "set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter on the CPU (very slow, for debugging)"
        )
    if requested not in available:
        raise DwarfStarError(f"backend {requested!r} cannot run on this machine (available: {', '.join(available)})")
    return requested


def spec_backend(spec: EngineSpec) -> str:
    """The backend `spec` runs on here, and whether it can take the spec's precision (before anything loads)."""
    name = pick_backend(spec.backend)
    if spec.precision == "fast" and name != "triton":
        raise DwarfStarError(f"--precision fast needs the triton backend; the {name} backend has no fast mode")
    return name


KV_SLOTS = 4  # sequences to a KV-cache block on the reference and Triton backends, by default


def load_engine(spec: EngineSpec, progress: Callable[[int, int], None] | None = None) -> Engine:
    """Open, validate and load what `spec` describes; `progress(done, total)` follows the weights being
    read. The only way to an `Engine`: the command line builds the spec from its flags."""
    start = time.perf_counter()
    name = spec_backend(spec)
    model = open_model(spec.model, spec.stage_layers())
    tokenizer = Tokenizer.from_gguf_metadata(model.gguf.metadata)
    ctx, qat, streaming, steering = spec.ctx, spec.qat, spec.streaming, spec.steering
    limit = ctx or model.args.max_seq_len
    stream = streaming is not None  # the routed experts are not loaded: they stream from the file
    if not stream:  # too big a model is an error naming --ssd-streaming, before any weight loads
        check_fits(model, name, limit)
    direction = steering.read(model.args) if steering is not None else None  # a bad file fails before the weights load
    slots = spec.kv_slots or KV_SLOTS
    if name == "reference":
        from dwarfstar.backends.reference.model import ReferenceModel

        impl: Backend = ReferenceModel(model, qat=qat, max_seq_len=ctx, progress=progress, kv_slots=slots)
    elif name == "triton":
        from dwarfstar.backends.triton import load_backend

        precision = spec.precision
        impl = load_backend(model, qat=qat, precision=precision, max_seq_len=ctx, kv_slots=slots, stream_experts=stream)
    else:
        from dwarfstar.backends.mlx import load_backend

        impl = load_backend(model, qat=qat, max_seq_len=ctx, stream_experts=stream, kv_slots=spec.kv_slots or 1)
    experts = None if streaming is None else attach_streaming(impl, name, model, limit, streaming)
    if steering is not None:
        impl = steering.install(impl, direction)
    if progress is not None and name != "reference":
        progress(1, 1)  # these backends report no steps; still finish the bar
    return Engine(model, impl, name, tokenizer, time.perf_counter() - start, experts)
