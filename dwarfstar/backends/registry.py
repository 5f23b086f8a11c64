"""The compute backends, one entry each: name, what it can do, its memory facts and its hooks.

Everything that differs by backend outside the backends themselves is asked of its entry here
(`backend_entry(name)`), never decided by comparing names: which backend `auto` picks, how one
loads, which precision it takes, the memory its experts live in, how a streamed expert source is
attached, the MTP draft model beside a target (`entry_of(model)` finds the entry of a model
already built) and the vision encoder's steps (`vision_ops`). Every backend is a
`model.forward.Transformer` over its `Ops`: what a pipeline stage, steering and speculation drive is
the backend itself. An entry imports its backend only when a hook runs, so naming the backends
costs no torch, Triton or MLX import.

Backend choice: `auto` takes MLX on Apple silicon, Triton where a GPU is present, the cpu backend
(the CPU kernels) for a model file of 1 GiB or more, and the torch reference otherwise. A backend
that cannot run here is a clear error, never a silent fallback.
`triton` without a GPU runs only when TRITON_INTERPRET=1 asks for Triton's interpreter (slow: for
debugging kernels), which `auto` never picks.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    import torch

    from dwarfstar.backends.protocol import Backend
    from dwarfstar.backends.reference.weights import Products
    from dwarfstar.experts.store import ExpertStore
    from dwarfstar.gguf.reader import GGUFFile
    from dwarfstar.model.file_v41 import ModelFile41
    from dwarfstar.model.forward import Batch, Transformer
    from dwarfstar.model.loader import ModelFile
    from dwarfstar.model.vision import VisionArgs, VisionOps


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Load:
    """How to load a backend (from an `EngineSpec`, with the entry's defaults filled in)."""

    qat: bool
    precision: str  # `engine.spec.PRECISIONS`; only an entry with `fast_precision` is given "fast"
    ctx: int | None  # the longest sequence (None: the model's)
    kv_slots: int  # sequences to a KV-cache block
    stream: bool  # leave the routed experts in the file (`attach_experts` streams them)
    progress: Callable[[int, int], None] | None = None  # (done, total) as the weights are read
    threads: int | None = None  # CPU threads of the cpu backend's kernels (None: every core)
    cpu_moe: range = range(0)  # layers whose routed experts stay in RAM on the CPU kernels (`host_experts`)


class BackendEntry(ABC):
    """One backend. The defaults describe a backend on the host's memory that takes every spec as is."""

    name: str
    model_class: tuple[str, str]  # (module, class) of the `Transformer` the backend is (or subclasses)
    fast_precision = False  # takes `--precision fast` (bf16 operands in prefill products)
    kv_slots = 4  # sequences to a KV-cache block, by default
    float32_weights = False  # holds the non-routed weights as float32 (else as the file stores them)
    reports_progress = False  # `load` calls `progress` as the weights are read
    mlx_arrays = False  # its activations are MLX arrays (else torch tensors)
    host_experts = False  # takes `--cpu-moe`: some layers' routed experts on the CPU kernels

    def available(self) -> bool:
        """Whether it runs on this machine."""
        return True

    def runs_on_request(self) -> bool:
        """Whether it runs when asked for by name (where `auto` would not take it)."""
        return self.available()

    def preferred(self, model_bytes: int = 0) -> bool:
        """Whether `auto` takes it for a model file of `model_bytes` (entries are asked in `PREFERENCE`
        order)."""
        return self.available()

    def missing(self, available: list[str]) -> str:
        return f"backend {self.name!r} cannot run on this machine (available: {', '.join(available)})"

    @abstractmethod
    def load(self, model: ModelFile, load: Load) -> Backend:
        """The backend over `model`; with `load.stream` the routed experts are left in the file."""

    @abstractmethod
    def load41(self, model: ModelFile41, load: Load, engram_cache_bytes: int) -> Backend:
        """The backend over a DeepSeek V4.1 file, its Engram rows read through a cache of
        `engram_cache_bytes` (every backend runs V4.1: issue 33); `load.stream` and `load.cpu_moe` as
        `load` takes them."""

    def usable_memory(self) -> int:
        """Bytes the backend's experts can live in."""
        return host_memory()

    def free_device_memory(self) -> int | None:
        """Free bytes of the device memory its states live in; None where they live in the host's."""
        return None

    @abstractmethod
    def attach_experts(self, backend: Backend, store: ExpertStore) -> None:
        """Read the routed experts of `backend` (loaded with `stream`) through `store`."""

    @abstractmethod
    def draft_model(self, target: Transformer, draft: ModelFile) -> Transformer:
        """The MTP block `draft` (`speculative.mtp.DraftFile`'s model) as a one-layer model of the backend
        that built `target`, with `target`'s settings."""

    @abstractmethod
    def vision_ops(self, args: VisionArgs, tensors: Mapping[str, torch.Tensor]) -> VisionOps:
        """The vision encoder's steps on this backend (`model.vision.VisionEncoder` drives them), over
        `tensors`: the encoder checkpoint's, by the names of `args.tensor_shapes()`, any float dtype."""

    def attach_image_biases(self, backend: Backend, biases: Mapping[int, torch.Tensor]) -> None:
        """Give `backend` the routers' biases for image positions (layer -> [n_routed_experts], from a
        vision encoder file), which image blocks route by (`Transformer.attach_image_biases`)."""
        backend.attach_image_biases(biases)

    def settle(self, out: object, batch: Batch) -> None:
        """Finish the work of a pass that stops before the output head (a pipeline stage's): the
        activation `out` and the states `batch` wrote, as `Ops.logits` does at the head. Eager
        backends have nothing left to do."""
        return None

    def owns(self, model: object) -> bool:
        """Whether this backend built `model` (a backend whose module is not imported yet cannot have)."""
        module = sys.modules.get(self.model_class[0])
        return module is not None and isinstance(model, getattr(module, self.model_class[1]))


class Reference(BackendEntry):
    name = "reference"
    model_class = ("dwarfstar.backends.reference.model", "ReferenceModel")
    float32_weights = True
    reports_progress = True

    def owns(self, model):
        from dwarfstar.backends.reference.weights import FLOAT32

        return super().owns(model) and model.ops.products is FLOAT32

    def load(self, model, load):
        from dwarfstar.backends.reference.model import ReferenceModel

        return ReferenceModel(model, qat=load.qat, max_seq_len=load.ctx, progress=load.progress, kv_slots=load.kv_slots)

    def load41(self, model, load, engram_cache_bytes):
        from dwarfstar.backends.reference.v41.backend import ReferenceModel41

        return ReferenceModel41.from_file(model, engram_cache_bytes, load.ctx)

    def attach_experts(self, backend, store):
        from dwarfstar.experts.attach import reference_expert
        from dwarfstar.experts.source import StreamingExperts

        backend.experts = StreamingExperts(store, reference_expert)

    def draft_model(self, target, draft):
        from dwarfstar.backends.reference.model import ReferenceModel

        return ReferenceModel(draft, qat=target.qat, max_seq_len=target.max_seq_len)

    def vision_ops(self, args, tensors):
        from dwarfstar.backends.reference.vision import TorchVisionOps

        return TorchVisionOps(args, tensors)  # float32 on the CPU (the cpu backend's too)


AUTO_CPU_BYTES = 1 << 30  # from this file size `auto` takes the cpu backend over the reference
POPULATE_SHARE = 0.8  # the cpu backend maps a file's pages at load where it is at most this share of RAM


class Cpu(Reference):
    """The reference's forward with its weight products on the CPU kernels (backends/cpu): the weights
    stay in their file blocks, the activations are quantized to int8 per product input. Falls back to
    the reference's float32 products, said once, where no C compiler can build the kernels."""

    name = "cpu"
    float32_weights = False

    def preferred(self, model_bytes: int = 0) -> bool:
        """`auto` takes it for files of AUTO_CPU_BYTES and more, where the kernels build: a small model's
        step is its Python and torch glue (the nano model decodes 50.3 tok/s on it, 50.9 on the
        reference), so there the reference's exact float32 stays the default."""
        from dwarfstar.backends.cpu.native import available

        return model_bytes >= AUTO_CPU_BYTES and available() is None

    def load(self, model, load):
        from dwarfstar.backends.reference.model import ReferenceModel

        if not load.stream:
            _map_pages(model.gguf, sum(path.stat().st_size for path in model.parts or (model.path,)))
        return ReferenceModel(
            model, load.qat, load.ctx, load.progress, load.kv_slots, products=_kernel_products(model.gguf, load.threads)
        )

    def load41(self, model, load, engram_cache_bytes):
        """The reference's V4.1 model with its products on the kernels; the file's pages are mapped where
        the whole file fits (`populate` maps every page, the Engram tables' too, which the store then
        reads from the page cache), unless the routed experts stream (as `load` does)."""
        from dwarfstar.backends.reference.v41.backend import ReferenceModel41

        if not load.stream:
            _map_pages(model.gguf, sum(path.stat().st_size for path in model.parts))
        products = _kernel_products(model.gguf, load.threads)
        return ReferenceModel41.from_file(model, engram_cache_bytes, load.ctx, products)

    def owns(self, model):
        from dwarfstar.backends.reference.weights import FLOAT32

        return BackendEntry.owns(self, model) and model.ops.products is not FLOAT32

    def attach_experts(self, backend, store):
        from dwarfstar.backends.cpu.products import kernel_expert
        from dwarfstar.experts.source import StreamingExperts

        backend.experts = StreamingExperts(store, kernel_expert)

    def draft_model(self, target, draft):
        from dwarfstar.backends.reference.model import ReferenceModel

        products = _kernel_products(draft.gguf, target.ops.products.threads)
        return ReferenceModel(draft, qat=target.qat, max_seq_len=target.max_seq_len, products=products)


def _map_pages(gguf: GGUFFile, nbytes: int) -> None:
    """Map the pages of a file of `nbytes` at load where it is at most POPULATE_SHARE of RAM: the products
    then read mapped pages (`GGUFFile.populate`)."""
    if nbytes <= POPULATE_SHARE * host_memory():
        gguf.populate()


def _kernel_products(gguf: GGUFFile, threads: int | None) -> Products:
    """The CPU kernels' products over `gguf` on `threads` threads, or the reference's float32 ones where
    the kernels cannot be built here (said once)."""
    from dwarfstar.backends.cpu.native import available
    from dwarfstar.backends.cpu.products import KernelProducts
    from dwarfstar.backends.reference.weights import FLOAT32

    if available() is not None:
        return FLOAT32
    return KernelProducts(gguf, threads)


class Triton(BackendEntry):
    name = "triton"
    model_class = ("dwarfstar.backends.triton.model", "TritonModel")
    fast_precision = True
    host_experts = True

    def available(self) -> bool:
        try:
            from dwarfstar.backends.triton import triton_available
        except ImportError:
            return False
        return triton_available()

    def runs_on_request(self) -> bool:
        from dwarfstar.backends.triton import interpreter_requested

        return self.available() or interpreter_requested()

    def missing(self, available: list[str]) -> str:
        return (
            f"backend 'triton' needs a CUDA or ROCm GPU (available: {', '.join(available)}); "
            "set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter on the CPU (very slow, for debugging)"
        )

    def load(self, model, load):
        from dwarfstar.backends.triton import load_backend

        return load_backend(
            model, qat=load.qat, precision=load.precision, max_seq_len=load.ctx, kv_slots=load.kv_slots,
            stream_experts=load.stream, cpu_moe=load.cpu_moe, threads=load.threads,
        )  # fmt: skip

    def load41(self, model, load, engram_cache_bytes):
        from dwarfstar.backends.triton import load_backend41

        return load_backend41(
            model, engram_cache_bytes, load.ctx, precision=load.precision, stream_experts=load.stream,
            cpu_moe=load.cpu_moe, threads=load.threads,
        )  # fmt: skip

    def usable_memory(self) -> int:
        import torch

        return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else host_memory()

    def free_device_memory(self) -> int | None:
        import torch

        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None

    def attach_experts(self, backend, store):
        from dwarfstar.backends.triton.streaming import TritonStreamedExperts

        backend.experts = TritonStreamedExperts(store, backend.device)

    def draft_model(self, target, draft):
        from dwarfstar.backends.triton.draft import draft_model

        return draft_model(target, draft)

    def vision_ops(self, args, tensors):
        from dwarfstar.backends.triton.vision import vision_ops

        return vision_ops(args, tensors)


class MLX(BackendEntry):
    name = "mlx"
    model_class = ("dwarfstar.backends.mlx.model", "MLXModel")
    mlx_arrays = True
    kv_slots = 1
    host_experts = True

    def available(self) -> bool:
        from dwarfstar.backends.mlx import mlx_available

        return mlx_available()

    def preferred(self, model_bytes: int = 0) -> bool:
        from dwarfstar.backends.mlx import metal_available

        return metal_available()  # MLX also runs on a Linux CPU, but there the reference is faster

    def load(self, model, load):
        from dwarfstar.backends.mlx import default_packing
        from dwarfstar.backends.mlx.model import MLXModel

        return MLXModel(
            model, qat=load.qat, packing=default_packing(), max_seq_len=load.ctx, routed_experts=not load.stream,
            kv_slots=load.kv_slots, cpu_moe=load.cpu_moe, threads=load.threads,
        )  # fmt: skip

    def load41(self, model, load, engram_cache_bytes):
        from dwarfstar.backends.mlx.v41.backend import MLXModel41

        return MLXModel41.from_file(
            model, engram_cache_bytes, load.ctx, routed_experts=not load.stream, cpu_moe=load.cpu_moe,
            threads=load.threads,
        )  # fmt: skip

    def usable_memory(self) -> int:
        import mlx.core as mx

        if mx.metal.is_available():
            return int(mx.metal.device_info()["max_recommended_working_set_size"])
        return host_memory()

    def settle(self, out, batch):
        import mlx.core as mx

        from dwarfstar.backends.mlx.storage import lazy_arrays

        mx.eval(out, *(a for seq in batch.seqs for a in lazy_arrays(seq.state)))  # the pass was only recorded

    def attach_experts(self, backend, store):
        from dwarfstar.backends.mlx.streaming import MLXStreamedExperts

        backend.experts = MLXStreamedExperts(store, backend.packing)

    def draft_model(self, target, draft):
        from dwarfstar.backends.mlx.model import MLXModel

        return MLXModel(draft, qat=target.qat, packing=target.packing, max_seq_len=target.max_seq_len)

    def vision_ops(self, args, tensors):
        from dwarfstar.backends.mlx.vision import MLXVisionOps

        return MLXVisionOps(args, tensors)


ENTRIES = {entry.name: entry for entry in (Reference(), Cpu(), Triton(), MLX())}
PREFERENCE = ("mlx", "triton", "cpu", "reference")  # what `auto` tries, in order


def backend_entry(name: str) -> BackendEntry:
    if name not in ENTRIES:
        raise DwarfStarError(f"unknown backend {name!r}; choose one of {', '.join(ENTRIES)}")
    return ENTRIES[name]


def available_backends() -> list[str]:
    return [name for name, entry in ENTRIES.items() if entry.available()]


def pick_backend(requested: str, model_bytes: int = 0) -> str:
    """The backend `requested` (a name, or `auto` for a file of `model_bytes`) runs on here; an error if
    it cannot run."""
    if requested == "auto":
        return next(name for name in PREFERENCE if ENTRIES[name].preferred(model_bytes))
    entry = backend_entry(requested)
    if not entry.runs_on_request():
        raise DwarfStarError(entry.missing(available_backends()))
    return requested


def entry_of(model: object) -> BackendEntry | None:
    """The entry of the backend that built `model` (a `Transformer`), None for another object."""
    return next((entry for entry in ENTRIES.values() if entry.owns(model)), None)
