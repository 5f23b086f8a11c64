"""Engram table rows read from the model file on demand, under a byte budget (issue 33, `--engram-cache`).

V4.1 Flash's two Engram tables hold 384 million rows each, 188.8 GiB of the Q2 file: they stay on the
disk. Each token looks up 24 rows per Engram layer (`rows.py` has a row's bytes); the store reads
them with positional reads on its own descriptors, never through the memory map, so the table's
pages are never made resident by the loader or by a lookup. Rows read are kept in a cache of
fixed-size slots, `cache_bytes` in all, evicted by the clock (second-chance) policy; the rows of one
lookup are read together on a thread pool, with neighbours that lie within a page of each other
merged into one read. `prefetch` reads a prompt's rows on a background thread before its prefill
needs them. `telemetry` reports hits, misses, bytes read, read rate and read latency;
`take_telemetry` also counts from zero again.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dwarfstar.engram.hashing import EngramHash
from dwarfstar.engram.rows import ROW_BYTES, dequantize
from dwarfstar.errors import DwarfStarError, ModelFileError

READ_THREADS = 16  # random 264-byte rows: the disk wants many reads in flight
MERGE_GAP = 4096  # rows closer than a page apart come in one read
LATENCY_WINDOW = 100_000  # reads the latency percentiles cover


@dataclass(frozen=True)
class EngramExtent:
    """Where one layer's table lies: its file, the byte offset of row 0 and the row count."""

    path: Path
    offset: int
    rows: int

    @property
    def nbytes(self) -> int:
        return self.rows * ROW_BYTES


@dataclass
class EngramTelemetry:
    hits: int = 0  # row uses served from the cache (a row used twice in one lookup: once read, once hit)
    misses: int = 0  # rows read
    prefetched: int = 0  # rows read by `prefetch` (counted among the misses too)
    bytes_read: int = 0
    reads: int = 0  # positional reads issued (merged neighbours count once)
    busy_seconds: float = 0.0  # wall time of the lookups that read (their reads overlap)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))  # per read

    def summary(self, resident: int, capacity: int) -> dict[str, float | int]:
        uses = self.hits + self.misses
        lat = np.array(self.latencies) if self.latencies else np.zeros(1)
        return {
            "hit_rate": round(self.hits / uses, 4) if uses else 0.0,
            "hits": self.hits,
            "misses": self.misses,
            "prefetched": self.prefetched,
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "read_gbps": round(self.bytes_read / self.busy_seconds / 1e9, 3) if self.busy_seconds else 0.0,
            "read_latency_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
            "read_latency_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
            "resident_rows": resident,
            "capacity_rows": capacity,
        }


