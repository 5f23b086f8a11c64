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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.routing_trace import RoutingTrace
from dwarfstar.experts.source import StreamingExperts
from dwarfstar.experts.store import DIRECT_ALIGN, READ_THREADS, ExpertCache, round_up


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


def frequency_oracle(trace: RoutingTrace, capacity: int) -> float:
    """The hit rate of a cache that holds the trace's `capacity` most used experts from their first
    use on. When routing is independent from call to call this is the best any online policy can do
    (Aho, Denning and Ullman's A0, which knows each expert's probability): the ceiling for ds4's
    counts and LRU, where Belady's optimum also knows the order of the future uses."""
    uses = np.bincount(trace.accesses(), minlength=trace.n_layers * trace.n_experts)
    kept = np.sort(uses)[::-1][:capacity]
    return float((kept - (kept > 0)).sum() / max(1, uses.sum()))  # each kept expert's first use misses


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


def _read_for(path: str, seconds: float, block: int, sequential: bool, direct: bool, seed: int) -> int:
    """Bytes read in `seconds` by one reader: `block`-byte preads from the start or at random aligned offsets."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = np.frombuffer(mmap.mmap(-1, block), dtype=np.uint8)  # page-aligned, as O_DIRECT needs
    rng = np.random.default_rng(seed)
    done, offset, start = 0, 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            if not sequential:
                offset = int(rng.integers(0, max(1, (size - block) // DIRECT_ALIGN))) * DIRECT_ALIGN
            n = os.preadv(fd, [buf], offset)
            done += n
            offset = offset + n if sequential and offset + n + block <= size else 0
    finally:
        os.close(fd)
    return done


def disk_figures(path: str, block: int, seconds: float, direct: bool, threads: int = READ_THREADS) -> dict[str, float]:
    """The disk's own read rates on this file (GB/s), page cache dropped first: sequential 1 MiB reads,
    random `block`-byte reads one at a time, and random reads from `threads` readers at once (the
    store's parallelism)."""
    block = round_up(block, DIRECT_ALIGN)
    out = {}
    for name, readers, size, sequential in (
        ("sequential", 1, 1 << 20, True),
        ("random", 1, block, False),
        (f"random_x{threads}", threads, block, False),
    ):
        drop_page_cache(path)
        with ThreadPoolExecutor(readers) as pool:
            jobs = [pool.submit(_read_for, path, seconds, size, sequential, direct, i) for i in range(readers)]
            out[f"{name}_gbps"] = sum(j.result() for j in jobs) / seconds / 1e9
    return out
