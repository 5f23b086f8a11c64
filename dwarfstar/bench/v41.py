"""The DeepSeek V4.1 bench of `dwarfstar bench v41` (issue 33): speed, resident memory and Engram reads at
several Engram cache budgets, on one model file.

Each budget loads the model afresh with that `--engram-cache` (`run_budget`'s `load`: the command's is
`load_engine`, as `dwarfstar run` loads), prefills the first tokens of a text (tokenized raw, no
template) and decodes greedy tokens with EOS masked, as `dwarfstar bench` does for V4 (or, `follow_text`,
the text's next tokens: a random-weight model's greedy tokens make n-grams no text has, so their Engram
rows are never in the cache). A budget reports:

* prefill and decode tok/s, and the load's seconds (the reference reads its weights as the layers first
  run, so the prefill pays for them);
* resident memory (Linux /proc/self/status): after the load, at the run's peak (VmHWM, restarted before
  the load through /proc/self/clear_refs) and after the decode; each split into anonymous memory (the
  backend's own copies: the reference's float32 weights, the KV, the Engram cache) and file pages (the
  model file's mapped pages, which the kernel may drop under pressure);
* the Engram store's telemetry (`EngramStore.take_telemetry`), for the prefill and the decode apart:
  rows used per token (24 per Engram layer), rows read from the file per token (misses, a prompt's
  read-ahead included), bytes read, the hit rate (`BudgetRun.hit_rate`: the uses that waited for no
  read of their own), positional reads and their latency p50/p99.

`cold` drops the model file's pages from the page cache before each budget (POSIX_FADV_DONTNEED), so the
weights and the Engram rows come from the disk; otherwise a budget may find the pages an earlier one read.
Rows of a table written as holes (`synth --preset v41-shaped`) never touch the disk: they read as zeros
from the kernel, which is a read latency of the page cache path, not of an SSD.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dwarfstar.backends.protocol import Backend
from dwarfstar.bench.frontier import greedy_choice, read_bench_tokens
from dwarfstar.engram.hashing import COLUMNS
from dwarfstar.engram.store import EngramStore
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.replay import drop_page_cache
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.session.session import Session

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Resident:
    """This process's resident bytes (VmRSS, VmHWM: the peak since the last restart), anonymous
    (RssAnon) and mapped from files (RssFile)."""

    now: int
    peak: int
    anon: int
    file: int


def resident() -> Resident | None:
    """This process's resident memory, where /proc has it (None elsewhere)."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    kib = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines if ":" in line) if "kB" in v}
    return Resident(kib["VmRSS"], kib["VmHWM"], kib.get("RssAnon", 0), kib.get("RssFile", 0))


def restart_peak() -> None:
    """Start VmHWM again from the resident memory now (Linux 4.0 and later; elsewhere nothing)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


@dataclass(frozen=True)
class FileFacts:
    """The model file (or split set): its size, the disk it takes (a table written as holes takes none), the weights a
    backend loads, the Engram tables' bytes and rows; and the machine's memory."""

    path: str
    apparent_bytes: int
    on_disk_bytes: int
    weight_bytes: int
    engram_bytes: int
    engram_rows: int
    engram_layers: int
    ram_bytes: int


def file_facts(model: ModelFile41, ram_bytes: int) -> FileFacts:
    """The facts of `model`'s files (of a split set, its parts summed)."""
    stats = [path.stat() for path in model.parts]
    return FileFacts(
        str(model.path),
        sum(stat.st_size for stat in stats),
        sum(stat.st_blocks for stat in stats) * 512,
        model.resident_bytes,
        model.engram_bytes,
        sum(extent.rows for extent in model.engram.values()),
        len(model.engram),
        ram_bytes,
    )


@dataclass(frozen=True)
class BudgetRun:
    """One budget's figures (see the module docstring); `engram` holds each phase's store telemetry."""

    budget_mb: int
    load_seconds: float
    prompt_tokens: int
    prefill_seconds: float
    gen_tokens: int
    gen_seconds: float
    loaded: Resident | None
    end: Resident | None
    peak_bytes: int | None
    engram: dict[str, dict[str, float | int]]
    rows_per_token: int  # rows a token uses: 24 per Engram layer
    generated: tuple[int, ...]  # the greedy choice (EOS masked) at each decode step

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_seconds

    def tokens(self, phase: str) -> int:
        return self.prompt_tokens if phase == "prefill" else self.gen_tokens

    def hit_rate(self, phase: str) -> float:
        """The share of the phase's row uses that waited for no read of their own: found in the cache (read
        ahead, or used before), or repeated within one lookup (the store's own `hit_rate` counts a row
        read ahead and then used as a miss and a hit)."""
        stats = self.engram[phase]
        uses = self.tokens(phase) * self.rows_per_token
        return 1 - (int(stats["misses"]) - int(stats["prefetched"])) / uses


@dataclass(frozen=True)
class Loaded:
    """A V4.1 model loaded with one Engram cache budget, as the bench drives it; `close` lets it go."""

    backend: Backend
    store: EngramStore
    tokenize: Callable[[str], list[int]]
    eos: int
    load_seconds: float
    close: Callable[[], None]


