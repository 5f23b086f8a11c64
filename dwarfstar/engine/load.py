"""Load what an `EngineSpec` describes (a model file on a compute backend, with its tokenizer):
`load_engine(spec)`, what the CLI, the server and the tests share. The file says which model family
it holds: a DeepSeek V4.1 file loads as one (`load_engine41`, text only); a command that runs DeepSeek
V4 only says so (`require_v4`).

The backend's name is looked up in `dwarfstar.backends.registry`, which says how it loads and what it
can do (`auto`: MLX on Apple silicon, Triton on a GPU, else the torch reference).

Precision: `exact` keeps every product in fp32; `fast` lets the Triton backend's prefill products use
bf16 operands with fp32 accumulation. No GPU run has shown `fast` to be accurate yet, so `exact` is
the default, and the backends without the notion (reference, MLX) refuse `fast`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.backends.protocol import Backend
from dwarfstar.backends.registry import BackendEntry, Load, backend_entry, pick_backend
from dwarfstar.engine.images import ImageEncoder
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.experts.attach import check_fits, streaming_store
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.file_v41 import FAMILY41, NOT_YET, ModelFile41, open_model41
from dwarfstar.model.loader import ModelFile, is_v41, open_model
from dwarfstar.model.vision import V41 as V41_ENCODER
from dwarfstar.model.vision import VISION_EXP
from dwarfstar.model.vision_file import FAMILY_NAMES, LM_VARIANT_KEY, VisionFile, open_vision
from dwarfstar.speculative.mtp_options import MTP41_REFUSAL, DSparkOptions
from dwarfstar.tokenizer.tokenizer import Tokenizer


@dataclass
class Engine:
    model: ModelFile | ModelFile41
    backend: Backend
    backend_name: str
    tokenizer: Tokenizer
    load_seconds: float
    experts: ExpertStore | None = None  # the routed-expert cache, with --ssd-streaming
    images: ImageEncoder | None = None  # the vision encoder, with --vision (engine/images.py)

    @property
    def entry(self) -> BackendEntry:
        """What the backend can do, its memory facts and hooks (`backends.registry`)."""
        return backend_entry(self.backend_name)

    @property
    def vision(self) -> bool:
        """Whether the engine reads images: a vision encoder is loaded (--vision)."""
        return self.images is not None


def spec_backend(spec: EngineSpec) -> str:
    """The backend `spec` runs on here, and whether it can take the spec's precision (before anything loads)."""
    name = pick_backend(spec.backend, spec.model.stat().st_size if spec.model.is_file() else 0)
    entry = backend_entry(name)
    if spec.precision == "fast" and not entry.fast_precision:
        raise DwarfStarError(f"--precision fast needs the triton backend; the {name} backend has no fast mode")
    if spec.cpu_moe is not None and spec.streaming is not None:
        raise DwarfStarError("--cpu-moe and --ssd-streaming both move the routed experts: use one")
    if spec.cpu_moe is not None and not entry.host_experts:
        raise DwarfStarError(
            f"--cpu-moe keeps routed experts on the CPU beside a GPU backend (triton, mlx); the {name} backend "
            "computes everything where it runs (for the CPU kernels everywhere: --backend cpu)"
        )
    return name


def load_engine(spec: EngineSpec, progress: Callable[[int, int], None] | None = None) -> Engine:
    """Open, validate and load what `spec` describes, in the family its file holds (V4.1:
    `load_engine41`); `progress(done, total)` follows the weights being read. The only way to an
    `Engine`: the command line builds the spec from its flags."""
    start = time.perf_counter()
    name = spec_backend(spec)
    entry = backend_entry(name)
    if is_v41(spec.model):
        return load_engine41(spec, name, progress)
    model = open_model(spec.model, spec.stage_layers())
    tokenizer = Tokenizer.from_gguf_metadata(model.gguf.metadata)
    streaming, steering = spec.streaming, spec.steering
    limit = spec.ctx or model.args.max_seq_len
    stream = streaming is not None  # the routed experts are not loaded: they stream from the file
    host_layers = spec.cpu_moe_layers(model.args.n_layers, model.layer_range)
    if not stream:  # too big a model is an error naming --ssd-streaming, before any weight loads
        check_fits(model, entry, limit, host_layers)
    direction = steering.read(model.args) if steering is not None else None  # a bad file fails before the weights load
    vision = open_encoder(spec.vision, model) if spec.vision is not None else None  # so does a bad encoder
    slots = spec.kv_slots or entry.kv_slots
    load = Load(
        spec.qat, spec.precision, spec.ctx, slots, stream, progress=progress, threads=spec.threads, cpu_moe=host_layers
    )
    impl = entry.load(model, load)
    images = None
    if vision is not None:
        entry.attach_image_biases(impl, vision.image_router_biases())
        images = ImageEncoder(vision, entry)
    experts = None
    if streaming is not None:
        experts = streaming_store(model, entry, limit, streaming)
        entry.attach_experts(impl, experts)
    if steering is not None:
        impl = steering.install(impl, direction)
    if spec.speculation is not None and spec.drafter is None and spec.dist is None:
        from dwarfstar.speculative.decode import check_drafter  # --dspark-strict: checked, not run

        check_drafter(spec.speculation, impl, model)
    if progress is not None and not entry.reports_progress:
        progress(1, 1)  # this backend reports no steps; still finish the bar
    return Engine(model, impl, name, tokenizer, time.perf_counter() - start, experts, images)


