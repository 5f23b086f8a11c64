"""`dwarfstar bench v41`: a DeepSeek V4.1 file's prefill and decode speed, resident memory and Engram reads
at several `--engram-cache` budgets (dwarfstar/bench/v41.py says what each figure is)."""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.commands.bench_ctx import PromptFile, bench_text
from dwarfstar.commands.flags import Backend, Model, Precision
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.bench.v41 import Loaded
    from dwarfstar.engine.spec import EngineSpec


def parse_budgets(budgets: str) -> list[int]:
    """--budgets' MB, in the order given."""
    try:
        values = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise DwarfStarError(f"--budgets takes comma-separated MB, got {budgets!r}") from None
    if not values or min(values) < 0:
        raise DwarfStarError(f"--budgets takes one or more MB, 0 or more, got {budgets!r}")
    return values


@bench_app.command("v41")
def bench_v41(
    model: Model = None,
    backend: Backend = "auto",
    precision: Precision = "exact",
    budgets: Annotated[str, typer.Option(help="Comma-separated --engram-cache budgets in MB, one run each.")] = (
        "0,64,1024"
    ),
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens of the text prefilled.")] = 64,
    gen_tokens: Annotated[
        int,
        typer.Option(
            "--gen-tokens",
            "-n",
            "--tokens",
            min=1,
            help="Tokens decoded after it: greedy, or the text's (--decode-text).",
        ),
    ] = 8,
    prompt_file: PromptFile = None,
    cold: Annotated[
        bool, typer.Option("--cold", help="Drop the file's pages from the page cache before each budget.")
    ] = False,
    decode_text: Annotated[
        bool,
        typer.Option(
            "--decode-text", help="Decode the text's next tokens instead of greedy ones (text-like Engram reads)."
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Prefill and decode tok/s, resident memory and Engram reads (hit rate, latency) of a V4.1 model per
    Engram cache budget."""
    from dwarfstar.backends.registry import host_memory
    from dwarfstar.bench.v41 import as_dict, file_facts, format_report, machine_note, run_budget
    from dwarfstar.console.terminal import note
    from dwarfstar.engine.spec import EngineSpec
    from dwarfstar.model.file_v41 import FAMILY41, open_model41
    from dwarfstar.model.hub import resolve_model
    from dwarfstar.model.loader import is_v41

    sizes = parse_budgets(budgets)
    path = resolve_model(model)
    if not is_v41(path):
        raise DwarfStarError(f"{path} is not a {FAMILY41} file: dwarfstar bench v41 measures V4.1 models only")
    opened = open_model41(path)
    try:
        facts = file_facts(opened, host_memory())
    finally:
        opened.close()
    text = bench_text(prompt_file, prompt_tokens + gen_tokens)
    spec = EngineSpec(path, backend, precision)
    note(f"{path.name}: budgets {sizes} MB, {prompt_tokens} prompt tokens, {gen_tokens} decoded")
    load = functools.partial(_load, spec)
    runs = []
    for mb in sizes:
        runs.append(run_budget(load, mb, text, prompt_tokens, gen_tokens, path if cold else None, decode_text))
        note(f"--engram-cache {mb} MB: done, {runs[-1].prefill_tps:.3f} / {runs[-1].gen_tps:.3f} tok/s")
    typer.echo(json.dumps(as_dict(facts, runs)) if json_out else format_report(facts, runs))
    note(machine_note())


def _load(spec: EngineSpec, budget_mb: int, ctx: int) -> Loaded:
    """`spec` loaded with an Engram cache of `budget_mb` MB, for sequences of `ctx` tokens."""
    from dataclasses import replace

    from dwarfstar.bench.v41 import Loaded
    from dwarfstar.engine.load import load_engine
    from dwarfstar.engram.store import EngramStore

    engine = load_engine(replace(spec, engram_cache=budget_mb, ctx=ctx))
    # every backend's V4.1 ops hold the store they read through (reference, triton, mlx)
    store = getattr(getattr(engine.backend, "transformer", None), "ops", None)
    store = getattr(store, "store", None)
    if not isinstance(store, EngramStore):
        engine.model.close()
        raise DwarfStarError(f"the {engine.backend_name} backend's V4.1 model holds no Engram store to measure")

    def close() -> None:
        store.close()
        engine.model.close()

    eos = engine.model.args.eos_token_id
    return Loaded(engine.backend, store, engine.tokenizer.encode, eos, engine.load_seconds, close)
