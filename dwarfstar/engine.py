"""Load a model file onto a compute backend, with its tokenizer: what the CLI and the server share.

Backend choice: `auto` takes MLX on Apple silicon, Triton where a GPU is present, and the torch
reference otherwise. A backend that cannot run here is a clear error, never a silent fallback.
`triton` without a GPU runs only when TRITON_INTERPRET=1 asks for Triton's interpreter (slow: for
debugging kernels), which `auto` never picks.

Precision: `exact` keeps every product in fp32; `fast` lets the Triton backend's prefill products use
bf16 operands with fp32 accumulation. No GPU run has shown `fast` to be accurate yet, so `exact` is
the default, and the backends without the notion (reference, MLX) refuse `fast`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import StreamingOptions, attach_streaming, check_fits
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.session.session import Backend
from dwarfstar.steering.apply import SteeringOptions
from dwarfstar.tokenizer.tokenizer import Tokenizer

BACKENDS = ("auto", "reference", "triton", "mlx")
PRECISIONS = ("exact", "fast")
PRECISION_HELP = (
    "exact: fp32 products; fast: bf16 operands in the Triton backend's prefill products (triton only; "
    "no GPU run has shown fast to be accurate yet)."
)


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


KV_SLOTS = 4  # sequences to a KV-cache block on the reference and Triton backends, by default


def load_engine(
    path: str | os.PathLike,
    backend: str = "auto",
    qat: bool = True,
    ctx: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str = "exact",
    streaming: StreamingOptions | None = None,
    steering: SteeringOptions | None = None,
    kv_slots: int | None = None,
    layers: tuple[int, int] | None = None,
) -> Engine:
    """Open, validate and load a model for sequences of at most `ctx` tokens (default: the model's);
    `progress(done, total)` follows the weights being read; `steering` applies a direction file;
    `kv_slots` sequences share a KV-cache block, decode in one batch (Triton, reference) and share
    their row pages when forked (default: 4, and 1 on MLX, which allocates a block's rows whole);
    `layers=(first, end)` loads only those layers (a pipeline stage: `DistOptions.stage_layers`)."""
    start = time.perf_counter()
    name = pick_backend(backend)
    if precision not in PRECISIONS:
        raise DwarfStarError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fast" and name != "triton":
        raise DwarfStarError(f"--precision fast needs the triton backend; the {name} backend has no fast mode")
    model = open_model(Path(path), layers)
    tokenizer = Tokenizer.from_gguf_metadata(model.gguf.metadata)
    limit = ctx or model.args.max_seq_len
    stream = streaming is not None  # the routed experts are not loaded: they stream from the file
    if not stream:  # too big a model is an error naming --ssd-streaming, before any weight loads
        check_fits(model, name, limit)
    direction = steering.read(model.args) if steering is not None else None  # a bad file fails before the weights load
    if name == "reference":
        from dwarfstar.backends.reference.model import ReferenceModel

        slots = kv_slots or KV_SLOTS
        impl: Backend = ReferenceModel(model, qat=qat, max_seq_len=ctx, progress=progress, kv_slots=slots)
    elif name == "triton":
        from dwarfstar.backends.triton import load_backend

        impl = load_backend(
            model, qat=qat, precision=precision, max_seq_len=ctx, kv_slots=kv_slots or KV_SLOTS, stream_experts=stream
        )
    else:
        from dwarfstar.backends.mlx import load_backend

        impl = load_backend(model, qat=qat, max_seq_len=ctx, stream_experts=stream, kv_slots=kv_slots or 1)
    experts = None if streaming is None else attach_streaming(impl, name, model, limit, streaming)
    if steering is not None:
        impl = steering.install(impl, direction)
    if progress is not None and name != "reference":
        progress(1, 1)  # these backends report no steps; still finish the bar
    return Engine(model, impl, name, tokenizer, time.perf_counter() - start, experts)
