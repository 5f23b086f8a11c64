"""Triton's kernel cache filled ahead of a benchmark, on every core:
`python -m dwarfstar.backends.triton.warm decode ... --warm JOBS` (the bench's own arguments).

On a cold machine `bench decode` compiles each kernel variant of the decode step (and of the prefill
after it) at its first launch, one after another: about a hundred at Flash shape, minutes of the few
a GPU is lent for. This records, without touching the GPU, every launch the same command would make:
its arguments build the same backend over weights on torch's meta device (`gpu_bench.decode_backend`,
`gpu_bench.prefill_backend`), whose decode graphs (`graphs.DecodeGraphs.body`) run once per graph the
bench captures (each batch and context, each row bound its positions reach) and whose prefill runs
the bench's chunks, every Triton launch intercepted (`plan.target.intercepted`). The launches are
grouped by kernel and constants and compiled for the GPU in JOBS processes, forked after the
recording and taking one group at a time, through the target-only driver (compile only). Triton
writes each kernel into its cache (TRITON_CACHE_DIR), where the bench's launches load it.

They find it there when Triton's key matches: the same Triton, ptxas and TRITON_* environment
(`plan.target` sets TRITON_DEFAULT_FP_FUSION: export it for both), the same target (`--target`: the
GPU's capability), the same argument specialisation (meta tensors keep their views' offsets;
`--sms` gives the decode attention the GPU's multiprocessor count), and the same config of an
autotuned kernel (its first pruned one: run the bench with `--tune first`). The bench prints each
kernel it still had to compile.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from collections import defaultdict

import torch

from dwarfstar.backends.triton import gpu_bench

_GROUPS: list[list[tuple]] = []  # the recorded launches by kernel and constants, read by the forked workers


def record(opts) -> tuple[list[list[tuple]], str]:
    """Every Triton launch (fn, args, grid, kwargs) of `bench decode` with these options, grouped, and
    what was recorded."""
    from dwarfstar.backends.triton.plan.target import activate, intercepted, parse_target
    from dwarfstar.backends.triton.runtime import EXACT, FAST, assume_multiprocessors
    from dwarfstar.backends.triton.synthetic import meta_weights

    activate(parse_target(opts.target))
    assume_multiprocessors(opts.sms)  # the weights are on the meta device
    contexts, batches = ([int(c) for c in text.split(",")] for text in (opts.ctx, opts.batch))
    weights = meta_weights(opts.synthetic, opts.layers)
    launches: list[tuple] = []
    graphs_seen: set[tuple] = set()
    with intercepted(lambda fn, args, grid, kwargs: launches.append((fn, args, grid, kwargs))):
        with torch.inference_mode():
            for precision in gpu_bench.precisions(opts.decode_precision):
                backend = gpu_bench.decode_backend(weights, contexts, batches, opts.steps, opts.warmup, precision)
                for ctx in contexts:
                    for b in batches:
                        states = [backend.new_state() for _ in range(b)]
                        for pos in range(ctx, ctx + opts.warmup + opts.steps):  # the positions the bench steps through
                            for state in states:
                                state.pos = pos
                            key = (precision.fast, *backend.graphs.graph(states))
                            if key not in graphs_seen:
                                graphs_seen.add(key)
                                backend.graphs.body(*key[1:])[0]()
                        del states
                del backend
            chunks = 0
            if opts.then_prefill:
                backend = gpu_bench.prefill_backend(weights, opts.then_prefill, EXACT if opts.exact else FAST)
                state = backend.new_state()
                for start in range(0, opts.then_prefill, opts.chunk):
                    backend.forward(list(range(3, 3 + min(opts.chunk, opts.then_prefill - start))), state, False)
                    chunks += 1
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for launch in launches:
        fn, _, _, kwargs = launch
        consts = sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
        groups[(fn.fn.__name__, tuple(consts))].append(launch)
    what = f"{len(launches)} launches of {len(graphs_seen)} decode graphs and {chunks} prefill chunks"
    return list(groups.values()), what


def _compile_group(index: int) -> tuple[str, int, float, str | None]:
    """In a worker: compile every launch of group `index` (repeats are found in Triton's memory cache)."""
    import triton.runtime.jit as jit

    start = time.perf_counter()
    group = _GROUPS[index]
    name = group[0][0].fn.__name__
    variants = set()
    try:
        for fn, args, grid, kwargs in group:
            variants.add(jit.JITFunction.run(fn, *args, grid=grid, warmup=True, **kwargs).hash)
    except Exception as exc:  # a compile error: the kernel, and the last line Triton gives
        return name, len(variants), time.perf_counter() - start, str(exc).strip().splitlines()[-1]
    return name, len(variants), time.perf_counter() - start, None


def main(opts) -> int:
    start = time.perf_counter()
    groups, what = record(opts)
    print(f"warm: {what} recorded in {time.perf_counter() - start:.1f} s: {len(groups)} kernel groups", flush=True)
    if opts.dry:
        return 0
    _GROUPS[:] = groups  # in the order the bench first launches them: a warm step cut short did those
    start = time.perf_counter()
    jobs = max(1, min(opts.warm, len(groups)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a timeout: the pool's workers are ended too
    problems, variants, busy = [], 0, 0.0
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for name, n, seconds, error in pool.imap_unordered(_compile_group, range(len(_GROUPS))):
            variants, busy = variants + n, busy + seconds
            print(f"  {name}: {n} variants, {seconds:.1f} s" + (f"  PROBLEM {error}" if error else ""), flush=True)
            if error:
                problems.append(f"{name}: {error}")
    wall = time.perf_counter() - start
    print(f"warm: {variants} variants compiled for {opts.target} in {wall:.1f} s on {jobs} processes "
          f"({busy:.0f} s of compiling); {len(problems)} problems", flush=True)  # fmt: skip
    for problem in problems:
        print("PROBLEM", problem, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(gpu_bench.parse_args()))
