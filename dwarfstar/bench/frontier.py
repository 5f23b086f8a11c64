"""The context-frontier speed benchmark of `dwarfstar bench`, measured as ds4-bench does.

Load once; prefill a fixed text (tokenized raw: no template, no BOS) in increments up to each
frontier; at each frontier snapshot the state, decode `gen_tokens` greedy tokens with EOS excluded,
restore, and go on to the next frontier. A row reports the prefill speed of the newest span, the
decode speed at that context, and the DSV4 payload size of the state (ds4's `kvcache_bytes`).

Achieved bandwidth is counted the gpt-fast way: bytes a decoded token must read × tokens/s. A token
reads every non-expert weight (attention, shared expert, router, norms, output head), the share
n_activated / n_routed of the routed-expert tensors, one row of the embedding (and of the hash-routing
table), and the KV it attends to: the raw window, the compressed rows the indexer keeps on ratio-4
layers plus every indexer row it scores, and every compressed row on ratio-128 layers. Weight bytes
are the file's (quantized) bytes, so a backend that holds dequantized copies moves more than this.

A DeepSeek V4.1 file is measured the same way, its bytes counted by `token_bytes41` (CSA2's shared
rows; the Engram tables, read from the disk, left out of the GB/s) and its state's size by its own
payload layout (`kvcache.payloads`).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import TextIO

from dwarfstar.backends.protocol import Backend
from dwarfstar.bench.token_bytes41 import file_weight_bytes41, kv_bytes_read41
from dwarfstar.errors import DwarfStarError
from dwarfstar.kvcache.payloads import payload_nbytes
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.tensors import expected_tensors
from dwarfstar.session.session import Session

EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
ROW_TENSORS = ("token_embd.weight", "ffn_gate_tid2eid.weight")  # a token reads one row of these


@dataclass(frozen=True)
class Row:
    """One frontier. The first six columns are ds4's speed-bench CSV, in its order."""

    ctx_tokens: int
    prefill_tokens: int
    prefill_tps: float
    gen_tokens: int
    gen_tps: float
    kvcache_bytes: int
    gen_gbps: float


CSV_HEADER = [f.name for f in fields(Row)]


def frontiers(start: int, stop: int, step_incr: int, step_mul: float) -> list[int]:
    """start, then +step_incr (or ×step_mul when it is above 1) while the frontier stays <= stop."""
    if start <= 0 or stop < start:
        raise DwarfStarError(f"need 0 < --ctx-start <= --ctx-max, got {start} and {stop}")
    if step_mul < 1 or step_incr <= 0:
        raise DwarfStarError("--step-mul must be >= 1 and --step-incr positive")
    points = [start]
    while True:
        nxt = math.ceil(points[-1] * step_mul) if step_mul > 1 else points[-1] + step_incr
        if nxt > stop:
            return points
        points.append(max(nxt, points[-1] + 1))


def weight_bytes_per_token(model: ModelFile | ModelFile41) -> int:
    if isinstance(model, ModelFile41):
        return file_weight_bytes41(model)
    args, tensors = model.args, model.gguf.tensors
    total = 0.0
    for spec in expected_tensors(args):
        size = tensors[spec.name].nbytes
        if spec.name.endswith(EXPERT_TENSORS):
            total += size * args.n_activated_experts / args.n_routed_experts
        elif spec.name.endswith(ROW_TENSORS):
            total += size / spec.shape[0]
        else:
            total += size
    return round(total)


def kv_bytes_read(args: ModelArgs, ctx: int, element_bytes: int) -> int:
    """KV bytes one decoded token reads at context `ctx` (see the module docstring)."""
    elements = 0
    for layer in args.layers:
        elements += min(ctx, args.window) * args.head_dim
        if layer.has_indexer:
            rows = ctx // layer.compress_ratio
            elements += min(rows, args.index_topk) * args.head_dim + rows * args.index_head_dim
        elif layer.compress_ratio:
            elements += ctx // layer.compress_ratio * args.head_dim
    return elements * element_bytes


def _kv_bytes_at(session: Session, args: ModelArgs | ModelArgs41, ctx: int) -> int:
    """KV bytes one decoded token of `session`'s model reads at context `ctx`, in its state's element size."""
    if isinstance(args, ModelArgs41):
        return kv_bytes_read41(args, ctx)
    return kv_bytes_read(args, ctx, session.state.cache.storage.element_size)


