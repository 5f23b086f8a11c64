"""Our CPU decode and prefill speed against llama.cpp's on the same GGUF file, in one run (issue 38).

Run through `nox -s cpu_compare`: it installs llama-cpp-python==0.3.36 (the `parity` session's build)
and writes the Flash-shaped 4-layer q2 file it runs on by default. One after the other, never at
once, with the same thread count throughout:

1. the machine's read bandwidth: N Python threads sum disjoint slices of a buffer far larger than
   the last-level cache as int64 (numpy releases the GIL in reductions), best of 3 passes. The
   buffer is the model file's own pages (`--bandwidth file`, the default: the first pass reads them
   into the page cache if they are not there, and leaves them warm for both engines), or a fresh
   anonymous array (`--bandwidth memory`, and for a file under 1 GiB);
2. llama.cpp (llama-cpp-python, CPU, extra buffer types off: their repacking asserts on deepseek4
   graphs on AVX-512/AMX machines): prefill the prompt in one `eval` (512-token batches), then
   decode greedy tokens one `eval` at a time;
3. each of our backends named in `--backends`, loaded through `load_engine(EngineSpec(...))`: the
   same prompt through `Session.prefill`, then `bench.frontier.greedy_without_eos`.

Both engines get the same token ids (the benchmark text, tokenized raw by the file's tokenizer) and
mask EOS alike, so both decode exactly `--decode` tokens from the same context. Achieved GB/s is
counted the gpt-fast way, as `dwarfstar bench` does: the file's bytes a decoded token reads
(`bench.frontier.weight_bytes_per_token`: weights only, the KV of a 512-token context aside) times
decode tok/s; the same count for llama.cpp, which reads the same file. The ceiling is the measured
bandwidth divided by those bytes.

Exit status 2 for bad input (a missing file, llama_cpp not importable, an unknown backend), 1 if a
run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dwarfstar.bench.bandwidth import read_bandwidth

LLAMA = "llama.cpp"
MIN_FILE_BYTES = 2**30  # a smaller file is no bandwidth measure: the last-level cache could hold much of it


class InputError(Exception):
    """Bad input: a one-line message and exit status 2."""


@dataclass
class Bandwidth:
    source: str  # what was read: "file" (the model's pages) or "memory" (an anonymous array)
    nbytes: int  # bytes read per pass
    passes_gbps: list[float]  # each pass, in order

    @property
    def gbps(self) -> float:
        return max(self.passes_gbps)


@dataclass
class Run:
    """One engine's measured times on the prompt and the greedy decode after it."""

    engine: str  # LLAMA or "dwarfstar <backend>"
    load_s: float
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    generated: list[int] = field(default_factory=list)  # the greedy tokens

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s


# -- read bandwidth ---------------------------------------------------------------------------------


