"""Triton benchmarks: every kernel's bench cases, and decode / prefill of a synthetic full-size model.

Kernel rows report time, achieved GB/s (bytes each case must move at least, over its time) and
TFLOP/s, and the percentage of the device's peak memory bandwidth and dense bf16 rate, read from
`KNOWN_GPUS` (vendor datasheet figures) or given with `--peak-gbs`. Decode rows report tokens per
second and the bandwidth that implies for the weights a token must read.

Runnable without the CLI's dependencies (the GPU check machine has only torch and triton):
    python -m dwarfstar.backends.triton.gpu_bench kernels --csv kernels.csv
    python -m dwarfstar.backends.triton.gpu_bench decode --synthetic flash-q2 --ctx 2048,32768
    python -m dwarfstar.backends.triton.gpu_bench prefill --synthetic flash-q2 --tokens 8192
    python -m dwarfstar.backends.triton.gpu_bench parity

Each CSV row is written and flushed as it is measured (the header first), so a run stopped by a
timeout keeps what it finished. `decode --then-prefill N` times a prefill of N tokens on the same
weights afterwards. `--tune first` launches an autotuned kernel's first pruned config untimed
(`plan.target.first_config`), as a cold machine can afford; `python -m dwarfstar.backends.triton.warm`
with the same arguments and `--warm JOBS` compiles every kernel variant the run would launch into
Triton's cache, in JOBS processes;
`--dry` goes as far as it can without a device: arguments, imports, the synthetic model's tensors on
the meta device, the CSV headers.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import importlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import (
    EXACT,
    FAST,
    BenchCase,
    BenchShape,
    Precision,
    default_device,
    dependent_launch,
    set_dependent_launches,
    wait_for_inputs,
)
from dwarfstar.model.config import ModelArgs

KERNELS = (
    "quant_blocks", "qmatmul", "hc_pre", "hc_post", "hc_head", "rms_norm_rope", "compressor", "decode_rows",
    "indexer_scores", "topk", "attention", "moe_route", "moe_sort", "moe_experts", "sampling",
    "hc_mix", "hc_collapse", "engram_gate", "row_attention",
)  # fmt: skip
V41_KERNELS = ("hc_mix", "hc_collapse", "engram_gate", "row_attention")  # V4.1's own steps
# (name substring, memory GB/s, dense bf16 TFLOP/s or None), vendor datasheets; most specific first
KNOWN_GPUS: tuple[tuple[str, float, float | None], ...] = (
    ("H200", 4800.0, 989.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),
    ("A100", 2039.0, 312.0),
    ("GB10", 273.0, None),  # DGX Spark
    ("MI300X", 5300.0, 1307.0),
    ("gfx1151", 256.0, None),  # Strix Halo (Ryzen AI Max+ 395)
)


@dataclass(frozen=True)
class Peak:
    device: str
    gbs: float | None
    tflops: float | None


def device_peak(device: torch.device, peak_gbs: float | None = None) -> Peak:
    if device.type != "cuda":
        return Peak("cpu (Triton interpreter)", peak_gbs, None)
    props = torch.cuda.get_device_properties(device)
    names = f"{props.name} {getattr(props, 'gcnArchName', '')}"
    for key, gbs, tflops in KNOWN_GPUS:
        if key in names:
            return Peak(props.name, peak_gbs or gbs, tflops)
    return Peak(props.name, peak_gbs, None)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Mean milliseconds per call: CUDA events over repeated calls with the L2 flushed (do_bench),
    or one wall-clock call in the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kernel_cases(shape: BenchShape, only: Sequence[str] = ()) -> list[BenchCase]:
    cases = []
    for name in KERNELS:
        if not only or name in only:
            module = importlib.import_module(f"dwarfstar.backends.triton.kernels.{name}")
            cases += module.bench_cases(shape)
    return cases


KERNEL_COLUMNS = ("kernel", "case", "us", "GB/s", "TFLOP/s", "%peak_bw", "%peak_flops")
DECODE_COLUMNS = (
    "model", "layers", "ctx", "batch", "precision", "tok/s", "ms/step", "weight_GB/step", "GB/s", "ceiling_tok/s",
    "%ceiling",
)  # fmt: skip
PREFILL_COLUMNS = ("model", "layers", "tokens", "chunk", "precision", "tok/s", "seconds")
PARITY_COLUMNS = ("model", "precision", "step", "max_abs", "max_rel", "top1_agree", "mean_kl")
Emit = Callable[[dict], None]  # where each row goes as it is measured (`CsvRows`)


def _print_row(row: dict) -> None:
    print(_line(row), file=sys.stderr, flush=True)


def run_kernels(shape: BenchShape, peak: Peak, only: Sequence[str] = (), emit: Emit = _print_row) -> list[dict]:
    rows = []
    for case in kernel_cases(shape, only):
        ms = time_ms(case.run, shape.device)
        gbs = case.bytes / ms / 1e6
        tflops = case.flops / ms / 1e9
        rows.append({
            "kernel": case.kernel, "case": case.name, "us": _sig(ms * 1e3), "GB/s": _sig(gbs),
            "TFLOP/s": _sig(tflops), "%peak_bw": _pct(gbs, peak.gbs), "%peak_flops": _pct(tflops, peak.tflops),
        })  # fmt: skip
        emit(rows[-1])
    return rows


def _sig(value: float) -> float:
    return float(f"{value:.4g}")


def _pct(value: float, peak: float | None) -> float | str:
    return _sig(100 * value / peak) if peak else ""


def _line(row: dict) -> str:
    return "  ".join(f"{k}={v}" for k, v in row.items())


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned text table (numbers right-aligned)."""
    if not rows:
        return ""
    cols = list(rows[0])
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def fmt(values: list[str], numeric: list[bool]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))

    numeric = [all(isinstance(r[c], (int, float)) for r in rows) for c in cols]
    lines = [fmt(cols, numeric), fmt(["-" * w for w in widths], numeric)]
    return "\n".join(lines + [fmt(row, numeric) for row in cells])


