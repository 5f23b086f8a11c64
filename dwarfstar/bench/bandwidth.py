"""The machine's read rate: threads summing disjoint slices of a buffer (numpy releases the GIL), for the
CPU benchmarks (`dwarfstar bench cpu`, tools/cpu_compare.py) to set their GB/s beside. numpy only."""

from __future__ import annotations

import time
from threading import Barrier, Thread

import numpy as np

READ_PASSES = 3


def timed_pass(slices: list[np.ndarray]) -> tuple[float, int]:
    """Seconds from the common start of one thread per slice, each summing its slice, to the last one's
    end; and the sum of them all."""
    start_line = Barrier(len(slices) + 1)
    sums = [0] * len(slices)  # kept, so no read can be skipped

    def read(i: int) -> None:
        start_line.wait()
        sums[i] = int(np.add.reduce(slices[i]))

    workers = [Thread(target=read, args=(i,)) for i in range(len(slices))]
    for worker in workers:
        worker.start()
    start_line.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start, sum(sums)


def read_bandwidth(words: np.ndarray, threads: int, passes: int = READ_PASSES) -> list[float]:
    """GB/s of each pass over `words` (a 1-D int64 array), `threads` threads summing disjoint slices of it
    (numpy releases the GIL)."""
    if words.ndim != 1 or words.dtype != np.int64:
        raise ValueError("read_bandwidth reads a 1-D int64 array")
    slices = np.array_split(words, threads)
    return [words.nbytes / timed_pass(slices)[0] / 1e9 for _ in range(passes)]