def load_engine41(spec: EngineSpec, name: str, progress: Callable[[int, int], None] | None = None) -> Engine:
    """A DeepSeek V4.1 engine on the backend `name` (a file, or a split set named by any part), reading images
    with `--vision` (V4.1 Flash's encoder), its routed experts streamed (`--ssd-streaming`) or some layers'
    on the CPU (`--cpu-moe`) as V4's, running the spec's layer slice only where it has one (its tensors
    alone read, `open_model41(path, layers)`, and run: `Model41.hold`), steered by a direction file."""
    start = time.perf_counter()
    if spec.speculation is not None and not isinstance(spec.speculation, DSparkOptions):
        raise DwarfStarError(MTP41_REFUSAL)
    entry = backend_entry(name)
    held = spec.stage_layers()  # a layer slice, or a pipeline stage's: of a split set, only its parts mapped
    model = open_model41(spec.model, held)
    experts = None
    try:
        tokenizer = Tokenizer.from_gguf_metadata(model.gguf.metadata)
        limit, stream = spec.ctx or model.args.max_seq_len, spec.streaming is not None
        host_layers = spec.cpu_moe_layers(model.args.n_layers, model.layer_range)
        if not stream:  # too big a model is an error naming --ssd-streaming, before any weight loads
            check_fits(model, entry, limit, host_layers)
        vision = open_encoder41(spec.vision, model) if spec.vision is not None else None  # before the weights
        steering = spec.steering
        direction = steering.read(model.args) if steering is not None else None  # so is a bad direction file
        slots = spec.kv_slots or entry.kv_slots
        load = Load(spec.qat, spec.precision, spec.ctx, slots, stream, progress, spec.threads, host_layers)
        impl = entry.load41(model, load, spec.engram_cache << 20)
        if spec.streaming is not None:
            experts = streaming_store(model, entry, limit, spec.streaming)
            entry.attach_experts(impl, experts)
        if held is not None:
            impl.hold(*held)
        if steering is not None:
            impl = steering.install(impl, direction)
        images = ImageEncoder(vision, entry) if vision is not None else None
        if spec.speculation is not None and spec.drafter is None:
            from dwarfstar.speculative.decode import check_drafter  # --dspark-strict: checked, not run

            check_drafter(spec.speculation, impl, model)
    except BaseException:
        if experts is not None:
            experts.close()
        model.close()
        raise
    if progress is not None:
        progress(1, 1)  # the weights are read as the layers first run
    return Engine(model, impl, name, tokenizer, time.perf_counter() - start, experts, images)


def open_encoder41(path: Path, model: ModelFile41) -> VisionFile:
    """A DeepSeek V4.1 model's vision encoder at `path`: V4.1 Flash's own (its layout, image budget and image
    token), writing rows as wide as the model's hidden size. Its images route by the biases the model's
    own file carries (`exp_probs_b_vl`), so the encoder carries none."""
    vision = open_vision(path)
    if vision.args.family != V41_ENCODER:
        raise DwarfStarError(
            f"{path} is a {FAMILY_NAMES[vision.args.family]} encoder; {model.path.name} is {FAMILY41}, which reads "
            f"images through V4.1 Flash's encoder (`dwarfstar convert HF_DIR --vision FILE` writes it)"
        )
    if vision.args.out_dim != model.args.dim:
        raise DwarfStarError(
            f"the vision encoder {path} writes rows {vision.args.out_dim} wide; {model.path.name}'s hidden size is "
            f"{model.args.dim}: give the encoder made for this model"
        )
    return vision


def require_v4(engine: Engine, command: str) -> None:
    """Refuse a V4.1 engine for a command that runs DeepSeek V4 only (`command`, as the user types it),
    naming what runs V4.1."""
    if isinstance(engine.model, ModelFile41):
        path = engine.model.path
        raise ModelFileError(f"{path} is {FAMILY41}, which loads {NOT_YET}; {command} runs DeepSeek V4 only")


def open_encoder(path: Path, model: ModelFile) -> VisionFile:
    """The vision encoder at `path`, checked against the language model it feeds: the model's own variant
    where its file names one (ds4's Vision-Exp language file says `vision-exp`; plain V4 Flash was not
    trained on images), its output width, and the image router biases (a bias of the model's expert
    count for each of its layers)."""
    vision = open_vision(path)
    args, lm = vision.args, model.args
    variant = model.gguf.metadata.get(LM_VARIANT_KEY)
    if variant is not None and variant != VISION_EXP:
        raise DwarfStarError(
            f"{model.path.name} is the {variant!r} checkpoint, which reads no images; the encoder {path} goes "
            "with DeepSeek V4 Flash Vision-Exp's language model"
        )
    if args.out_dim != lm.dim:
        raise DwarfStarError(
            f"the vision encoder {path} writes rows {args.out_dim} wide; {model.path.name}'s hidden size is "
            f"{lm.dim}: give the encoder made for this model"
        )
    biases = vision.image_router_biases()
    if args.family != VISION_EXP or not biases:
        raise DwarfStarError(
            f"{path} is a {args.family} encoder without the image router biases of a V4 Flash Vision-Exp "
            "sidecar: only Vision-Exp encoders run beside a V4 model for now"
        )
    wrong = [il for il, bias in biases.items() if bias.numel() != lm.n_routed_experts]
    if len(biases) != lm.n_layers or wrong:
        raise DwarfStarError(
            f"the vision encoder {path} carries image router biases for {len(biases)} layers of "
            f"{next(iter(biases.values())).numel()} experts; {model.path.name} has {lm.n_layers} layers of "
            f"{lm.n_routed_experts}: give the encoder made for this model"
        )
    return vision