class CsvRows:
    """Rows written to a CSV file as they come, the header at once, each row flushed; every row is
    also printed (stderr) and kept in `rows`."""

    def __init__(self, path: Path | None, columns: Sequence[str]) -> None:
        self.rows: list[dict] = []
        self.file = open(path, "w", newline="") if path else None  # noqa: SIM115 (closed by close())
        self.writer = csv.DictWriter(self.file, fieldnames=list(columns)) if self.file else None
        if self.writer:
            self.writer.writeheader()
            self.file.flush()

    def __call__(self, row: dict) -> None:
        _print_row(row)
        self.rows.append(row)
        if self.writer:
            self.writer.writerow(row)
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def write_csv(rows: list[dict], path: Path | None) -> None:
    if not rows:
        return
    out = open(path, "w", newline="") if path else sys.stdout  # noqa: SIM115
    try:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    finally:
        if path:
            out.close()


# -- synthetic full-size model ----------------------------------------------------------------------
def decode_bytes_per_token(weights, batch: int = 1) -> int:
    """Weight bytes one decode step of `batch` sequences reads: everything but the embedding table (a
    row per sequence) and the routed experts (min(E, batch * k) of E per layer: as if all distinct);
    KV rows are not counted."""
    a = weights.args
    total = weights.nbytes - weights.embed.nbytes + batch * weights.embed.row_bytes
    used = min(a.n_routed_experts, batch * a.n_activated_experts)
    for lw in weights.layers.values():
        routed = lw.gate_exps.nbytes + lw.up_exps.nbytes + lw.down_exps.nbytes
        total -= routed - routed * used // a.n_routed_experts
    return total


def decode_backend(
    weights, ctxs: Sequence[int], batches: Sequence[int], steps: int, warmup: int, precision: Precision = EXACT
):
    """`run_decode`'s backend: a KV cache for what the bench reaches, not the model's whole context, in
    one block for the largest batch (`warm` builds the same, on the meta device)."""
    from dwarfstar.backends.triton.backend import TritonBackend

    return TritonBackend(
        weights, precision=precision, max_seq_len=max(ctxs) + warmup + steps + 1, kv_slots=max(batches)
    )


def precisions(text: str) -> list[Precision]:
    """`--decode-precision`'s comma-separated names (exact, fast)."""
    named = {"exact": EXACT, "fast": FAST}
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in named]
    if unknown or not names:
        raise ValueError(f"--decode-precision takes exact and/or fast, comma-separated, not {text!r}")
    return [named[name] for name in names]


