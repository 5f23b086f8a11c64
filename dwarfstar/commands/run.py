"""`dwarfstar run`: load a model and run a prompt; the debug dumps other checks depend on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import typer

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.cli import app
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import open_model

BACKENDS = ("auto", "reference")


def parse_token_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise DwarfStarError(f"--prompt-tokens must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise DwarfStarError("--prompt-tokens is empty")
    return ids


@app.command()
def run(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model file.")],
    prompt_tokens: Annotated[str | None, typer.Option(help="Prompt as token ids: 0,17,42.")] = None,
    dump_logits: Annotated[
        Path | None, typer.Option(help="Write float32 [n_prompt, vocab] logits after each prompt token (.npy), exit.")
    ] = None,
    no_qat_rounding: Annotated[bool, typer.Option(help="Skip the FP8 KV / FP4 indexer rounding.")] = False,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Tokens to generate.")] = 32,
    temp: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    ctx: Annotated[int | None, typer.Option(help="Context size in tokens (default: the model's).")] = None,
) -> None:
    """Run a prompt through the model."""
    if backend not in BACKENDS:
        raise DwarfStarError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if prompt_tokens is None:
        raise DwarfStarError("give a prompt with --prompt-tokens")
    ids = parse_token_list(prompt_tokens)
    start = time.perf_counter()
    engine = ReferenceModel(open_model(model), qat=not no_qat_rounding, max_seq_len=ctx)
    load_s = time.perf_counter() - start
    state = engine.new_state()
    start = time.perf_counter()
    logits = engine.forward(ids, state)
    prefill_s = time.perf_counter() - start
    if dump_logits is not None:
        np.save(dump_logits, logits.numpy().astype(np.float32, copy=False))
        typer.echo(f"wrote logits {tuple(logits.shape)} to {dump_logits}", err=True)
        return
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    start = time.perf_counter()
    last = logits[-1]
    for _ in range(tokens):
        if temp > 0:
            token = int(torch.multinomial((last / temp).softmax(-1), 1, generator=generator))
        else:
            token = int(last.argmax())
        out.append(token)
        typer.echo(token, nl=False)
        typer.echo(" ", nl=False)
        if token == engine.args.eos_token_id:
            break
        last = engine.forward([token], state)[-1]
    decode_s = time.perf_counter() - start
    typer.echo()
    typer.echo(
        f"load {load_s:.2f} s | prefill {len(ids)} tok at {len(ids) / prefill_s:.1f} tok/s | "
        f"decode {len(out)} tok at {len(out) / max(decode_s, 1e-9):.1f} tok/s",
        err=True,
    )
