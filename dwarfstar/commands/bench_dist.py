"""`dwarfstar bench dist`: prefill and decode speed of a layer pipeline with 1, 2, 3... stages.

Each stage count splits the model evenly by bytes; the coordinator runs in this process and, with
`--spawn` (the default), the other stages are local worker processes (`dwarfstar run --dist-role
worker`) on loopback. With `--no-spawn` the bench waits for workers started by hand, on other
machines, for the slices it prints: the same command measures a real network. Figures: prefill and
decode tok/s, and per hop (averaged over the decode steps) the stage's compute, the wait beyond it,
the send time and the bytes moved. Every stage loads only its slice (the coordinator too, once per
stage count); on Linux the bench prints each spawned worker's resident memory after the run, and
the one-stage line the bench process's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.flags import DistBits, DistPrefillChunk, DistPrefillWindow, ModelFlags
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.distributed.dist_options import DistOptions
    from dwarfstar.distributed.route import Hop
    from dwarfstar.engine.spec import EngineSpec


@dataclass
class Figures:
    stages: int
    prefill_tps: float
    decode_tps: float
    hops: list[Hop]


def _mean_hops(steps: list[list[Hop]]) -> list[Hop]:
    from dwarfstar.distributed.route import Hop

    out = []
    for column in zip(*steps, strict=True):
        n = len(column)
        out.append(
            Hop(
                column[0].layers,
                column[0].who,
                column[0].tokens,
                sum(h.compute_ms for h in column) / n,
                sum(h.wait_ms for h in column) / n,
                sum(h.send_ms for h in column) / n,
                sum(h.bytes for h in column) // n,
            )
        )
    return out


def resident_mib(pid: int) -> str:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), where /proc has them."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    now, peak = (int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))
    return f"resident {now:.0f} MiB (peak {peak:.0f} MiB)"


def _measure(backend, stages: int, prompt: list[int], decode: int, ctx: int, route=None) -> Figures:
    from dwarfstar.sampling import SamplingParams
    from dwarfstar.session.session import Session

    session = Session(backend, ctx=ctx)
    start = time.perf_counter()
    session.prefill(prompt)
    prefill_s = time.perf_counter() - start
    steps, greedy = [], SamplingParams(temperature=0.0)
    start = time.perf_counter()
    for _ in session.generate(decode, greedy):
        if route is not None:
            steps.append(route.hops)
    decode_s = time.perf_counter() - start
    return Figures(stages, len(prompt) / prefill_s, decode / decode_s, _mean_hops(steps) if steps else [])


@bench_app.command("dist")
def bench_dist(
    model: ModelFlags,
    stages: Annotated[str, typer.Option(help="Stage counts to run, comma-separated.")] = "1,2,3",
    prompt_tokens: Annotated[int, typer.Option("--prompt", min=1, help="Prompt tokens to prefill.")] = 512,
    decode_tokens: Annotated[int, typer.Option("--decode", min=1, help="Tokens to decode.")] = 32,
    addr: Annotated[str, typer.Option("--dist-addr", help="The coordinator's HOST:PORT.")] = "127.0.0.1:29700",
    spawn: Annotated[bool, typer.Option(help="Start the workers here; --no-spawn waits for remote ones.")] = True,
    dist_activation_bits: DistBits = 32,
    dist_prefill_chunk: DistPrefillChunk = 4096,
    dist_prefill_window: DistPrefillWindow = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the workers, and per message.")] = 600.0,
) -> None:
    """Print prefill and decode tok/s and the per-hop overhead for each stage count."""
    from dwarfstar.distributed.dist_options import DistOptions
    from dwarfstar.distributed.membership import split_by_bytes
    from dwarfstar.engine.load import load_engine
    from dwarfstar.model.loader import open_model

    counts = [int(s) for s in stages.split(",") if s.strip()]
    if not counts or min(counts) < 1:
        raise DwarfStarError("--stages takes positive stage counts, e.g. 1,2,3")
    spec = model.spec(ctx=prompt_tokens + decode_tokens + 1)
    whole = open_model(spec.model)  # the tensor table, for the splits by bytes
    try:
        vocab, plans = whole.args.vocab_size, {count: split_by_bytes(whole, count) for count in counts if count > 1}
    finally:
        whole.close()
    prompt = [(7 * i + 11) % vocab for i in range(prompt_tokens)]
    host, _, port = addr.rpartition(":")
    for n, count in enumerate(counts):
        if count == 1:
            report(_measure(load_engine(spec).backend, 1, prompt, decode_tokens, spec.ctx))
            typer.echo(f"  this process: {resident_mib(os.getpid())}")
            continue
        # a fresh port per run: the last one's may still be closing
        opts = DistOptions.resolved(
            role="coordinator", layers=str(plans[count][0]), addr=f"{host}:{int(port) + n}",
            bits=dist_activation_bits, prefill_chunk=dist_prefill_chunk, prefill_window=dist_prefill_window,
            wait_s=timeout, timeout_s=timeout,
        )  # fmt: skip
        _run_route(spec, plans[count], opts, spawn, prompt, decode_tokens)


def _run_route(spec: EngineSpec, plan: list, opts: DistOptions, spawn: bool, prompt: list[int], decode: int) -> None:
    """One stage count's run. Its own function so that its engine is freed before the next count loads
    its slice: a PRO-shaped coordinator holds gigabytes of float32 weights on the reference backend."""
    from dwarfstar.distributed.backend import RouteBackend
    from dwarfstar.engine.launch import start_coordinator
    from dwarfstar.engine.load import load_engine

    workers, ctx = [], spec.ctx
    if spawn:
        for layers in plan[1:]:
            argv = [sys.executable, "-m", "dwarfstar", "run", "-m", str(spec.model), "--backend", spec.backend]
            argv += ["--precision", spec.precision, "-c", str(ctx)]
            argv += ["--dist-role", "worker", "--layers", str(layers), "--dist-addr", opts.addr]
            workers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
    else:
        typer.echo(f"waiting for workers at {opts.addr}: " + ", ".join(f"--layers {p}" for p in plan[1:]), err=True)
    engine = load_engine(replace(spec, layers=(plan[0].first, plan[0].last)))
    route = start_coordinator(engine, opts, ctx)
    try:
        report(_measure(RouteBackend(route), len(plan), prompt, decode, ctx, route))
        for layers, proc in zip(plan[1:], workers, strict=False):
            typer.echo(f"  worker {layers}: {resident_mib(proc.pid)}")
    finally:
        route.close()
        for proc in workers:
            proc.wait(timeout=60)


def report(fig: Figures) -> None:
    typer.echo(f"stages {fig.stages}: prefill {fig.prefill_tps:.1f} tok/s, decode {fig.decode_tps:.2f} tok/s")
    for hop in fig.hops:
        typer.echo("  " + hop.line().removeprefix("[dist] "))
