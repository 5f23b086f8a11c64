"""Routed-expert streaming on the command line (the `--ssd-streaming*` options are `StreamingFlags`,
dwarfstar/commands/flags.py): `dwarfstar profile-experts` (record a routing trace, the hot-expert profile) and
`dwarfstar bench experts --replay TRACE` (the store against the disk and plain mmap, no compute).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app, bench_app
from dwarfstar.commands.flags import output, writable
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.experts.layout import ExpertLayout
    from dwarfstar.experts.routing_trace import RoutingTrace
    from dwarfstar.experts.store import Telemetry

POLICIES_HELP = "The store's policy: ds4, lfu, lru."  # experts.policy.POLICIES[:3]


def read_prompts(path: Path) -> list[str]:
    """JSON lines with a `rendered` or `prompt` field (tools/nano_prompts.py), else the whole file as one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DwarfStarError(f"cannot read {path}: {e}") from None
    if path.suffix != ".jsonl":
        return [text]
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                item = json.loads(line)
                prompts.append(item.get("rendered") or item["prompt"])
            except (ValueError, KeyError, AttributeError):
                problem = "expected a JSON object with a 'rendered' or 'prompt' string"
                raise DwarfStarError(f"{path}:{n}: {problem}") from None
    return prompts


@app.command("profile-experts", rich_help_panel=TOOLS)
def profile_experts(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model file.")],
    prompts: Annotated[Path | None, typer.Option(help="Prompt set: .jsonl of rendered prompts, or a text.")] = None,
    out: Annotated[Path | None, output("-o", "--out", help="Trace file (default: MODEL.experts.npz).")] = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=0, help="Greedy tokens decoded after each prompt.")] = 32,
    max_prompt_tokens: Annotated[int, typer.Option(min=1, help="Cut each prompt to this many tokens.")] = 512,
    synthetic_zipf: Annotated[
        float | None, typer.Option(help="Write a synthetic decode trace skewed as rank^-ZIPF instead (no model run).")
    ] = None,
    synthetic_tokens: Annotated[int, typer.Option(min=1, help="Tokens of the synthetic trace.")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic trace.")] = 0,
) -> None:
    """Record the experts the router picks over a prompt set: the hot-expert profile that seeds
    --ssd-streaming (found next to the model), and a trace for `bench experts --replay`."""
    import numpy as np

    from dwarfstar.engine.load import load_engine
    from dwarfstar.engine.spec import EngineSpec
    from dwarfstar.experts.attach import profile_path
    from dwarfstar.experts.routing_trace import TraceRecorder, skewed_trace
    from dwarfstar.model.loader import open_model

    model_file = open_model(model)
    args = model_file.args
    model_file.close()
    target = writable(out or profile_path(model))
    if synthetic_zipf is not None:
        trace = skewed_trace(
            args.n_layers, args.n_routed_experts, args.n_activated_experts, synthetic_tokens, synthetic_zipf, seed=seed
        )
    else:
        if prompts is None:
            raise DwarfStarError("give --prompts FILE (or --synthetic-zipf S for a synthetic trace)")
        engine = load_engine(EngineSpec(model, "reference", ctx=max_prompt_tokens + tokens + 1))
        tokenizer, backend = engine.tokenizer, engine.backend
        recorder = TraceRecorder(args.n_layers, args.n_routed_experts)
        backend.ops.route_observer = recorder
        for text in read_prompts(prompts):
            ids = tokenizer.encode_with_specials(text)[:max_prompt_tokens]
            state = backend.new_state()
            logits = backend.forward(ids, state, all_logits=False)
            for _ in range(tokens):
                logits = backend.forward([int(logits[-1].argmax())], state, all_logits=False)
        trace = recorder.trace()
    trace.save(target)
    counts = trace.counts()
    top = np.sort(counts)[::-1]
    share = top[: max(1, len(top) // 5)].sum() / max(1, top.sum())
    typer.echo(
        f"wrote {target}: {trace.n_tokens} tokens in {len(trace.calls)} calls; the hottest 20% of experts take "
        f"{share:.0%} of the uses"
    )


def _row(label: str, values: dict) -> str:
    return label + " " + " ".join(f"{k}={v}" for k, v in values.items() if not isinstance(v, list | dict))


def _layer_line(label: str, per_layer: list[dict]) -> str:
    """One budget's per-layer figures: hit rate and MB read per token of each layer."""
    cells = " ".join(f"{c['layer']}:{c['hit_rate']:.3f}/{c['bytes_per_token'] / 1e6:.1f}" for c in per_layer)
    return f"  {label} per layer (hit rate/MB per token): {cells}"


def available_memory() -> int:
    """Bytes a new allocation can take now (Linux MemAvailable; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


STORE_MEMORY_FRACTION = 0.6  # the store's slots are real memory: a budget past this is simulated only


def first_tokens(trace: RoutingTrace, n_tokens: int) -> RoutingTrace:
    """The trace's first forward calls up to `n_tokens` tokens (whole calls: a prefill chunk stays one)."""
    import numpy as np

    from dwarfstar.experts.routing_trace import RoutingTrace

    if trace.n_tokens <= n_tokens:
        return trace
    cut = int(np.searchsorted(np.cumsum(trace.calls), n_tokens, side="right"))
    return RoutingTrace(trace.ids[: int(trace.calls[:cut].sum())], trace.calls[:cut], trace.n_experts)


def simulated_reads(stats: Telemetry, layout: ExpertLayout, n_tokens: int) -> tuple[int, list[dict]]:
    """What a simulated cache (bookkeeping only) would have read: each layer's misses times the size of
    its experts; (bytes per token, the per-layer figures with their bytes filled in)."""
    per_layer = stats.per_layer()
    for cell in per_layer:
        cell["bytes_read"] = cell["misses"] * layout.expert_bytes(cell["layer"])
        cell["bytes_per_token"] = round(cell["bytes_read"] / n_tokens)
    return round(sum(cell["bytes_read"] for cell in per_layer) / n_tokens), per_layer


def replay_layout(layout: ExpertLayout, trace: RoutingTrace) -> tuple[ExpertLayout, str | None]:
    """The layout the trace replays over: the file's, or for a smaller model's trace (nano's real
    routing over a Flash-shaped file) the file's first layers and experts, and a note saying so."""
    from dwarfstar.experts.routing_trace import TraceError

    if (trace.n_layers, trace.n_experts) == (layout.n_layers, layout.n_experts):
        return layout, None
    if trace.n_layers > layout.n_layers or trace.n_experts > layout.n_experts or trace.k > layout.n_active:
        raise TraceError(
            f"a trace of {trace.n_layers} layers x {trace.n_experts} experts (k {trace.k}) does not fit in the "
            f"model's {layout.n_layers} x {layout.n_experts} (k {layout.n_active})"
        )
    note = (
        f"the trace is {trace.n_layers} layers x {trace.n_experts} experts (k {trace.k}): replayed over the file's "
        f"first {trace.n_layers} layers' first {trace.n_experts} experts; budgets are % of those "
        f"{trace.n_layers * trace.n_experts}"
    )
    return layout.restricted(trace.n_layers, trace.n_experts, trace.k), note


@bench_app.command("experts")
def bench_experts(
    replay_trace: Annotated[Path, typer.Option("--replay", help="Routing trace (dwarfstar profile-experts).")],
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model whose experts are read.")],
    budgets: Annotated[str, typer.Option(help="Cache budgets, % of all experts, comma-separated.")] = "10,25,50,75,100",
    policy: Annotated[str, typer.Option(help=POLICIES_HELP)] = "ds4",
    direct: Annotated[bool, typer.Option(help="O_DIRECT reads (no page-cache copy).")] = True,
    mmap_too: Annotated[bool, typer.Option("--mmap/--no-mmap", help="Also replay over plain mmap.")] = True,
    max_tokens: Annotated[int, typer.Option(min=1, help="Replay at most this many tokens of the trace.")] = 100000,
    io_tokens: Annotated[
        int | None, typer.Option(min=1, help="Read for the store and mmap only this many first tokens (default: all).")
    ] = None,
    disk_seconds: Annotated[float, typer.Option(help="Seconds of each raw disk measurement.")] = 3.0,
    json_out: Annotated[Path | None, output("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Replay a routing trace through the expert store with real reads and no compute, against Belady's
    and LRU's hit rates and the frequency oracle's (an online policy's ceiling), the disk's own
    read rates and the same replay over plain mmap. A budget whose cache does not fit in the free
    memory is simulated only (hit rates, bytes per token), without the store's real reads."""
    from dwarfstar.experts.layout import ExpertLayout
    from dwarfstar.experts.policy import POLICIES
    from dwarfstar.experts.replay import disk_figures, frequency_oracle, simulate
    from dwarfstar.experts.routing_trace import RoutingTrace
    from dwarfstar.model.loader import open_model

    if policy not in POLICIES[:3]:
        raise DwarfStarError(f"--policy must be one of {', '.join(POLICIES[:3])} (Belady is reported alongside)")
    try:
        percents = [float(p) for p in budgets.split(",") if p.strip()]
    except ValueError:
        raise DwarfStarError(f"--budgets must be comma-separated percentages, got {budgets!r}") from None
    if not percents or not all(0 < p <= 100 for p in percents):
        raise DwarfStarError("--budgets must be percentages in (0, 100]")
    model_file = open_model(model)
    trace = RoutingTrace.load(replay_trace)
    layout, note = replay_layout(ExpertLayout.of(model_file.gguf, model_file.args), trace)
    if note:
        typer.echo(note)
    trace = first_tokens(trace, max_tokens)
    # the simulated hit rates cover the whole trace; the real reads, the slowest part, may cover less
    io_trace = first_tokens(trace, io_tokens or trace.n_tokens)
    part_size = max(p.nbytes for p in layout.parts[0])
    disk = disk_figures(layout.path, part_size, disk_seconds, direct)
    results: dict = {"model": str(model), "trace": str(replay_trace), "tokens": trace.n_tokens, "disk": disk}
    results["io_tokens"] = io_trace.n_tokens
    results.update({"file_bytes": layout.file_size, "expert_bytes": layout.max_expert_bytes, "mapping": note})
    results["rows"] = []
    typer.echo(_row("disk", {k: f"{v:.2f}" for k, v in disk.items()}) + f" (random reads of {part_size} B)")
    typer.echo(f"file {layout.file_size / 2**30:.1f} GiB, RAM {available_memory() / 2**30:.1f} GiB available")
    for pct in percents:
        capacity = max(layout.n_active, int(layout.total_experts * pct / 100))
        row: dict = {"budget_pct": pct, "capacity": capacity}
        for name in ("belady", "lru", "ds4", "lfu"):
            simulated = simulate(trace, capacity, name)
            row[f"{name}_hit"] = round(simulated.stats.hit_rate, 4)
            if name == policy:  # the store's policy: its bytes per token, whether the store runs or not
                row["sim_bytes_per_token"], row["sim_per_layer"] = simulated_reads(
                    simulated.stats, layout, trace.n_tokens
                )
        # the online ceiling where routing is independent between calls (a drifting trace can pass it)
        row["frequency_oracle_hit"] = round(frequency_oracle(trace, capacity), 4)
        row.update(store_replay(layout, io_trace, capacity, policy, direct))
        if mmap_too:
            row.update(mmap_replay(layout, io_trace, capacity))
        results["rows"].append(row)
        typer.echo(_row(f"budget {pct:g}%", row))
        typer.echo(
            _layer_line(
                "store" if "store_per_layer" in row else "simulated", row.get("store_per_layer", row["sim_per_layer"])
            )
        )
    if json_out:
        json_out.write_text(json.dumps(results, indent=1) + "\n")


def store_replay(layout: ExpertLayout, trace: RoutingTrace, capacity: int, policy: str, direct: bool) -> dict:
    """The store's figures over the trace with real reads, or why it was only simulated (too little memory)."""
    from dwarfstar.experts.policy import make_policy
    from dwarfstar.experts.replay import drop_page_cache, replay
    from dwarfstar.experts.store import ExpertStore

    slots = capacity * layout.max_expert_bytes
    if slots > STORE_MEMORY_FRACTION * available_memory():
        return {"store": f"simulated only: {slots / 2**30:.1f} GiB of slots, {available_memory() / 2**30:.1f} free"}
    drop_page_cache(layout.path)
    store = ExpertStore(layout, capacity, make_policy(policy, layout.total_experts), direct=direct)
    start = time.perf_counter()
    try:
        replay(store, trace)
    finally:
        store.close()
    seconds = time.perf_counter() - start
    figures = {f"store_{k}": v for k, v in store.stats.summary(len(store.where), capacity).items()}
    return {**figures, "store_gbps": round(store.stats.bytes_read / seconds / 1e9, 3)}


def mmap_replay(layout: ExpertLayout, trace: RoutingTrace, capacity: int) -> dict:
    """The same replay over plain mmap: hit rate, bytes per token, GB/s and miss latencies."""
    import numpy as np

    from dwarfstar.experts.replay import replay_mmap

    mm = replay_mmap(layout, trace, capacity)
    lat = np.array(mm.latencies or [0.0])
    return {
        "mmap_hit": round(mm.hits / max(1, mm.hits + mm.misses), 4),
        "mmap_bytes_per_token": round(mm.bytes_read / trace.n_tokens),
        "mmap_gbps": round(mm.bytes_read / mm.seconds / 1e9, 3),
        "mmap_miss_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
        "mmap_miss_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
    }


@bench_app.command("experts-bound")
def bench_experts_bound(
    zipf: Annotated[float, typer.Option(min=0.0, help="Skew of the synthetic trace: popularity rank^-ZIPF.")] = 0.7,
    layers: Annotated[int, typer.Option(min=1, help="Layers of the trace.")] = 14,
    experts: Annotated[int, typer.Option(min=2, help="Routed experts per layer.")] = 256,
    k: Annotated[int, typer.Option(min=1, help="Experts a token uses per layer.")] = 6,
    tokens: Annotated[int, typer.Option(min=1, help="Decode tokens of each trace.")] = 2000,
    budgets: Annotated[str, typer.Option(help="Cache budgets, % of all experts, comma-separated.")] = "10,25,50,75,100",
    seed: Annotated[int, typer.Option(help="Seed of the traces.")] = 0,
    json_out: Annotated[Path | None, output("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """The best expected hit rate of any online policy on the synthetic skewed trace (the independent-
    reference bound, `dwarfstar/experts/bound.py`), next to Belady's offline optimum and what ds4, lfu,
    LRU and the frequency oracle reach, on an i.i.d. trace and on the drifting one `profile-experts
    --synthetic-zipf` writes: where 0.9 x Belady is above the bound, no online policy is within 10%."""
    from dwarfstar.experts.bound import inclusion_probabilities, online_bound, zipf_weights
    from dwarfstar.experts.replay import frequency_oracle, simulate
    from dwarfstar.experts.routing_trace import skewed_trace

    if k > experts:
        raise DwarfStarError(f"--k {k} is more than the {experts} experts per layer")
    percents = [float(p) for p in budgets.split(",") if p.strip()]
    if not percents or not all(0 < p <= 100 for p in percents):
        raise DwarfStarError("--budgets must be comma-separated percentages in (0, 100]")
    q = inclusion_probabilities(zipf_weights(experts, zipf), k)
    typer.echo(f"inclusion probabilities: sum {q.sum():.6f} (k = {k}), hottest {q[0]:.4f}, coldest {q[-1]:.5f}")
    traces = {
        "iid": skewed_trace(layers, experts, k, tokens, zipf, drift_every=tokens + 1, seed=seed),
        "drift": skewed_trace(layers, experts, k, tokens, zipf, seed=seed),  # profile-experts' trace
    }
    results: dict = {"zipf": zipf, "layers": layers, "experts": experts, "k": k, "tokens": tokens, "rows": []}
    for pct in percents:
        capacity = max(k, int(layers * experts * pct / 100))
        row: dict = {
            "budget_pct": pct,
            "capacity": capacity,
            "online_bound": round(online_bound(q, layers, capacity), 4),
        }
        for kind, trace in traces.items():
            for name in ("belady", "ds4", "lfu", "lru"):
                row[f"{kind}_{name}"] = round(simulate(trace, capacity, name).stats.hit_rate, 4)
            row[f"{kind}_frequency_oracle"] = round(frequency_oracle(trace, capacity), 4)
            row[f"{kind}_goal_reachable"] = row["online_bound"] >= 0.9 * row[f"{kind}_belady"]
        results["rows"].append(row)
        typer.echo(_row(f"budget {pct:g}%", row))
    if json_out:
        json_out.write_text(json.dumps(results, indent=1) + "\n")
