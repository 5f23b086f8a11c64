"""A cache of whole routed experts under a budget, filled from the GGUF with parallel `pread`s.

Each slot holds one expert's gate, up and down bytes exactly as the file stores them; the backend
turns them into its own arrays (`source.py`). A miss takes a free slot or the policy's victim and
reads the three slabs on a thread pool, so the k experts of a token load in parallel and the MoE
computes on the first while the others are still arriving. Reads go through `pread` on a second
descriptor (optionally `O_DIRECT`, so the page cache does not keep a second copy of what the cache
holds), never by faulting through the memory map.

The store's bookkeeping (which expert is in which slot, the pins, the policy) runs on the caller's
thread; the pool threads only fill slots that are already assigned.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from dwarfstar.errors import ModelFileError
from dwarfstar.experts.layout import ExpertLayout, ExpertPart, check_capacity
from dwarfstar.experts.policy import Policy

READ_THREADS = 16  # a Flash token's 6 experts per layer are 18 part reads; the disk wants many in flight
DIRECT_ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block
LATENCY_WINDOW = 100_000  # misses the latency percentiles cover


@dataclass(frozen=True)
class ExpertBytes:
    """One expert as the file stores it: its parts and a byte view of each, valid while pinned."""

    layer: int
    expert: int
    parts: tuple[ExpertPart, ...]
    data: tuple[np.ndarray, ...]
    fresh: bool = False  # just read from the file: the first `get` after its miss


@dataclass
class LayerCounts:
    """One layer's share of the cache's work: where the misses and the bytes come from."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.misses
        return self.hits / uses if uses else 0.0