def prefill_backend(weights, tokens: int, precision: Precision):
    from dwarfstar.backends.triton.backend import TritonBackend

    return TritonBackend(weights, precision=precision, max_seq_len=tokens + 1)


def run_decode(
    preset: str,
    layers: int | None,
    ctxs: Sequence[int],
    steps: int,
    device: torch.device,
    peak: Peak,
    warmup: int = 8,
    batches: Sequence[int] = (1,),
    emit: Emit = _print_row,
    weights=None,
    precision: Precision = EXACT,
) -> list[dict]:
    """Decode steps of `b` sequences at once (one cache block, batch-native kernels, a graph per
    bucket) for each b in `batches`, at each context. tok/s counts every sequence's token; GB/s is
    the weights' bytes a step reads (`decode_bytes_per_token`) over the step time; the ceiling is
    the tok/s that moving those bytes at the peak bandwidth allows."""
    from dwarfstar.backends.triton.synthetic import synthetic_weights

    weights = weights if weights is not None else synthetic_weights(preset, layers, device)
    backend = decode_backend(weights, ctxs, batches, steps, warmup, precision)
    rows = []
    for ctx in ctxs:
        for b in batches:
            per_step = decode_bytes_per_token(weights, b)
            tokens, states = decode_inputs(backend, ctx, b)
            step_seconds(backend, tokens, states, warmup)  # compile each step shape eagerly, capture its graph
            seconds = step_seconds(backend, tokens, states, steps)
            gbs = per_step / seconds / 1e9
            ceiling = b * peak.gbs * 1e9 / per_step if peak.gbs else None
            rows.append({
                "model": preset, "layers": weights.args.n_layers, "ctx": ctx, "batch": b,
                "precision": "fast" if precision.fast else "exact", "tok/s": _sig(b / seconds),
                "ms/step": _sig(seconds * 1e3),
                "weight_GB/step": round(per_step / 1e9, 3), "GB/s": round(gbs, 1),
                "ceiling_tok/s": round(ceiling, 1) if ceiling else "", "%ceiling": _pct(gbs, peak.gbs),
            })  # fmt: skip
            emit(rows[-1])
            del states  # their slots return to the cache for the next batch size
    return rows


def decode_inputs(backend, ctx: int, batch: int) -> tuple[list[list[int]], list]:
    """One token each for `batch` synthetic sequences `ctx` tokens in (`run_decode`'s and gpu_profile's)."""
    from dwarfstar.backends.triton.synthetic import synthetic_state

    return [[1000 + i] for i in range(batch)], [synthetic_state(backend, ctx, seed=i) for i in range(batch)]


def step_seconds(backend, tokens: list[list[int]], states: list, steps: int) -> float:
    """Wall seconds per decode step over `steps` steps of these sequences, the device synchronised
    before and after."""
    _sync(backend.device)
    start = time.perf_counter()
    for _ in range(steps):
        backend.forward_batch(tokens, states)
    _sync(backend.device)
    return (time.perf_counter() - start) / max(1, steps)


