"""The flags several commands share, declared once.

A group of flags is a frozen dataclass; a command takes it by naming it as a parameter's type,

    @app.command()
    def serve(engine_flags: EngineFlags, loop_guard: LoopGuardFlags, ..., ctx: Ctx = 32768): ...

and `dwarfstar.commands.apps` gives the command the group's options (a group may hold groups) and
hands it their values as one object. Single flags whose default or meaning differs by command
(`--ctx`, `--power`, `--trace`, the dist flags of `bench dist`) are shared `Annotated` types. Each
option sits in one help panel: Model, Generation, Speculative, Memory, Distributed or Debug.

Nothing here imports torch: a group builds its options in a method, with its imports inside.
`EngineFlags` holds the engine's groups; its `spec` (or `ModelFlags.spec` with the options a command
builds itself) is the command's `EngineSpec`. `ChatFlags` is what `run` and `agent`, the in-process
chats, share: the engine, sampling, the loop guard and their own single flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from dwarfstar.distributed.dist_options import ROLES, SECRET_ENV, TRANSPORTS
from dwarfstar.engine.spec import BACKENDS, DEFAULT_ENGRAM_CACHE_MB, PRECISION_HELP, EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.efforts import MAX_THINK_LEVEL, think_level_error
from dwarfstar.speculative.mtp_options import ALIGNMENTS, MAX_DRAFT, MAX_MARGIN

if TYPE_CHECKING:
    from dwarfstar.console.chat import ThinkMode
    from dwarfstar.distributed.dist_options import DistOptions
    from dwarfstar.experts.attach import StreamingOptions
    from dwarfstar.sampling import SamplingParams
    from dwarfstar.session.loopguard import LoopGuard
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions
    from dwarfstar.steering.apply import SteeringOptions

T = TypeVar("T")
MODEL, GENERATION, SPECULATIVE, MEMORY, DISTRIBUTED, DEBUG = (
    "Model", "Generation", "Speculative", "Memory", "Distributed", "Debug"
)  # fmt: skip


def writable(path: Path | None) -> Path | None:
    """An output path, checked before any work starts: its folder is created if missing; a path that
    is a directory, or whose folder cannot be made or written, is a one-line error."""
    if path is None or str(path) == "-":
        return path
    if path.is_dir():
        raise DwarfStarError(f"{path} is a directory; give a file name")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DwarfStarError(f"cannot write {path}: {folder} is not a directory") from None
    except OSError as exc:
        raise DwarfStarError(f"cannot write {path}: cannot make {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise DwarfStarError(f"cannot write {path}: {folder} is not writable")
    return path


def comma_list(
    text: str, kind: Callable[[str], T], flag: str, what: str, error: type[DwarfStarError] = DwarfStarError
) -> list[T]:
    """The values of a comma-separated flag (`--drafts 1,2,3`), spaces ignored; a value `kind` refuses,
    or none at all, is an `error` naming the flag and `what` its values are."""
    try:
        values = [kind(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise error(f"{flag} must be comma-separated {what}, got {text!r}") from None
    if not values:
        raise error(f"{flag} is empty")
    return values


def output(*decls: str, help: str, panel: str | None = None) -> typer.models.OptionInfo:
    """A file option that a command writes: checked by `writable` while the command line is read."""
    return typer.Option(*decls, help=help, callback=writable, rich_help_panel=panel)


# -- single flags ------------------------------------------------------------------------------------------
Model = Annotated[
    Path | None,
    typer.Option(
        "-m", "--model", help="GGUF model (default: ./ds4flash.gguf if there, else the bundled nano model).",
        rich_help_panel=MODEL,
    ),
]  # fmt: skip
Backend = Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.", rich_help_panel=MODEL)]
Precision = Annotated[str, typer.Option(help=PRECISION_HELP, rich_help_panel=MODEL)]
CpuMoe = Annotated[
    str | None,
    typer.Option(
        "--cpu-moe", metavar="N|all",
        help="Keep the routed experts of the first N layers (or all) in RAM, computed on the CPU kernels "
        "beside a GPU backend (triton, mlx).",
        rich_help_panel=MODEL,
    ),
]  # fmt: skip
Threads = Annotated[
    int | None,
    typer.Option(min=1, help="CPU threads of the cpu backend's kernels (default: every core).", rich_help_panel=MODEL),
]
EngramCache = Annotated[
    int,
    typer.Option(
        "--engram-cache", metavar="MB", min=0,
        help="MB of Engram rows a DeepSeek V4.1 model keeps in memory (the tables stay on the disk).",
        rich_help_panel=MODEL,
    ),
]  # fmt: skip
Ctx = Annotated[int, typer.Option("-c", "--ctx", min=1, help="Context size in tokens.", rich_help_panel=MODEL)]
Power = Annotated[
    int,
    typer.Option(min=1, max=100, help="Keep the device about N% busy (sleeps; same output).", rich_help_panel=MODEL),
]
Trace = Annotated[Path | None, output(help="Append a session trace (prompts, cache, text) to FILE.", panel=DEBUG)]
Vision = Annotated[
    Path | None,
    typer.Option(
        help="A vision encoder GGUF beside the model (ds4's V4 Flash Vision-Exp sidecar), to read images.",
        rich_help_panel=MODEL,
    ),
]
NoQatRounding = Annotated[
    bool, typer.Option("--no-qat-rounding", help="Skip the FP8 KV / FP4 indexer rounding.", rich_help_panel=DEBUG)
]
Temp = Annotated[float, typer.Option(help="Sampling temperature, 0..100; 0 is greedy.", rich_help_panel=GENERATION)]
TopP = Annotated[float, typer.Option(help="Nucleus sampling, 0..1.", rich_help_panel=GENERATION)]
TopK = Annotated[
    int, typer.Option(min=0, help="Sample among the K most likely tokens; 0: no limit.", rich_help_panel=GENERATION)
]
MinP = Annotated[float, typer.Option(help="Keep tokens with p >= MIN_P * p_max.", rich_help_panel=GENERATION)]
Seed = Annotated[int | None, typer.Option(help="Sampling seed (default: random).", rich_help_panel=GENERATION)]
DEFAULT_REPLY_TOKENS = 50000  # ds4's `-n` (DS4_SURFACE §1.2); a reply also ends where the context does
Tokens = Annotated[
    int,
    typer.Option(
        "-n", "--tokens", min=1, help="Most tokens per reply (ds4's default; never past the context).",
        rich_help_panel=GENERATION,
    ),
]  # fmt: skip
Think = Annotated[bool, typer.Option("--think/--no-think", help="Reason before answering.", rich_help_panel=GENERATION)]
ThinkLevel = Annotated[
    int | None,
    typer.Option(
        "--think-level", min=0, max=MAX_THINK_LEVEL, metavar="N",
        help="DeepSeek V4.1 only: reasoning effort 1..100 (--think is 75, --think-max 100); 0: no thinking.",
        rich_help_panel=GENERATION,
    ),
]  # fmt: skip
DistBits = Annotated[
    int, typer.Option(help="Activation bits between stages: 32 (bit-exact), 16 or 8.", rich_help_panel=DISTRIBUTED)
]
DistPrefillChunk = Annotated[
    int, typer.Option(min=1, help="Tokens per route pass of a long prefill.", rich_help_panel=DISTRIBUTED)
]
DistPrefillWindow = Annotated[
    int, typer.Option(min=1, help="Prefill chunks in flight along the route.", rich_help_panel=DISTRIBUTED)
]


# -- groups ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFlags:
    """What to load and on which backend; `spec` adds the rest of the engine's description."""

    model: Model = None
    backend: Backend = "auto"
    precision: Precision = "exact"
    threads: Threads = None
    cpu_moe: CpuMoe = None
    engram_cache: EngramCache = DEFAULT_ENGRAM_CACHE_MB

    def path(self) -> Path:
        from dwarfstar.model.hub import resolve_model

        return resolve_model(self.model)

    def spec(self, **options: Any) -> EngineSpec:
        """The engine these flags name, with `options` (`EngineSpec`'s other fields: ctx, steering...)."""
        flags = dict(threads=self.threads, cpu_moe=self.cpu_moe, engram_cache=self.engram_cache)
        return EngineSpec(self.path(), self.backend, self.precision, **flags, **options)