@dataclass
class Telemetry:
    """What the cache did: the figures `run`'s summary, `--trace` and `/metrics` report."""

    n_layers: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    tokens: int = 0
    preloaded: int = 0
    evictions: int = 0
    stall_seconds: float = 0.0  # time the compute waited for a read
    read_seconds: float = 0.0  # summed duration of the reads themselves (they overlap)
    busy_seconds: float = 0.0  # wall time with at least one read in flight: bytes_read / this is the GB/s
    # per miss, request to bytes in the slot; the last LATENCY_WINDOW, so a server's memory stays bounded
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    layers: list[LayerCounts] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = [LayerCounts() for _ in range(self.n_layers)]

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.misses
        return self.hits / uses if uses else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.busy_seconds / 1e9 if self.busy_seconds else 0.0

    def hit(self, layer: int) -> None:
        self.hits += 1
        self.layers[layer].hits += 1

    def miss(self, layer: int) -> None:
        self.misses += 1
        self.layers[layer].misses += 1

    def read(self, layer: int, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.layers[layer].bytes_read += nbytes

    def per_layer(self) -> list[dict[str, float | int]]:
        """Each layer's hit rate, hits, misses and bytes read (per token too)."""
        tokens = max(1, self.tokens)
        return [
            {
                "layer": il,
                "hit_rate": round(c.hit_rate, 4),
                "hits": c.hits,
                "misses": c.misses,
                "bytes_read": c.bytes_read,
                "bytes_per_token": round(c.bytes_read / tokens),
            }
            for il, c in enumerate(self.layers)
        ]

    def summary(self, resident: int, capacity: int) -> dict:
        lat = np.array(self.latencies) if self.latencies else np.zeros(1)
        return {
            "hit_rate": round(self.hit_rate, 4),
            "hits": self.hits,
            "misses": self.misses,
            "bytes_read": self.bytes_read,
            "bytes_per_token": round(self.bytes_read / self.tokens) if self.tokens else 0,
            "read_gbps": round(self.read_gbps, 3),
            "evictions": self.evictions,
            "miss_latency_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
            "miss_latency_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
            "stall_seconds": round(self.stall_seconds, 4),
            "resident_experts": resident,
            "capacity_experts": capacity,
            "per_layer": self.per_layer(),
        }


def round_up(n: int, a: int) -> int:
    return -(-n // a) * a


class ExpertCache:
    """The cache's bookkeeping without any bytes: which expert holds which slot, the pins, the
    protection and the policy. The policy simulator replays traces through it alone; `ExpertStore`
    adds the slots' memory and the reads."""

    def __init__(self, n_layers: int, n_experts: int, n_active: int, capacity: int, policy: Policy) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self.capacity = check_capacity(capacity, n_active, n_layers * n_experts)
        self.policy = policy
        self.where: dict[int, int] = {}  # key -> slot
        self.n_slots = 0
        self.free: list[int] = []
        self.pinned: set[int] = set()  # in use by the MoE call now: never evicted
        self.protected: set[int] = set()  # used by the current step: evicted only when nothing else can be
        self.stats = Telemetry(n_layers)

    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e

    def begin_step(self, n_tokens: int) -> None:
        """A new forward call starts: the previous one's experts are no longer protected."""
        self.protected.clear()
        self.pinned.clear()
        self.stats.tokens += n_tokens

    def request(self, layer: int, e: int) -> None:
        """Make expert e of `layer` resident (starting its read on a miss) and pin it."""
        key = self.key(layer, e)
        self.policy.used(key)
        self.pinned.add(key)
        self.protected.add(key)
        if key in self.where:
            self.stats.hit(layer)
            return
        self.stats.miss(layer)
        self.where[key] = self._take_slot()
        self._load(layer, e, self.where[key])

    def get(self, layer: int, e: int) -> ExpertBytes | None:
        """The requested expert (the bookkeeping alone has no bytes)."""
        return None

    def unpin(self, layer: int, e: int) -> None:
        self.pinned.discard(self.key(layer, e))

    def preload(self, keys: Iterable[int]) -> int:
        """Load experts before any token (a profile's hot set, hottest first); returns how many came in."""
        loaded = []
        for key in keys:
            if len(self.where) >= self.capacity:
                break
            if key not in self.where:
                layer, e = divmod(key, self.n_experts)
                self.where[key] = self._take_slot()
                self._load(layer, e, self.where[key])
                loaded.append(key)
        for key in loaded:
            self.get(*divmod(key, self.n_experts))
            self.policy.preloaded(key)
        self.stats.preloaded += len(loaded)
        return len(loaded)

    def resident(self, layer: int, e: int) -> bool:
        return self.key(layer, e) in self.where

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        if self.n_slots < self.capacity:
            self.n_slots += 1
            self._new_slot()
            return self.n_slots - 1
        victim = self.policy.victim(self.where.keys(), self.pinned, self.protected)
        if victim in self.pinned:
            raise RuntimeError(f"policy {self.policy.name} chose the pinned expert {victim}")
        self.policy.evicted(victim)
        self.stats.evictions += 1
        return self.where.pop(victim)

    def _new_slot(self) -> None:
        """Room for one more expert (bookkeeping only: nothing)."""

    def _load(self, layer: int, e: int, slot: int) -> None:
        """Start filling `slot` with the expert (bookkeeping only: nothing to read)."""


class ExpertStore(ExpertCache):
    def __init__(
        self,
        layout: ExpertLayout,
        capacity: int,
        policy: Policy,
        threads: int = READ_THREADS,
        direct: bool = False,
    ) -> None:
        super().__init__(layout.n_layers, layout.n_experts, layout.n_active, capacity, policy)
        self.layout = layout
        self.align = DIRECT_ALIGN if direct else 1
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            self.fd = os.open(layout.path, flags)
        except OSError as e:
            raise ModelFileError(f"{layout.path}: cannot open for expert streaming: {e.strerror or e}") from None
        # a slot holds any layer's expert: per part, the largest slab plus the alignment slack
        self.part_capacity = [
            round_up(max(layout.parts[il][i].nbytes for il in range(layout.n_layers)), self.align) + self.align
            for i in range(len(layout.parts[0]))
        ]
        self.slot_bytes = sum(self.part_capacity)
        self.slot_maps: list[mmap.mmap] = []
        self.slots: list[np.ndarray] = []  # byte views of slot_maps
        self.pending: dict[int, list[Future]] = {}
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="expert-read")
        self._in_flight, self._busy_since, self._busy_lock = 0, 0.0, threading.Lock()

    def begin_step(self, n_tokens: int) -> None:
        super().begin_step(n_tokens)
        self.pinned.update(self.pending)  # a read still in flight keeps its slot

    def get(self, layer: int, e: int) -> ExpertBytes:
        """The requested expert's bytes, waiting for its read if it is still in flight."""
        key = self.key(layer, e)
        futures = self.pending.pop(key, None)
        if futures is not None:
            start = time.perf_counter()
            wait(futures)  # every part, also after a failure: no read may still write into a freed slot
            self.stats.stall_seconds += time.perf_counter() - start
            try:
                self._record(layer, [f.result() for f in futures])
            except BaseException:
                self._drop(key)
                raise
        return self._view(layer, e, self.where[key], fresh=futures is not None)

    def release_bytes(self, layer: int, e: int) -> None:
        """The backend keeps its own copy of this resident expert and never reads these bytes again
        (its hits use that copy): the slot's pages go back to the OS until a later miss refills the
        slot, so a device cache does not also hold the budget in RAM."""
        self.slot_maps[self.where[self.key(layer, e)]].madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)

    # -- slots and reads -----------------------------------------------------------------------------------
    def _new_slot(self) -> None:
        # anonymous maps are page-aligned, as O_DIRECT needs; slots are allocated as the cache fills
        # private: MADV_DONTNEED frees its pages (a shared anonymous map would keep them)
        self.slot_maps.append(mmap.mmap(-1, self.slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        self.slots.append(np.frombuffer(self.slot_maps[-1], dtype=np.uint8))

    def _load(self, layer: int, e: int, slot: int) -> None:
        """Read the expert's three parts at once: a token's k experts are 3k reads in flight."""
        submitted = time.perf_counter()
        self.pending[self.key(layer, e)] = [
            self.pool.submit(self._read_part, layer, e, slot, span, submitted) for span in self._part_spans(layer, e)
        ]

    def _drop(self, key: int) -> None:
        """A failed read leaves no half-filled expert behind."""
        self.free.append(self.where.pop(key))
        self.pinned.discard(key)
        self.protected.discard(key)
        self.policy.evicted(key)

    def _part_spans(self, layer: int, e: int) -> list[tuple[ExpertPart, int, int, int]]:
        """Per part: (part, where it starts in the slot, aligned file offset, aligned length)."""
        spans, base = [], 0
        for part, room in zip(self.layout.expert(layer, e), self.part_capacity, strict=True):
            start = part.offset // self.align * self.align
            length = round_up(part.offset + part.nbytes, self.align) - start
            spans.append((part, base, start, length))
            base += room
        return spans

    def _record(self, layer: int, reads: list[tuple[float, float, int]]) -> None:
        """One expert's part reads: its miss latency is the last part's."""
        self.stats.latencies.append(max(latency for latency, _, _ in reads))
        self.stats.read_seconds += sum(seconds for _, seconds, _ in reads)
        self.stats.read(layer, sum(nbytes for _, _, nbytes in reads))

    def _read_part(
        self, layer: int, e: int, slot: int, span: tuple[ExpertPart, int, int, int], submitted: float
    ) -> tuple[float, float, int]:
        """Fill one part of the slot (on a pool thread): (latency since the request, read time, bytes)."""
        part, base, start, length = span
        buf = memoryview(self.slots[slot])
        started = self._read_starts()
        try:
            self._fill(layer, e, part, buf, base, start, length)
        finally:
            end = self._read_ends()
        return end - submitted, end - started, part.nbytes

    # reads overlap: the GB/s the store achieves is its bytes over the wall time any read was in flight
    def _read_starts(self) -> float:
        now = time.perf_counter()
        with self._busy_lock:
            if self._in_flight == 0:
                self._busy_since = now
            self._in_flight += 1
        return now

    def _read_ends(self) -> float:
        now = time.perf_counter()
        with self._busy_lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.stats.busy_seconds += now - self._busy_since
        return now

    def _fill(self, layer: int, e: int, part: ExpertPart, buf: memoryview, base: int, start: int, length: int) -> None:
        """pread the part's aligned span into the slot at `base`, to the end of its slab."""
        need = part.offset + part.nbytes - start  # the aligned tail past the slab may lie past EOF
        done = 0
        while done < need:
            try:
                n = os.preadv(self.fd, [buf[base + done : base + length]], start + done)
            except OSError as err:
                raise ModelFileError(
                    f"{self.layout.path}: cannot read expert {e} of layer {layer} ({part.name}): {err.strerror or err}"
                ) from None
            if n == 0:
                raise ModelFileError(
                    f"{self.layout.path}: file truncated inside expert {e} of layer {layer} ({part.name}): "
                    f"{start + done} of the {part.offset + part.nbytes} bytes it needs are there"
                )
            done += n

    def _view(self, layer: int, e: int, slot: int, fresh: bool) -> ExpertBytes:
        buf = self.slots[slot]
        parts, data = [], []
        for part, base, start, _ in self._part_spans(layer, e):
            at = base + part.offset - start
            parts.append(part)
            data.append(buf[at : at + part.nbytes])
        return ExpertBytes(layer, e, tuple(parts), tuple(data), fresh)
