"""Command-line options that several commands share (`run`, `agent`), defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.engine import BACKENDS, PRECISION_HELP

ModelOption = Annotated[
    Path | None,
    typer.Option("-m", "--model", help="GGUF model (default: ./ds4flash.gguf, else the bundled model)."),
]
ThinkOption = Annotated[bool, typer.Option("--think/--nothink", help="Reason before answering.")]
ThinkMaxOption = Annotated[bool, typer.Option("--think-max", help="Maximum reasoning effort (needs --ctx >= 393216).")]
TempOption = Annotated[float, typer.Option(help="Sampling temperature, 0..100; 0 is greedy.")]
TopPOption = Annotated[float, typer.Option(help="Nucleus sampling, 0..1.")]
TopKOption = Annotated[int, typer.Option(min=0, help="Sample among the K most likely tokens; 0: no limit.")]
MinPOption = Annotated[float, typer.Option(help="Keep tokens with p >= MIN_P * p_max.")]
SeedOption = Annotated[int | None, typer.Option(help="Sampling seed (default: random).")]
CtxOption = Annotated[int, typer.Option("-c", "--ctx", min=1, help="Context size in tokens.")]
BackendOption = Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")]
PrecisionOption = Annotated[str, typer.Option(help=PRECISION_HELP)]
PowerOption = Annotated[int, typer.Option(min=1, max=100, help="Keep the device about N% busy (sleeps; same output).")]
TraceOption = Annotated[Path | None, typer.Option(help="Append a session trace (prompts, cache, text) to FILE.")]
NoQatOption = Annotated[bool, typer.Option("--no-qat-rounding", help="Skip the FP8 KV / FP4 indexer rounding.")]