def greedy_choice(session: Session, eos: int) -> int:
    """The session's most likely next token but EOS."""
    logits = session.logits.float().flatten().clone()
    logits[eos] = -math.inf
    return int(logits.argmax())


def greedy_without_eos(session: Session, n: int, eos: int) -> None:
    """ds4-bench's decode: greedy, with EOS masked so every frontier decodes exactly n tokens."""
    for _ in range(n):
        session.decode(greedy_choice(session, eos))


def run_bench(
    backend: Backend,
    model: ModelFile | ModelFile41,
    tokens: list[int],
    points: list[int],
    gen_tokens: int,
    ctx_alloc: int,
    on_row: Callable[[Row], None] = lambda row: None,
    on_tokens: Callable[[int], None] = lambda n: None,
) -> list[Row]:
    """Measure every frontier in `points`; `on_tokens(n)` reports n more tokens processed."""
    args = model.args
    if len(tokens) < points[-1]:
        raise DwarfStarError(f"the text has {len(tokens)} tokens, fewer than --ctx-max {points[-1]}")
    if ctx_alloc <= points[-1] + gen_tokens:
        raise DwarfStarError(f"--ctx-alloc must exceed ctx-max + gen-tokens ({points[-1] + gen_tokens})")
    weights = weight_bytes_per_token(model)
    session = Session(backend, ctx=ctx_alloc)
    rows: list[Row] = []
    for point in points:
        span = tokens[len(session.tokens) : point]
        start = time.perf_counter()
        done = 0

        def progress(n: int, total: int) -> None:
            nonlocal done
            on_tokens(n - done)
            done = n

        session.prefill(span, on_chunk=progress)
        prefill_s = time.perf_counter() - start
        snapshot = session.snapshot()
        start = time.perf_counter()
        greedy_without_eos(session, gen_tokens, args.eos_token_id)
        gen_s = time.perf_counter() - start
        on_tokens(gen_tokens)
        session.restore(snapshot)
        gen_tps = gen_tokens / gen_s
        row = Row(
            ctx_tokens=point,
            prefill_tokens=len(span),
            prefill_tps=len(span) / prefill_s,
            gen_tokens=gen_tokens,
            gen_tps=gen_tps,
            kvcache_bytes=payload_nbytes(args, point),
            gen_gbps=(weights + _kv_bytes_at(session, args, point)) * gen_tps / 1e9,
        )
        rows.append(row)
        on_row(row)
    return rows


def write_csv(rows: list[Row], out: TextIO) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for row in rows:
        writer.writerow(f"{v:.2f}" if isinstance(v, float) else v for v in astuple(row))


def require_plotting() -> None:
    """--plot's library is installed, else an error (checked before a bench runs)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise DwarfStarError("--plot needs matplotlib: pip install 'dwarfstar[plot]'")


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Prefill and generation tok/s against context, with generation GB/s on a second axis."""
    require_plotting()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ctx = [r.ctx_tokens for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(ctx, [r.prefill_tps for r in rows], marker="o", color="tab:blue")
    top.set_ylabel("prefill tok/s")
    top.grid(alpha=0.3)
    bottom.plot(ctx, [r.gen_tps for r in rows], marker="o", color="tab:orange", label="tok/s")
    bottom.set_ylabel("generation tok/s")
    bottom.set_xlabel("context (tokens)")
    bottom.grid(alpha=0.3)
    bandwidth = bottom.twinx()
    bandwidth.plot(ctx, [r.gen_gbps for r in rows], linestyle="--", color="tab:gray")
    bandwidth.set_ylabel("achieved GB/s (dashed)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CUT_MARGIN_TOKENS = 16  # the tokens next to a cut may split differently from the whole text's


def read_bench_tokens(tokenize: Callable[[str], list[int]], text: str, needed: int) -> list[int]:
    """The first `needed` tokens of `text` (fewer if it is short), tokenizing only a prefix of a long text."""
    chars = needed * 8 + 4096  # far more than `needed` tokens of prose
    ids = tokenize(text[:chars])
    if len(ids) < needed + CUT_MARGIN_TOKENS and chars < len(text):
        ids = tokenize(text)
    return ids[:needed]