def measure_bandwidth(path: Path, source: str, memory_bytes: int, threads: int) -> Bandwidth:
    if source == "file":
        words = np.memmap(path, dtype=np.int64, mode="r", shape=(path.stat().st_size // 8,))
    else:
        words = np.ones(memory_bytes // 8, dtype=np.int64)  # written, so every page is backed
    passes = read_bandwidth(words, threads)
    nbytes = words.nbytes
    del words
    return Bandwidth(source, nbytes, passes)


# -- the engines ------------------------------------------------------------------------------------


def _greedy(logits: np.ndarray, eos: int) -> int:
    """The most likely token but EOS, as `greedy_without_eos` picks ours."""
    logits = logits.astype(np.float32, copy=True)
    logits[eos] = -np.inf
    return int(logits.argmax())


@contextlib.contextmanager
def _without_extra_buffer_types() -> Iterator[None]:
    """llama-cpp-python 0.3.36's `Llama` has no `use_extra_bufts` argument (an unknown keyword lands in
    its **kwargs and is ignored), so the model parameters it starts from are given the field off here,
    for the constructor's duration."""
    from llama_cpp import llama as llama_module

    lib = llama_module.llama_cpp
    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = defaults


def run_llama(path: Path, tokens: list[int], decode: int, threads: int, eos: int) -> Run:
    import llama_cpp

    start = time.perf_counter()
    with _without_extra_buffer_types():
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=len(tokens) + decode + 1,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            n_ubatch=512,
            verbose=False,
        )
    try:
        if llm.model_params.use_extra_bufts:
            raise RuntimeError("llama.cpp's extra buffer types are still on")
        load_s = time.perf_counter() - start
        n_vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

        start = time.perf_counter()
        llm.eval(tokens)
        prefill_s = time.perf_counter() - start
        generated = []
        start = time.perf_counter()
        for _ in range(decode):
            token = _greedy(last_logits(), eos)
            llm.eval([token])
            generated.append(token)
        decode_s = time.perf_counter() - start
    finally:
        llm.close()
    return Run(LLAMA, load_s, len(tokens), prefill_s, decode, decode_s, generated)


def run_ours(backend: str, path: Path, tokens: list[int], decode: int, eos: int, threads: int) -> Run:
    from dwarfstar.bench.frontier import greedy_without_eos
    from dwarfstar.engine.load import load_engine
    from dwarfstar.engine.spec import EngineSpec
    from dwarfstar.session.session import Session

    ctx = len(tokens) + decode + 1
    engine = load_engine(EngineSpec(path, backend=backend, ctx=ctx, threads=threads))
    try:
        session = Session(engine.backend, ctx=ctx)
        start = time.perf_counter()
        session.prefill(tokens)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        greedy_without_eos(session, decode, eos)
        decode_s = time.perf_counter() - start
        generated = list(session.tokens[len(tokens) :])
    finally:
        engine.model.close()
    return Run(f"dwarfstar {backend}", engine.load_seconds, len(tokens), prefill_s, decode, decode_s, generated)


# -- the report -------------------------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def report(runs: list[Run], bandwidth: Bandwidth, bytes_per_token: int, about: dict) -> dict:
    """Every figure of the run, as `--json` writes it and `table` prints it."""
    llama = next((r for r in runs if r.engine == LLAMA), None)
    rows = []
    for run in runs:
        gbps = bytes_per_token * run.decode_tps / 1e9
        rows.append(
            {
                "engine": run.engine,
                "load_s": run.load_s,
                "prefill_tokens": run.prefill_tokens,
                "prefill_s": run.prefill_s,
                "prefill_tps": run.prefill_tps,
                "decode_tokens": run.decode_tokens,
                "decode_s": run.decode_s,
                "decode_tps": run.decode_tps,
                "decode_gbps": gbps,
                "bandwidth_share": gbps / bandwidth.gbps,
                "prefill_vs_llama": None if llama is None else run.prefill_tps / llama.prefill_tps,
                "decode_vs_llama": None if llama is None else run.decode_tps / llama.decode_tps,
                "generated": run.generated,
                "same_tokens_as_llama": None if llama is None else _common_prefix(run.generated, llama.generated),
            }
        )
    return {
        **about,
        "bandwidth": {**asdict(bandwidth), "gbps": bandwidth.gbps},
        "bytes_per_token": bytes_per_token,
        "ceiling_tps": bandwidth.gbps * 1e9 / bytes_per_token,
        "rows": rows,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(figures: dict) -> str:
    """The report for people: what was measured, then one line per engine."""
    bw, threads = figures["bandwidth"], figures["threads"]
    lines = [
        f"{figures['model']} ({figures['model_bytes'] / 1e9:.2f} GB), {threads} thread{'s' if threads != 1 else ''}, "
        f"{figures['prefill']}-token prefill, {figures['decode']} greedy decode tokens (EOS masked)",
        f"read bandwidth: {bw['gbps']:.2f} GB/s (best of {len(bw['passes_gbps'])} passes over "
        f"{bw['nbytes'] / 2**30:.2f} GiB of {'the model file' if bw['source'] == 'file' else 'memory'})",
        f"a decoded token reads {figures['bytes_per_token'] / 1e6:.1f} MB of the file (weights only): "
        f"ceiling {figures['ceiling_tps']:.2f} tok/s",
        "",
        f"{'engine':<20} {'prefill tok/s':>13} {'decode tok/s':>12} {'decode GB/s':>11} {'% of bw':>7} "
        f"{'prefill vs llama':>16} {'decode vs llama':>15}",
    ]
    for row in figures["rows"]:
        lines.append(
            f"{row['engine']:<20} {row['prefill_tps']:>13.2f} {row['decode_tps']:>12.2f} {row['decode_gbps']:>11.2f} "
            f"{100 * row['bandwidth_share']:>6.1f}% {_ratio(row['prefill_vs_llama']):>16} "
            f"{_ratio(row['decode_vs_llama']):>15}"
        )
    agree = [r for r in figures["rows"] if r["engine"] != LLAMA and r["same_tokens_as_llama"] is not None]
    for row in agree:
        lines.append(
            f"{row['engine']}: its first {row['same_tokens_as_llama']} of {row['decode_tokens']} greedy tokens "
            "are llama.cpp's"
        )
    if "load_average" in figures:
        load = figures["load_average"]
        lines.append(f"machine load (1-minute average): {load['start']:.2f} at the start, {load['end']:.2f} at the end")
    return "\n".join(lines)


# -- the command line -------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file both engines run")
    parser.add_argument("--backends", default="cpu", help="our backends to run, comma-separated (default: cpu)")
    parser.add_argument("--threads", type=_positive, default=2, help="threads for every measurement (default: 2)")
    parser.add_argument("--prefill", type=_positive, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--decode", type=_positive, default=32, help="greedy tokens decoded (default: 32)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--skip-llama", action="store_true", help="run only ours (no ratios then)")
    parser.add_argument(
        "--bandwidth",
        choices=("file", "memory"),
        default="file",
        help="read the model file's pages (default) or a fresh array of --bandwidth-gib",
    )
    parser.add_argument("--bandwidth-gib", type=float, default=2.0, help="the array's size with --bandwidth memory")
    return parser.parse_args(argv)


def check_input(opts: argparse.Namespace) -> list[str]:
    """Our backend names, once every input is known good; else `InputError`."""
    if not opts.model.is_file():
        raise InputError(f"no model file at {opts.model}")
    from dwarfstar.backends.registry import ENTRIES

    backends = [name.strip() for name in opts.backends.split(",") if name.strip()]
    if not backends:
        raise InputError("--backends names no backend")
    for name in backends:
        if name not in ENTRIES:
            raise InputError(f"unknown backend {name!r}; choose from {', '.join(ENTRIES)}")
    if not opts.skip_llama:
        try:
            import llama_cpp  # noqa: F401
        except Exception as exc:  # a missing package, or a build whose library does not load
            raise InputError(
                f"llama_cpp is not importable here ({exc}); run it through `nox -s cpu_compare` (or pass --skip-llama)"
            ) from None
    return backends


def prompt_tokens(model, count: int) -> list[int]:
    """The first `count` tokens of the benchmark text, tokenized raw (no template, no BOS) by the file's
    tokenizer, as `dwarfstar bench` reads its prompt."""
    from dwarfstar.bench.frontier import read_bench_tokens
    from dwarfstar.commands.bench_ctx import bench_text
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(model.gguf.metadata)
    tokens = read_bench_tokens(tokenizer.encode, bench_text(None, count), count)
    if len(tokens) < count:
        raise InputError(f"the benchmark text has only {len(tokens)} tokens, fewer than --prefill {count}")
    return tokens


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        backends = check_input(opts)
        import torch

        from dwarfstar.bench.frontier import weight_bytes_per_token
        from dwarfstar.errors import DwarfStarError
        from dwarfstar.model.loader import open_model

        try:
            model = open_model(opts.model)
        except DwarfStarError as exc:
            raise InputError(str(exc)) from None
        try:
            tokens = prompt_tokens(model, opts.prefill)
            bytes_per_token, eos = weight_bytes_per_token(model), model.args.eos_token_id
        finally:
            model.close()
    except InputError as exc:
        print(f"cpu_compare: {exc}", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    torch.set_num_threads(opts.threads)  # the torch glue's threads; the cpu backend's kernels take --threads
    path, threads = opts.model, opts.threads
    source = opts.bandwidth
    if source == "file" and path.stat().st_size < MIN_FILE_BYTES:
        note(
            f"the model file is under {MIN_FILE_BYTES / 2**30:.0f} GiB, which caches could hold: reading memory instead"
        )
        source = "memory"
    note(f"read bandwidth: {threads} threads, {source} ...")
    bandwidth = measure_bandwidth(path, source, int(opts.bandwidth_gib * 2**30), threads)
    note(f"  {bandwidth.gbps:.2f} GB/s (passes: {', '.join(f'{g:.2f}' for g in bandwidth.passes_gbps)})")
    runs: list[Run] = []
    try:
        if not opts.skip_llama:
            note(f"{LLAMA}: {len(tokens)}-token prefill, {opts.decode} decode tokens ...")
            runs.append(run_llama(path, tokens, opts.decode, threads, eos))
            gc.collect()
            note(f"  prefill {runs[-1].prefill_tps:.2f} tok/s, decode {runs[-1].decode_tps:.2f} tok/s")
        for name in backends:
            note(f"dwarfstar {name}: {len(tokens)}-token prefill, {opts.decode} decode tokens ...")
            runs.append(run_ours(name, path, tokens, opts.decode, eos, threads))
            gc.collect()
            note(f"  prefill {runs[-1].prefill_tps:.2f} tok/s, decode {runs[-1].decode_tps:.2f} tok/s")
    except (DwarfStarError, RuntimeError, ValueError) as exc:
        print(f"cpu_compare: {exc}", file=sys.stderr)
        return 1
    about = {
        "model": str(path),
        "model_bytes": path.stat().st_size,
        "threads": threads,
        "prefill": len(tokens),
        "decode": opts.decode,
        "machine": {"cpus": os.cpu_count(), "processor": _processor()},
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},  # 1-minute: other work slows both
        "versions": _versions(opts.skip_llama, torch.__version__),
    }
    figures = report(runs, bandwidth, bytes_per_token, about)
    print(table(figures))
    if opts.json is not None:
        opts.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
        note(f"wrote {opts.json}")
    return 0


def _processor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _versions(skip_llama: bool, torch_version: str) -> dict:
    versions = {"torch": torch_version, "numpy": np.__version__}
    if not skip_llama:
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    return versions


if __name__ == "__main__":
    sys.exit(main())