@dataclass(frozen=True)
class SamplingFlags:
    temp: Temp = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.05
    seed: Seed = None
    think: Think = True
    think_max: Annotated[
        bool,
        typer.Option(
            "--think-max", help="Maximum reasoning effort (needs --ctx >= 393216).", rich_help_panel=GENERATION
        ),
    ] = False
    think_level: ThinkLevel = None

    def params(self) -> SamplingParams:
        from dwarfstar.sampling import SamplingParams

        return SamplingParams(self.temp, self.top_k, self.top_p, self.min_p, self.seed)

    def mode(self) -> ThinkMode:
        from dwarfstar.console.chat import ThinkMode

        if self.think_level is not None:
            if self.think_max or not self.think:
                raise DwarfStarError("--think-level sets the thinking mode: give it without --think-max or --no-think")
            return ThinkMode.THINK if self.think_level else ThinkMode.NOTHINK
        if self.think_max:
            return ThinkMode.THINK_MAX
        return ThinkMode.THINK if self.think else ThinkMode.NOTHINK

    def level(self, release: str) -> int | None:
        """`--think-level` 1..100 for a model of `release` (None without it, or at 0: no thinking); an
        error naming the release unless it has think levels (V4.1)."""
        if self.think_level is not None and (problem := think_level_error(release, "--think-level")):
            raise DwarfStarError(problem)
        return self.think_level or None


