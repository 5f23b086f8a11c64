"""Server settings: what `dwarfstar serve` options set, in one place the other modules read. Nothing
heavy is imported at the top: the command line reads the names here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dwarfstar.backends.registry import BackendEntry, host_memory
from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions

if TYPE_CHECKING:
    from dwarfstar.prompt.render_options import RenderOptions
    from dwarfstar.session.loopguard import LoopGuard

TEMPLATES = ("ds4", "official")  # ds4's server layout, or the official encoder's
API_KEY_ENV = "DWARFSTAR_API_KEY"  # where `dwarfstar serve` also reads --api-key from


HOST_SHARE = 4  # of physical memory for live sessions: the mapped weights and the page cache need most
DEVICE_SHARE = 2  # of the device memory left free once the weights are loaded


def session_memory_budget(backend: BackendEntry) -> int:
    """Bytes the live sessions may hold when `--kv-memory-mb` is not given, so a server under many
    conversations gives idle ones up (to the disk cache) instead of growing until the machine swaps
    or the device runs out: half the free device memory for a backend whose states live on a device
    (Triton on a GPU), and a quarter of physical memory for the CPU and unified-memory backends."""
    free = backend.free_device_memory()
    return free // DEVICE_SHARE if free is not None else host_memory() // HOST_SHARE


@dataclass(frozen=True)
class ServerConfig:
    ctx: int = 32768
    api_key: str | None = None  # None: no authentication
    cors: bool = False
    think_by_default: bool = True  # `--nothink` turns it off; requests still choose per call
    think_level: int | None = None  # `--think-level` (V4.1 only): a thinking request's level when it names none
    # ds4's server layout keeps KV files and exact DSML replay compatible with ds4; "official"
    # renders what the official encoder writes.
    template: str = "ds4"
    max_sessions: int = 4  # live KV sessions (each with its own state), and so concurrent requests
    # byte budget of the live sessions; None: derived from the machine (session_memory_budget);
    # 0: only max_sessions limits them
    kv_memory_mb: int | None = None
    max_queue: int = 32  # requests waiting for a session; one more is answered 429
    prefill_chunk: int = 4096
    keepalive_seconds: float = 5.0  # SSE comment this often while nothing else is sent
    tool_memory_ids: int = 100_000  # tool-call ids whose sampled DSML is kept for exact replay
    trace: Path | None = None
    kv_disk_dir: Path | None = None
    kv_disk_space_mb: int = 4096
    kv_cache_min_tokens: int = 512  # shorter states are not worth a file
    model_aliases: tuple[str, ...] = field(default=())  # extra accepted `model` names, fnmatch patterns
    mtp: MTPOptions | DSparkOptions | None = None  # speculation in the batched decode (--mtp, --dspark)
    loop_guard: LoopGuard | None = None  # --loop-guard: every request's default (session/loopguard.py)
    tool_guard: bool = True  # --tool-guard: every request's default (prompt/dsml_guard.py)
    allow_image_urls: bool = False  # --allow-image-urls: fetch http(s) image URLs (serving/images.py)

    @property
    def render_options(self) -> RenderOptions:
        from dwarfstar.prompt.render_options import DS4, OFFICIAL

        return {"ds4": DS4, "official": OFFICIAL}[self.template]
