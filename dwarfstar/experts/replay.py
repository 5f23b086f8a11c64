"""Drive a cache with a recorded routing trace and no compute: the policy simulator and the benchmark.

`replay` feeds each forward call of the trace through `StreamingExperts` exactly as the MoE would
(per layer, the call's distinct experts in ascending order, read ahead in a window), so the
bookkeeping alone (`ExpertCache`) gives the policy's hit rate and an `ExpertStore` also does the
real reads. `replay_mmap` reads the same experts through the memory map instead, with the OS page
cache as the only cache, and `disk_figures` measures the disk itself.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.source import StreamingExperts
from dwarfstar.experts.store import ExpertCache
from dwarfstar.experts.trace import RoutingTrace


def replay(cache: ExpertCache, trace: RoutingTrace) -> ExpertCache:
    """Every call of the trace through the cache, each expert fetched (and released) as the MoE would."""
    source = StreamingExperts(cache, lambda expert: None)
    for step in trace.steps():
        ids = torch.from_numpy(step.astype(np.int64))
        for il in range(trace.n_layers):
            loader, _ = source.experts(il, ids[:, il])
            for slot in range(len(loader.order)):
                loader(slot)
    return cache


def simulate(trace: RoutingTrace, capacity: int, policy: str) -> ExpertCache:
    """The policy's behaviour on the trace: a cache of `capacity` experts, bookkeeping only."""
    n_keys = trace.n_layers * trace.n_experts
    chosen = make_policy(policy, n_keys, trace.accesses() if policy == "belady" else None)
    return replay(ExpertCache(trace.n_layers, trace.n_experts, trace.k, capacity, chosen), trace)


@dataclass
class MmapResult:
    hits: int
    misses: int
    bytes_read: int  # bytes of the experts that were not resident (read through page faults)
    seconds: float
    latencies: list[float]


def drop_page_cache(path: str) -> None:
    """Forget the file's pages so reads go to the disk (clean pages only; a model file is never dirty)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def replay_mmap(layout: ExpertLayout, trace: RoutingTrace, capacity: int) -> MmapResult:
    """The same uses read by touching the memory map, with the page cache as the only cache.

    On this machine the page cache could hold a small file whole, so it is held to the same budget:
    an expert that falls out of an LRU of `capacity` experts has its pages dropped (MADV_DONTNEED on
    the mapping, POSIX_FADV_DONTNEED on the file), which is what memory pressure would do to it.
    """
    drop_page_cache(layout.path)
    fd = os.open(layout.path, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    data = np.frombuffer(mapped, dtype=np.uint8)
    page = mmap.PAGESIZE
    lru: OrderedDict[int, None] = OrderedDict()
    result = MmapResult(0, 0, 0, 0.0, [])
    start = time.perf_counter()
    try:
        for key in trace.accesses():
            if key in lru:
                lru.move_to_end(key)
                result.hits += 1
                continue
            layer, e = divmod(key, layout.n_experts)
            began = time.perf_counter()
            for part in layout.expert(layer, e):
                # one byte per page faults every page in, as a kernel reading the weights would
                int(data[part.offset : part.offset + part.nbytes : page].sum())
                result.bytes_read += part.nbytes
            result.latencies.append(time.perf_counter() - began)
            result.misses += 1
            lru[key] = None
            if len(lru) > capacity:
                old, _ = lru.popitem(last=False)
                for part in layout.expert(*divmod(old, layout.n_experts)):
                    first = part.offset // page * page
                    length = part.offset + part.nbytes - first
                    mapped.madvise(mmap.MADV_DONTNEED, first, length)
                    os.posix_fadvise(fd, first, length, os.POSIX_FADV_DONTNEED)
    finally:
        result.seconds = time.perf_counter() - start
        del data
        mapped.close()
        os.close(fd)
    return result


def disk_figures(path: str, block: int, seconds: float = 3.0, seed: int = 0) -> dict[str, float]:
    """The disk's own read rates on this file, page cache dropped first: sequential (1 MiB reads from
    the start) and random (`block`-byte reads at random aligned offsets, one at a time)."""
    size = os.path.getsize(path)
    out = {}
    for kind in ("sequential", "random"):
        drop_page_cache(path)
        fd = os.open(path, os.O_RDONLY)
        rng = np.random.default_rng(seed)
        buf = bytearray(block if kind == "random" else 1 << 20)
        done, offset, start = 0, 0, time.perf_counter()
        try:
            while time.perf_counter() - start < seconds:
                if kind == "random":
                    offset = int(rng.integers(0, max(1, (size - block) // 4096))) * 4096
                n = os.preadv(fd, [buf], offset)
                done += n
                offset = offset + n if kind == "sequential" and offset + n < size else 0
        finally:
            os.close(fd)
        out[f"{kind}_gbps"] = done / (time.perf_counter() - start) / 1e9
    return out