@dataclass(frozen=True)
class LoopGuardFlags:
    """The loop guard of `serve`, `run` and `agent` (dwarfstar/session/loopguard.py); a server's
    requests may turn it on or off with the field `loop_guard`."""

    loop_guard: Annotated[
        bool,
        typer.Option(
            "--loop-guard",
            help="End an output that repeats itself (finish: repetition) and catch repeated tool calls.",
            rich_help_panel=GENERATION,
        ),
    ] = False
    loop_guard_tools: Annotated[
        str,
        typer.Option(
            help="On the same tool call in 3 replies in a row: note (tell the model) or stop (end the turn).",
            rich_help_panel=GENERATION,
        ),
    ] = "note"

    def options(self) -> LoopGuard | None:
        """None without --loop-guard."""
        from dwarfstar.session.loopguard import LoopGuard

        return LoopGuard(tools=self.loop_guard_tools) if self.loop_guard else None


_SCALE_HELP = "-100..100; positive removes the direction, negative amplifies it"  # steering.direction.MAX_SCALE


@dataclass(frozen=True)
class SteeringFlags:
    dir_steering_file: Annotated[
        Path | None,
        typer.Option(help="Steering direction (ds4's raw f32 [n_layers][hidden]).", rich_help_panel=GENERATION),
    ] = None
    dir_steering_ffn: Annotated[
        float | None,
        typer.Option(help=f"FFN steering scale (default 1 with a file; {_SCALE_HELP}).", rich_help_panel=GENERATION),
    ] = None
    dir_steering_attn: Annotated[
        float | None,
        typer.Option(help=f"Attention steering scale (default 0; {_SCALE_HELP}).", rich_help_panel=GENERATION),
    ] = None

    def options(self) -> SteeringOptions | None:
        """None without a file; a scale without one is an error."""
        from dwarfstar.steering.apply import SteeringOptions
        from dwarfstar.steering.direction import SteeringError

        if self.dir_steering_file is None:
            if self.dir_steering_ffn is not None or self.dir_steering_attn is not None:
                raise SteeringError("--dir-steering-ffn and --dir-steering-attn need --dir-steering-file")
            return None
        return SteeringOptions(self.dir_steering_file, self.dir_steering_ffn, self.dir_steering_attn)