def run_budget(
    load: Callable[[int, int], Loaded],
    budget_mb: int,
    text: str,
    prompt_tokens: int,
    gen_tokens: int,
    cold: Path | None = None,
    follow_text: bool = False,
) -> BudgetRun:
    """`load(budget_mb, ctx)` the model, prefill `prompt_tokens` tokens of `text`, decode `gen_tokens` tokens:
    greedy (EOS masked), or with `follow_text` the text's next ones (so the decoded n-grams, and the Engram
    rows they use, are the text's, whatever a random-weight model would choose). `cold`: the model file,
    whose pages leave the page cache first. `generated` holds the greedy choice at each step either way."""
    if cold is not None:
        drop_page_cache(str(cold))
    gc.collect()  # the previous budget's model is gone before the peak restarts
    restart_peak()
    ctx = prompt_tokens + gen_tokens + 1
    model = load(budget_mb, ctx)
    store = model.store
    try:
        needed = prompt_tokens + gen_tokens * follow_text
        tokens = read_bench_tokens(model.tokenize, text, needed)
        if len(tokens) < needed:
            raise DwarfStarError(f"the text has {len(tokens)} tokens; the bench reads {needed}")
        loaded = resident()
        session = Session(model.backend, ctx=ctx, chunk=prompt_tokens)
        store.take_telemetry()
        start = time.perf_counter()
        session.prefill(tokens[:prompt_tokens])
        prefill_seconds = time.perf_counter() - start
        prefill = store.take_telemetry()
        choices: list[int] = []
        start = time.perf_counter()
        for step in range(gen_tokens):
            choices.append(greedy_choice(session, model.eos))
            session.decode(tokens[prompt_tokens + step] if follow_text else choices[-1])
        gen_seconds = time.perf_counter() - start
        decode = store.take_telemetry()
        end = resident()
        return BudgetRun(
            budget_mb,
            model.load_seconds,
            prompt_tokens,
            prefill_seconds,
            gen_tokens,
            gen_seconds,
            loaded,
            end,
            None if end is None else end.peak,
            {"prefill": prefill, "decode": decode},
            COLUMNS * len(store.extents),
            tuple(choices),
        )
    finally:
        model.close()


def as_dict(facts: FileFacts, runs: list[BudgetRun]) -> dict:
    """The report as one JSON-ready object."""
    rows = [
        {
            **asdict(run),
            "prefill_tps": run.prefill_tps,
            "gen_tps": run.gen_tps,
            "hit_rate": {phase: run.hit_rate(phase) for phase in PHASES},
        }
        for run in runs
    ]
    return {"file": asdict(facts), "budgets": rows, "same_tokens": len({run.generated for run in runs}) <= 1}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _memory(r: Resident | None) -> str:
    return "n/a" if r is None else f"{_gib(r.now)} (anon {_gib(r.anon)}, file pages {_gib(r.file)})"


def format_report(facts: FileFacts, runs: list[BudgetRun]) -> str:
    """The report as text: the file, then each budget's speed, memory and Engram reads."""
    lines = [
        f"{facts.path}: {_gib(facts.apparent_bytes)} ({_gib(facts.on_disk_bytes)} on disk); weights "
        f"{_gib(facts.weight_bytes)}, Engram tables {_gib(facts.engram_bytes)} ({facts.engram_rows:,} rows in "
        f"{facts.engram_layers} layers); RAM {_gib(facts.ram_bytes)}"
    ]
    for run in runs:
        share = min(1.0, (run.budget_mb << 20) / max(1, facts.engram_bytes))
        lines += [
            f"--engram-cache {run.budget_mb} MB ({share:.2%} of the tables): load {run.load_seconds:.1f} s, "
            f"prefill {run.prompt_tokens} tok at {run.prefill_tps:.3f} tok/s, "
            f"decode {run.gen_tokens} tok at {run.gen_tps:.3f} tok/s",
            f"  resident: loaded {_memory(run.loaded)}; after decode {_memory(run.end)}; peak "
            + ("n/a" if run.peak_bytes is None else f"{_gib(run.peak_bytes)}"),
        ]
        for phase in PHASES:
            stats, n = run.engram[phase], run.tokens(phase)
            lines.append(
                f"  engram {phase}: {run.rows_per_token} rows used/token, {stats['misses'] / n:.1f} read/token "
                f"({stats['prefetched']} read ahead), {stats['bytes_read'] / n / 1e3:.1f} kB/token, hit rate "
                f"{run.hit_rate(phase):.2%}, {stats['reads']} reads p50 {stats['read_latency_p50_ms']:.3f} ms "
                f"p99 {stats['read_latency_p99_ms']:.3f} ms, {stats['read_gbps']} GB/s, "
                f"{stats['resident_rows']:,}/{stats['capacity_rows']:,} rows cached"
            )
    same = len({run.generated for run in runs}) <= 1
    lines.append(f"greedy choices {'the same' if same else 'DIFFER'} at every budget: {list(runs[0].generated)}")
    return "\n".join(lines)


def machine_note() -> str:
    """What else ran: the CPUs and the load average when the bench ended."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