def run_prefill(
    preset: str,
    layers: int | None,
    tokens: int,
    chunk: int,
    device: torch.device,
    precision: Precision,
    emit: Emit = _print_row,
    weights=None,
) -> list[dict]:
    from dwarfstar.backends.triton.synthetic import synthetic_weights

    weights = weights if weights is not None else synthetic_weights(preset, layers, device)
    backend = prefill_backend(weights, tokens, precision)
    prompt = torch.randint(3, weights.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    backend.forward(prompt[:chunk].tolist(), backend.new_state(), all_logits=False)  # compile
    state = backend.new_state()
    _sync(device)
    start = time.perf_counter()
    for i in range(0, tokens, chunk):
        backend.forward(prompt[i : i + chunk].tolist(), state, all_logits=False)
    _sync(device)
    seconds = time.perf_counter() - start
    row = {
        "model": preset, "layers": weights.args.n_layers, "tokens": tokens, "chunk": chunk,
        "precision": "bf16 dot" if precision.fast else "fp32", "tok/s": _sig(tokens / seconds),
        "seconds": round(seconds, 3),
    }  # fmt: skip
    emit(row)
    return [row]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- logits parity on the tiny models ----------------------------------------------------------------
def run_parity(
    device: torch.device, prompt_tokens: int = 150, decode_steps: int = 8, emit: Emit = _print_row
) -> list[dict]:
    """Reference backend (CPU, fp32) against the Triton backend on tiny and tiny-k, exact and fast.

    150 prompt tokens fill the raw window, emit rows in every compressed layer (the first ratio-128 row
    at position 127) and make the indexer choose among more rows than its top-k."""
    from dwarfstar.backends.reference.model import ReferenceModel
    from dwarfstar.backends.triton.backend import TritonBackend
    from dwarfstar.model.loader import open_model
    from dwarfstar.model.synthetic import TINY, TINY_K, write_synthetic_model

    prompt = torch.randint(3, 120000, (prompt_tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args, layout in (("tiny", TINY, "f32"), ("tiny-k", TINY_K, "ds4")):
            path = Path(tmp) / f"{name}.gguf"
            write_synthetic_model(path, args, layout=layout, seed=3)
            model = open_model(path)
            reference = ReferenceModel(model)
            for precision in (EXACT, FAST):
                backend = TritonBackend.from_model_file(model, device=device, precision=precision)
                rows += _parity_rows(name, precision, reference, backend, prompt, decode_steps, emit)
            model.close()
    return rows


def _parity_rows(name, precision, reference, backend, prompt, decode_steps, emit: Emit) -> list[dict]:
    ref_state, state = reference.new_state(), backend.new_state()
    steps = [("prefill", backend.forward(prompt, state).cpu(), reference.forward(prompt, ref_state))]
    for i in range(decode_steps):
        token = [int(steps[-1][2][-1].argmax())]
        steps.append((f"decode {i}", backend.forward(token, state).cpu(), reference.forward(token, ref_state)))
    rows = []
    for what, got, want in steps:
        p = want.log_softmax(-1)
        kl = (p.exp() * (p - got.log_softmax(-1))).sum(-1).mean().item()
        diff = (got - want).abs().max().item()
        rows.append({
            "model": name, "precision": "bf16 dot" if precision.fast else "fp32", "step": what,
            "max_abs": f"{diff:.3e}", "max_rel": f"{diff / want.abs().max().item():.3e}",
            "top1_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(), "mean_kl": f"{kl:.3e}",
        })  # fmt: skip
        emit(rows[-1])
    return rows


def bench_shape(model: str, device: torch.device, ctx: int, prefill: int) -> BenchShape:
    args = {"flash": ModelArgs.flash(), "pro": ModelArgs.pro()}[model]
    return BenchShape(args, device, ctx, prefill)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmarks' arguments (also `warm`'s, which compiles what the same arguments would launch)."""
    parser = argparse.ArgumentParser(prog="python -m dwarfstar.backends.triton.gpu_bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="time every kernel's bench cases")
    k.add_argument("--model", choices=("flash", "pro"), default="flash")
    k.add_argument("--ctx", type=int, default=32768, help="decode context of the attention/indexer cases")
    k.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill cases")
    k.add_argument("--only", default="", help="comma-separated kernel files")
    d = sub.add_parser("decode", help="synthetic full-size decode tok/s")
    d.add_argument("--ctx", default="2048,32768")
    d.add_argument("--steps", type=int, default=64)
    d.add_argument("--warmup", type=int, default=8, help="untimed steps first (the graphs are captured in them)")
    d.add_argument("--batch", default="1", help="comma-separated batch sizes (sequences decoding together)")
    d.add_argument("--decode-precision", default="exact", help="exact and/or fast, comma-separated: a pass each")
    d.add_argument("--then-prefill", type=int, default=0, metavar="TOKENS", help="then prefill, same weights")
    d.add_argument("--prefill-csv", type=Path, default=None)
    d.add_argument("--warm", type=int, default=0, metavar="JOBS", help="compile this run's kernels, don't time")
    d.add_argument("--target", default="cuda:90", help="--warm: the GPU's target (cuda:ARCH)")
    d.add_argument("--sms", type=int, default=132, help="--warm: the GPU's multiprocessors")
    p = sub.add_parser("prefill", help="synthetic full-size prefill tok/s")
    p.add_argument("--tokens", type=int, default=8192)
    for s in (d, p):
        s.add_argument("--chunk", type=int, default=4096, help="prefill chunk")
        s.add_argument("--exact", action="store_true", help="prefill: fp32 products, not bf16 tensor-core dots")
        s.add_argument("--synthetic", default="flash-q2", help="flash-q2, flash-q4 or pro-q2")
        s.add_argument("--layers", type=int, default=None)
    sub.add_parser("parity", help="logits of the tiny models against the reference backend")
    for s in (k, d, p):
        s.add_argument("--peak-gbs", type=float, default=None, help="device memory bandwidth, GB/s")
        s.add_argument("--tune", choices=("time", "first"), default="time", help="autotuned kernels: time their "
                       "configs, or launch the first pruned one (what `--warm` compiles)")  # fmt: skip
    for s in sub.choices.values():
        s.add_argument("--csv", type=Path, default=None)
        s.add_argument("--dry", action="store_true", help="no device: arguments, imports, shapes, CSV headers")
    opts = parser.parse_args(argv)
    try:
        precisions(getattr(opts, "decode_precision", "exact"))
    except ValueError as exc:
        parser.error(str(exc))
    return opts


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    if getattr(opts, "warm", 0):
        sys.exit("--warm compiles instead of timing: python -m dwarfstar.backends.triton.warm takes the same arguments")
    device = torch.device("meta") if opts.dry else default_device()
    peak = _dry_peak(opts) if opts.dry else device_peak(device, getattr(opts, "peak_gbs", None))
    print(f"device: {peak.device}, peak {peak.gbs} GB/s, {peak.tflops} bf16 TFLOP/s", flush=True)
    columns = {"kernels": KERNEL_COLUMNS, "decode": DECODE_COLUMNS, "prefill": PREFILL_COLUMNS}
    out = CsvRows(opts.csv, columns.get(opts.what, PARITY_COLUMNS))
    then = CsvRows(opts.prefill_csv, PREFILL_COLUMNS) if getattr(opts, "then_prefill", 0) else None
    try:
        with tuning(getattr(opts, "tune", "time")), _compile_log():
            _run(opts, device, peak, out, then)
    finally:
        out.close()
        if then is not None:
            then.close()
    for rows in (out.rows, then.rows if then else []):
        if rows:
            print(format_table(rows), flush=True)


def _run(opts, device: torch.device, peak: Peak, out: CsvRows, then: CsvRows | None) -> None:
    precision = EXACT if getattr(opts, "exact", False) else FAST
    if device.type == "cuda" and dependent_launch()["PDL"]:
        failure = probe_dependent_launch(device)
        if failure:  # every later launch of this run without it (its kernels compile afresh)
            set_dependent_launches(False)
        print(f"pdl: {'off: the probe failed: ' + failure if failure else 'on'}", flush=True)
    if opts.what == "kernels":
        only = [s for s in opts.only.split(",") if s]
        shape = bench_shape(opts.model, device, opts.ctx, opts.prefill)
        if opts.dry:
            return _dry_kernels(only)
        run_kernels(shape, peak, only, out)
    elif opts.what == "decode":
        from dwarfstar.backends.triton.synthetic import synthetic_weights

        contexts, batches = ([int(c) for c in text.split(",")] for text in (opts.ctx, opts.batch))
        decode_precisions = precisions(opts.decode_precision)
        if opts.dry:
            return _dry_decode(opts.synthetic, opts.layers, batches, peak)
        weights = synthetic_weights(opts.synthetic, opts.layers, device)
        for decode_precision in decode_precisions:
            run_decode(opts.synthetic, opts.layers, contexts, opts.steps, device, peak, opts.warmup, batches, out,
                       weights, decode_precision)  # fmt: skip
            gc.collect()  # this precision's cache and graphs go before the next's (or the prefill's) come
        if then is not None:
            torch.cuda.empty_cache()
            run_prefill(opts.synthetic, opts.layers, opts.then_prefill, opts.chunk, device, precision, then, weights)
    elif opts.what == "prefill":
        if opts.dry:
            return _dry_decode(opts.synthetic, opts.layers, [], peak)
        run_prefill(opts.synthetic, opts.layers, opts.tokens, opts.chunk, device, precision, out)
    elif not opts.dry:
        run_parity(device, emit=out)


@triton.jit
def _chain_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2.0 + 1.0, mask=i < n)


def dependent_chain(bufs: list[torch.Tensor], links: int) -> torch.Tensor:
    """`links` launches of `_chain_kernel` (x -> 2x + 1) between the two buffers, each reading what the
    one before wrote, from bufs[0]; the buffer the last one wrote."""
    n = bufs[0].numel()
    for link in range(links):
        src, dst = bufs[link % 2], bufs[1 - link % 2]
        _chain_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024, **dependent_launch())
    return bufs[links % 2]


def probe_dependent_launch(device: torch.device, links: int = 8, n: int = 1 << 20) -> str | None:
    """None if a chain of dependent launches (`runtime.dependent_launch`, `dependent_chain`) gives the
    right values eagerly and as a replayed CUDA graph on `device`; else what went wrong. A device or
    driver that cannot run or capture them then falls back to plain launches instead of failing every
    benchmark and test."""
    want = 2.0**links - 1  # x -> 2x + 1, from 0, `links` times
    try:
        bufs = [torch.zeros(n, device=device), torch.empty(n, device=device)]
        dependent_chain(bufs, links)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = dependent_chain(bufs, links)
        bufs[0].zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        if not bool((got == want).all()):
            return f"wrong values: {int((got != want).sum())} of {n} differ from {want}"
    except Exception as exc:  # noqa: BLE001  (any failure to launch or capture is the answer)
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return None


@contextlib.contextmanager
def tuning(how: str) -> Iterator[None]:
    """`first`: an autotuned kernel launches its first pruned config, untimed."""
    if how == "time":
        yield
        return
    from triton.runtime.autotuner import Autotuner

    from dwarfstar.backends.triton.plan.target import first_config

    timed, Autotuner.run = Autotuner.run, first_config
    try:
        yield
    finally:
        Autotuner.run = timed


@contextlib.contextmanager
def _compile_log() -> Iterator[None]:
    """Print each kernel Triton compiles (not found in its cache) as it does, and the totals."""
    counts = {True: 0, False: 0}

    def listener(src, metadata, metadata_group, times, cache_hit) -> None:
        counts[cache_hit] += 1
        if not cache_hit:
            print(f"jit: compiled {getattr(src, 'name', src)}", file=sys.stderr, flush=True)

    triton.knobs.compilation.listener = listener
    try:
        yield
    finally:
        triton.knobs.compilation.listener = None
        if counts[True] or counts[False]:
            print(f"jit: {counts[False]} kernels compiled, {counts[True]} loaded from Triton's cache", flush=True)


# -- dry runs: everything up to the first device work ------------------------------------------------
def _dry_peak(opts) -> Peak:
    gpu = next(g for g in KNOWN_GPUS if g[0] == "H200")
    return Peak(f"none (dry run; figures of the {gpu[0]})", getattr(opts, "peak_gbs", None) or gpu[1], gpu[2])


def _dry_decode(preset: str, layers: int | None, batches: Sequence[int], peak: Peak) -> None:
    """The synthetic model's tensors on the meta device, and what a decode step of each batch reads."""
    from dwarfstar.backends.triton.backend import TritonBackend  # noqa: F401  (what the run imports)
    from dwarfstar.backends.triton.graphs import DecodeGraphs  # noqa: F401
    from dwarfstar.backends.triton.synthetic import meta_weights

    weights = meta_weights(preset, layers)
    print(f"dry: {preset}, {weights.args.n_layers} layers, {weights.nbytes / 2**30:.1f} GiB of weights", flush=True)
    for b in batches:
        per_step = decode_bytes_per_token(weights, b)
        print(f"dry: batch {b} reads {per_step / 1e9:.3f} GB a step: ceiling {b * peak.gbs * 1e9 / per_step:.0f} "
              f"tok/s at {peak.gbs:.0f} GB/s", flush=True)  # fmt: skip


def _dry_kernels(only: Sequence[str]) -> None:
    for name in KERNELS:
        if not only or name in only:
            module = importlib.import_module(f"dwarfstar.backends.triton.kernels.{name}")
            if not callable(getattr(module, "bench_cases", None)):
                raise AttributeError(f"kernels.{name} has no bench_cases(shape)")
    print(f"dry: {len(only) or len(KERNELS)} kernel modules with bench cases", flush=True)


if __name__ == "__main__":
    main()