@dataclass(frozen=True)
class StreamingFlags:
    ssd_streaming: Annotated[
        bool,
        typer.Option(
            "--ssd-streaming", help="Keep routed experts on disk, in a cache of whole experts.", rich_help_panel=MEMORY
        ),
    ] = False
    ssd_streaming_cache_experts: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Expert cache budget, e.g. 32GB (default: 80% of usable memory minus the resident weights).",
            rich_help_panel=MEMORY,
        ),
    ] = None
    ssd_streaming_cold: Annotated[
        bool,
        typer.Option(
            "--ssd-streaming-cold",
            help="Start the expert cache empty, unseeded by the profile.",
            rich_help_panel=MEMORY,
        ),
    ] = False
    ssd_streaming_preload_experts: Annotated[
        int, typer.Option(min=0, metavar="N", help="Read the N hottest experts first.", rich_help_panel=MEMORY)
    ] = 0

    def options(self) -> StreamingOptions | None:
        """None without --ssd-streaming; its sub-flags without it are an error."""
        from dwarfstar.experts.attach import StreamingOptions

        if not self.ssd_streaming:
            if (
                self.ssd_streaming_cache_experts is not None
                or self.ssd_streaming_cold
                or self.ssd_streaming_preload_experts
            ):
                raise DwarfStarError("--ssd-streaming-cache-experts, -cold and -preload-experts need --ssd-streaming")
            return None
        return StreamingOptions(
            cache_experts=self.ssd_streaming_cache_experts,
            cold=self.ssd_streaming_cold,
            preload_experts=self.ssd_streaming_preload_experts,
        )


MTPFile = Annotated[
    Path | None,
    typer.Option(
        "--mtp",
        metavar="FILE",
        help="ds4's separate MTP GGUF (default: the model file's in-file nextn block; the bundled model's own).",
        rich_help_panel=SPECULATIVE,
    ),
]


