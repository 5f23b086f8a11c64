"""Triton kernels for CUDA and ROCm (DGX Spark, H100/H200, Strix Halo).

`load_backend(model_file)` uploads a model and returns the backend the session layer drives. On a
machine without a GPU the kernels run in Triton's interpreter (slow; for tests), which must be
chosen before the kernel modules are imported, so this module imports them lazily.
"""

from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    """True where the kernels compile: triton importable, a CUDA or ROCm device present, and Triton's
    interpreter not switched on (with TRITON_INTERPRET=1 every kernel runs in it, GPU or not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and not interpreter_requested()


def interpreter_requested() -> bool:
    """True where TRITON_INTERPRET=1 asks for Triton's interpreter: the kernels run on the CPU, slowly,
    which is how to debug them from the CLI on a machine without a GPU."""
    try:
        from dwarfstar.backends.triton.runtime import interpreting
    except ImportError:  # triton itself is missing
        return False
    return interpreting()


def _pick_runtime(device: torch.device | str | None) -> None:
    """Triton's interpreter where no GPU runs the kernels (before any kernel module is imported)."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type == "cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_backend(
    model_file,
    device: torch.device | str | None = None,
    qat: bool = True,
    precision: str = "exact",
    max_seq_len: int | None = None,
    kv_slots: int = 4,
    stream_experts: bool = False,
    cpu_moe: range = range(0),
    threads: int | None = None,
):
    """A `TritonBackend` over `model_file` (a `ModelFile`), on `device` (default: the GPU, else the
    CPU through Triton's interpreter), with `precision` "exact" or "fast" (`runtime.PRECISIONS`) and
    sequences of at most `max_seq_len` tokens (default: the model's), `kv_slots` to a KV-cache block
    (the sequences one batched decode launch can serve). With `stream_experts` the routed experts are
    not uploaded (`experts.attach` streams them) and decode is not captured in graphs: a cache miss
    reads the file on the host, which a graph replay cannot do. The routed experts of the `cpu_moe`
    layers stay in the file, computed by the CPU kernels on `threads` threads (`--cpu-moe`), and decode
    then runs eagerly too."""
    _pick_runtime(device)
    from dwarfstar.backends.triton.backend import TritonBackend
    from dwarfstar.backends.triton.runtime import PRECISIONS, default_device
    from dwarfstar.backends.triton.weights import upload

    options = dict(qat=qat, precision=PRECISIONS[precision], max_seq_len=max_seq_len, kv_slots=kv_slots)
    if not stream_experts and not cpu_moe:
        return TritonBackend.from_model_file(model_file, device=device, **options)
    device = torch.device(device) if device is not None else default_device()
    gguf, args = model_file.gguf, model_file.args
    host = None
    if cpu_moe:
        from dwarfstar.backends.cpu.experts import HostExperts

        host = HostExperts(gguf, args, cpu_moe, threads)
    weights = upload(gguf, args, device, not stream_experts, model_file.layer_range, host_layers=cpu_moe)
    return TritonBackend(weights, graphs=False, host=host, **options)


def load_backend41(
    model_file,
    engram_cache_bytes: int,
    max_seq_len: int | None = None,
    device=None,
    precision="exact",
    stream_experts: bool = False,
    cpu_moe: range = range(0),
    threads: int | None = None,
):
    """A `v41.backend.TritonModel41` over `model_file` (a `ModelFile41`) on `device` (default: the GPU,
    else the CPU through Triton's interpreter), its Engram rows read through a cache of
    `engram_cache_bytes`, sequences of at most `max_seq_len` tokens (default: the model's). Only the
    exact precision runs V4.1 yet. `stream_experts` and `cpu_moe` (with `threads`) as `load_backend`
    takes them: the routed experts left in the file for a cache, or those of some layers computed by
    the CPU kernels."""
    from dwarfstar.errors import DwarfStarError

    if precision != "exact":
        raise DwarfStarError(f"the triton backend runs DeepSeek V4.1 in exact precision only yet, not {precision!r}")
    _pick_runtime(device)
    from dwarfstar.backends.triton.runtime import default_device
    from dwarfstar.backends.triton.v41.backend import TritonModel41

    device = torch.device(device) if device is not None else default_device()
    host = None
    if cpu_moe:
        from dwarfstar.backends.cpu.experts import HostExperts

        host = HostExperts(model_file.gguf, model_file.args, cpu_moe, threads)
    return TritonModel41.from_file(model_file, engram_cache_bytes, max_seq_len, device, not stream_experts, host)