class EngramStore:
    """The Engram rows of a model's layers (`extents`: layer -> where its table lies), cached within
    `cache_bytes` (0: every lookup reads)."""

    def __init__(self, extents: Mapping[int, EngramExtent], cache_bytes: int, threads: int = READ_THREADS) -> None:
        if cache_bytes < 0:
            raise DwarfStarError(f"the Engram cache budget must not be negative, got {cache_bytes} bytes")
        self.extents = dict(extents)
        self._fds: dict[Path, int] = {}
        for layer, extent in self.extents.items():
            self._check(layer, extent)
        self.capacity = cache_bytes // ROW_BYTES
        self._data = np.empty((self.capacity, ROW_BYTES), dtype=np.uint8)
        self._owner = np.full(self.capacity, -1, dtype=np.int64)  # the key each slot holds
        self._referenced = np.zeros(self.capacity, dtype=bool)  # the clock's second chance
        self._where: dict[int, int] = {}  # key -> slot
        self._filled = self._hand = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dwarfstar-engram")
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwarfstar-engram-prefetch")
        self.stats = EngramTelemetry()

    def _check(self, layer: int, extent: EngramExtent) -> None:
        """A clear error now for a table that is not all in its file (a truncated download)."""
        path = Path(extent.path)
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                self.close()
                raise ModelFileError(f"cannot open {path} for the Engram tables: {exc.strerror or exc}") from None
        size = os.fstat(self._fds[path]).st_size
        if extent.rows <= 0 or extent.offset < 0 or extent.offset + extent.nbytes > size:
            self.close()
            raise ModelFileError(
                f"{path.name}: layer {layer}'s Engram table ({extent.rows} rows of {ROW_BYTES} bytes from byte "
                f"{extent.offset}) ends past the file's {size} bytes: the file is truncated"
            )

    # -- lookups ---------------------------------------------------------------------------------------
    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The values `[*ids.shape, 256]` (float32) of `layer`'s rows `ids`."""
        ids = np.asarray(ids)
        return dequantize(self.raw(layer, ids.reshape(-1))).reshape(*ids.shape, -1)

    def raw(self, layer: int, ids: np.ndarray, *, prefetch: bool = False) -> np.ndarray:
        """The stored bytes `[len(ids), 264]` of `layer`'s rows `ids` (a 1-D array of row indices);
        `prefetch`: the lookup is `prefetch`'s (its misses are counted as prefetched)."""
        extent = self.extents.get(layer)
        if extent is None:
            raise DwarfStarError(f"layer {layer} has no Engram table (layers with one: {sorted(self.extents)})")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= extent.rows):
            bad = int(ids[(ids < 0) | (ids >= extent.rows)][0])
            raise DwarfStarError(f"Engram row {bad} is outside layer {layer}'s table of {extent.rows} rows")
        unique, inverse = np.unique(ids, return_inverse=True)
        out = np.empty((unique.size, ROW_BYTES), dtype=np.uint8)
        with self._lock:
            keys = layer * (1 << 40) + unique  # a table has far fewer than 2**40 rows
            slots = np.array([self._where.get(int(k), -1) for k in keys], dtype=np.int64)
            hit = slots >= 0
            out[hit] = self._data[slots[hit]]
            self._referenced[slots[hit]] = True
            missing = np.flatnonzero(~hit)
            self.stats.hits += ids.size - missing.size  # every use served without a read
            self.stats.misses += missing.size
            self.stats.prefetched += missing.size if prefetch else 0
            if missing.size:
                self._read(extent, unique[missing], out, missing)
                for n in missing[-self.capacity :] if self.capacity else ():
                    self._keep(int(keys[n]), out[n])
        return out[inverse]

    def prefetch(self, layer_ids: Mapping[int, np.ndarray]) -> Future[None]:
        """Read the rows each layer of `layer_ids` will look up (a prompt's, before its prefill) into
        the cache, on a background thread; the future ends when they are in (or raises what failed)."""

        def run() -> None:
            for layer, ids in layer_ids.items():
                self.raw(layer, ids, prefetch=True)

        return self._prefetcher.submit(run)

    def call_rows(self, engram_hash: EngramHash, tokens: Sequence[int], start: int) -> dict[int, np.ndarray]:
        """Each of the store's layers' rows (int64 [T, 24]) for positions `start`.. of the sequence `tokens`,
        hashed once for a forward call (`forward_v41.Ops41.engram_rows`); a call of several tokens (a
        prompt) also starts reading them (`prefetch`: layer 0 runs while they arrive) where the cache holds
        them all (else the rows read ahead are evicted before their layer uses them, and each is read
        twice); a decode step's 48 are not worth the hand-off."""
        rows = {layer: engram_hash.rows(layer, tokens, start) for layer in self.extents}
        if len(tokens) - start > 1:
            wanted = {layer: np.unique(ids) for layer, ids in rows.items()}
            if sum(ids.size for ids in wanted.values()) <= self.capacity:
                self.prefetch(wanted)
        return rows

    def telemetry(self) -> dict[str, float | int]:
        with self._lock:
            return self.stats.summary(len(self._where), self.capacity)

    def take_telemetry(self) -> dict[str, float | int]:
        """`telemetry` once the prefetches under way are done, then count from zero again (the cached rows
        stay): each phase's figures are its own (a prefill's, then a decode's: `dwarfstar bench v41`)."""
        self._prefetcher.submit(lambda: None).result()  # one worker: after every earlier prefetch
        with self._lock:
            summary = self.stats.summary(len(self._where), self.capacity)
            self.stats = EngramTelemetry()
        return summary

    def close(self) -> None:
        for pool in ("_pool", "_prefetcher"):
            if hasattr(self, pool):
                getattr(self, pool).shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # -- internals -------------------------------------------------------------------------------------
    def _read(self, extent: EngramExtent, rows: np.ndarray, out: np.ndarray, at: np.ndarray) -> None:
        """Rows `rows` (sorted, unique) of `extent` into `out[at]`: neighbours within `MERGE_GAP` bytes in
        one `pread`, the reads in parallel."""
        fd = self._fds[Path(extent.path)]
        starts = extent.offset + rows * ROW_BYTES
        breaks = np.flatnonzero(np.diff(starts) > ROW_BYTES + MERGE_GAP) + 1
        groups = np.split(np.arange(rows.size), breaks)

        def one(group: np.ndarray) -> tuple[int, float]:
            first, last = int(starts[group[0]]), int(starts[group[-1]]) + ROW_BYTES
            began = time.perf_counter()
            data = os.pread(fd, last - first, first)
            seconds = time.perf_counter() - began
            if len(data) != last - first:
                raise ModelFileError(f"{Path(extent.path).name}: short read of Engram rows at byte {first}")
            span = np.frombuffer(data, dtype=np.uint8)
            for n in group:
                local = int(starts[n]) - first
                out[at[n]] = span[local : local + ROW_BYTES]
            return last - first, seconds

        began = time.perf_counter()
        done = list(self._pool.map(one, groups))
        self.stats.busy_seconds += time.perf_counter() - began
        self.stats.reads += len(done)
        self.stats.bytes_read += sum(nbytes for nbytes, _ in done)
        self.stats.latencies.extend(seconds for _, seconds in done)

    def _keep(self, key: int, row: np.ndarray) -> None:
        """Put a row just read into a slot: a free one, else the clock's victim."""
        if self._filled < self.capacity:
            slot = self._filled
            self._filled += 1
        else:
            while self._referenced[self._hand]:
                self._referenced[self._hand] = False
                self._hand = (self._hand + 1) % self.capacity
            slot = self._hand
            self._hand = (self._hand + 1) % self.capacity
            del self._where[int(self._owner[slot])]
        self._data[slot] = row
        self._owner[slot] = key
        self._referenced[slot] = False
        self._where[key] = slot