@dataclass(frozen=True)
class SpeculativeFlags:
    mtp: MTPFile = None
    mtp_draft: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help=f"Speculate with the MTP block drafting N tokens a step (1..{MAX_DRAFT}).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = None
    mtp_margin: Annotated[
        float,
        typer.Option(
            help=f"Stop drafting at a draft whose top-1/top-2 logit gap is below this (0..{MAX_MARGIN:g}; 0: never).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = 0.0
    mtp_align: Annotated[
        str,
        typer.Option(
            help=f"{' or '.join(ALIGNMENTS)}; next: hidden state i with token i+1 (DeepSeek-V3 training, vLLM); "
            "same: with token i (ds4).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = "next"

    dspark: Annotated[
        Path | None,
        typer.Option(
            "--dspark",
            metavar="FILE",
            help="Speculate with DeepSeek's DSpark drafter: ds4's support GGUF for a Flash 0731 model, "
            "or 'bundled' for the bundled model's (reference, MLX and Triton backends).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = None
    dspark_confidence: Annotated[
        float,
        typer.Option(
            help="Cut each drafted block at its first row whose confidence is below this (0..1; 0: never).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = 0.0
    dspark_strict: Annotated[
        bool,
        typer.Option(
            help="Load and check the --dspark drafter but decode with the model alone, one token a step: "
            "the output of a run without --dspark, byte for byte (ds4's control for comparisons).",
            rich_help_panel=SPECULATIVE,
        ),
    ] = False

    def options(self) -> MTPOptions | DSparkOptions | None:
        from dwarfstar.speculative.mtp_options import MTPOptions, speculation_options

        mtp = MTPOptions.from_flags(self.mtp, self.mtp_draft, self.mtp_margin, self.mtp_align)
        return speculation_options(mtp, self.dspark, self.dspark_confidence, self.dspark_strict)


@dataclass(frozen=True)
class DistFlags:
    dist_role: Annotated[
        str | None,
        typer.Option(
            help=f"Run as one stage of a layer pipeline: {' or '.join(ROLES)} (torchrun sets it from RANK).",
            rich_help_panel=DISTRIBUTED,
        ),
    ] = None
    layers: Annotated[
        str | None,
        typer.Option(
            help="This stage's layers A:B, or A:output for the last (default: by bytes).", rich_help_panel=DISTRIBUTED
        ),
    ] = None
    dist_addr: Annotated[
        str | None,
        typer.Option(
            help="The coordinator's HOST:PORT; it listens there and nowhere else.", rich_help_panel=DISTRIBUTED
        ),
    ] = None
    dist_bind: Annotated[
        str | None,
        typer.Option(
            help="A worker's own listening address (default: the one reaching the coordinator).",
            rich_help_panel=DISTRIBUTED,
        ),
    ] = None
    dist_stages: Annotated[
        int,
        typer.Option(
            min=1, help="Stages in the even default split (torchrun: WORLD_SIZE).", rich_help_panel=DISTRIBUTED
        ),
    ] = 2
    dist_activation_bits: DistBits = 32
    dist_prefill_chunk: DistPrefillChunk = 4096
    dist_prefill_window: DistPrefillWindow = 1
    dist_timeout: Annotated[
        float,
        typer.Option(help="Seconds a stage may take per message before it is dropped.", rich_help_panel=DISTRIBUTED),
    ] = 600.0
    dist_secret: Annotated[
        str,
        typer.Option(
            envvar=SECRET_ENV, help="Shared secret every worker registration must prove.", rich_help_panel=DISTRIBUTED
        ),
    ] = ""
    dist_backend: Annotated[
        str,
        typer.Option(
            help=f"Transport: {', '.join(TRANSPORTS)} (GPUs: nccl; mlx: the mx.distributed ring, mlx.launch).",
            rich_help_panel=DISTRIBUTED,
        ),
    ] = "gloo"
    debug: Annotated[
        bool, typer.Option("--debug", help="Print per-hop telemetry of every route pass.", rich_help_panel=DEBUG)
    ] = False

    def options(self) -> DistOptions | None:
        """None for one process (no role given, none from torchrun's or mlx.launch's environment)."""
        from dwarfstar.distributed.dist_options import DistOptions

        opts = DistOptions.resolved(
            role=self.dist_role,
            layers=self.layers,
            addr=self.dist_addr,
            bind=self.dist_bind,
            stages=self.dist_stages,
            bits=self.dist_activation_bits,
            prefill_chunk=self.dist_prefill_chunk,
            prefill_window=self.dist_prefill_window,
            timeout_s=self.dist_timeout,
            wait_s=self.dist_timeout,
            secret=self.dist_secret,
            data_backend=self.dist_backend,
            debug=self.debug,
        )
        return None if opts.role is None else opts


@dataclass(frozen=True)
class EngineFlags:
    """Every flag of the engine `run`, `agent` and `serve` load but the context, whose default differs
    by command (`ChatFlags` adds --power and the QAT rounding for `run` and `agent`)."""

    model: ModelFlags
    steering: SteeringFlags
    streaming: StreamingFlags
    speculative: SpeculativeFlags
    dist: DistFlags

    def spec(self, **options: Any) -> EngineSpec:
        """The engine these flags describe, with `options` (`EngineSpec`'s ctx, qat, power, kv_slots)."""
        return self.model.spec(
            steering=self.steering.options(),
            streaming=self.streaming.options(),
            speculation=self.speculative.options(),
            dist=self.dist.options(),
            **options,
        )


@dataclass(frozen=True)
class ChatFlags:
    """The in-process chat of `run` and `agent`: the engine, sampling and the loop guard, with the reply
    budget, --power, the QAT rounding and --trace (the context is each command's own: its default differs)."""

    engine: EngineFlags
    sampling: SamplingFlags
    loop_guard: LoopGuardFlags
    tokens: Tokens = DEFAULT_REPLY_TOKENS
    power: Power = 100
    no_qat_rounding: NoQatRounding = False
    trace: Trace = None

    def spec(self, ctx: int, **options: Any) -> EngineSpec:
        """The engine to load, holding `ctx` tokens, with `options` (`EngineSpec`'s vision)."""
        return self.engine.spec(ctx=ctx, qat=not self.no_qat_rounding, power=self.power, **options)
