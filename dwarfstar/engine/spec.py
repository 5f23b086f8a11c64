"""`EngineSpec`: what to load and how, in one frozen description; `dwarfstar.engine.load.load_engine(spec)`
loads it. The command line builds it once from its flags (dwarfstar/commands/flags.py); tests and
tools build it directly: `EngineSpec(path, "reference", ctx=4096)`.

This module imports nothing heavy (the option types only for annotations), so the command line can
name the backends and precisions without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dwarfstar.backends.registry import ENTRIES
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.distributed.dist_options import DistOptions
    from dwarfstar.experts.attach import StreamingOptions
    from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions
    from dwarfstar.steering.apply import SteeringOptions

BACKENDS = ("auto", *ENTRIES)
PRECISIONS = ("exact", "fast")
DEFAULT_ENGRAM_CACHE_MB = 1024
PRECISION_HELP = (
    "exact: fp32 products (reference and triton: a decoded row has the same bits whatever rows share its "
    "step, up to 256); fast (triton only): bf16 operands in prefill products and in decode steps of over 8 "
    "rows, int8 or fp16 activations in the routed experts' decode loops, so a row's last bits follow its "
    "company (no GPU run has shown fast to be accurate yet)."
)


@dataclass(frozen=True)
class EngineSpec:
    model: Path  # a GGUF file, or any part of a split set
    backend: str = "auto"  # one of BACKENDS; `auto`: MLX on Apple, Triton on a GPU, cpu for big files, else reference
    precision: str = "exact"  # one of PRECISIONS
    qat: bool = True  # the FP8 KV / FP4 indexer rounding of the QAT-trained checkpoints
    ctx: int | None = None  # the longest sequence, in tokens (default and most: the model's)
    kv_slots: int | None = None  # sequences to a KV-cache block (default: 4, and 1 on MLX)
    layers: tuple[int, int] | None = None  # load only these layers, (first, end); default: `dist`'s slice
    streaming: StreamingOptions | None = None  # routed experts read from the file into a cache
    steering: SteeringOptions | None = None  # a direction file applied in every layer
    speculation: MTPOptions | DSparkOptions | None = None  # a drafter for speculative decoding
    dist: DistOptions | None = None  # this process as one stage of a layer pipeline
    power: int = 100  # keep the device about this % busy (`dwarfstar.session.throttle`, applied by the caller)
    threads: int | None = None  # CPU threads of the cpu backend's kernels (default: every core)
    cpu_moe: str | None = None  # "N" or "all": the first N layers' routed experts on the CPU kernels (GPU backends)
    vision: Path | None = None  # a vision encoder GGUF (ds4's Vision-Exp sidecar): images in the prompt
    engram_cache: int = DEFAULT_ENGRAM_CACHE_MB  # MB of Engram rows a V4.1 model keeps in memory (`EngramStore`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        if self.vision is not None:
            object.__setattr__(self, "vision", Path(self.vision))
        if self.backend not in BACKENDS:
            raise DwarfStarError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.precision not in PRECISIONS:
            raise DwarfStarError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.ctx is not None and self.ctx < 1:
            raise DwarfStarError(f"the context must be at least 1 token, got {self.ctx}")
        if self.kv_slots is not None and self.kv_slots < 1:
            raise DwarfStarError(f"a KV-cache block holds at least 1 sequence, got {self.kv_slots}")
        if self.cpu_moe is not None and self.cpu_moe != "all" and not self.cpu_moe.isdigit():
            raise DwarfStarError(f"--cpu-moe takes a layer count or 'all', got {self.cpu_moe!r}")
        if self.threads is not None and self.threads < 1:
            raise DwarfStarError(f"--threads must be at least 1, got {self.threads}")
        if self.engram_cache < 0:
            raise DwarfStarError(f"--engram-cache takes MB, 0 or more, got {self.engram_cache}")
        if not 1 <= self.power <= 100:
            raise DwarfStarError(f"--power must be 1..100, got {self.power}")

    def cpu_moe_layers(self, n_layers: int, held: range | None = None) -> range:
        """The layers whose routed experts `--cpu-moe` keeps on the CPU: the first N, or all; of them, those
        a pipeline stage holding `held` loads."""
        if self.cpu_moe is None:
            return range(0)
        stop = n_layers if self.cpu_moe == "all" else min(int(self.cpu_moe), n_layers)
        held = range(n_layers) if held is None else held
        return range(held.start, max(held.start, min(stop, held.stop)))

    @property
    def drafter(self) -> MTPOptions | DSparkOptions | None:
        """The drafter decoding speculates with: `speculation`, but none under `--dspark-strict` (whose
        drafter `load_engine` checks and decoding leaves alone)."""
        return self.speculation if self.speculation is not None and self.speculation.drafts else None

    def stage_layers(self) -> tuple[int, int] | None:
        """The layers to load: `layers`, else this process's slice of the pipeline, else all (None)."""
        if self.layers is not None or self.dist is None:
            return self.layers
        return self.dist.stage_layers(self.model)
