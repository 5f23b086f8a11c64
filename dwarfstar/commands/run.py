"""`dwarfstar run`: load a model and run a prompt; the debug dumps other checks depend on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from dwarfstar.cli import app
from dwarfstar.engine import BACKENDS, load_engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt.render import render_conversation
from dwarfstar.session.sampling import SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer


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
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="User message (one-shot chat).")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="Raw prompt as token ids: 0,17,42.")] = None,
    dump_logits: Annotated[
        Path | None, typer.Option(help="Write float32 [n_prompt, vocab] logits after each prompt token (.npy), exit.")
    ] = None,
    no_qat_rounding: Annotated[bool, typer.Option(help="Skip the FP8 KV / FP4 indexer rounding.")] = False,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
    tokens: Annotated[int, typer.Option("-n", "--tokens", help="Tokens to generate.")] = 64,
    temp: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    ctx: Annotated[int, typer.Option(help="Context size in tokens.")] = 32768,
) -> None:
    """Run a prompt through the model."""
    if (prompt is None) == (prompt_tokens is None):
        raise DwarfStarError("give exactly one of -p/--prompt or --prompt-tokens")
    loaded = load_engine(model, backend, qat=not no_qat_rounding, ctx=ctx)
    engine, tokenizer, load_s = loaded.backend, loaded.tokenizer, loaded.load_seconds
    if prompt is not None:
        ids = tokenizer.encode_prompt(render_conversation([{"role": "user", "content": prompt}]).parts)
    else:
        ids = parse_token_list(prompt_tokens)
    session = Session(engine, ctx=min(ctx, engine.args.max_seq_len))
    if dump_logits is not None:
        logits = engine.forward(ids, session.state, all_logits=True)
        np.save(dump_logits, logits.numpy().astype(np.float32, copy=False))
        typer.echo(f"wrote logits {tuple(logits.shape)} to {dump_logits}", err=True)
        return
    start = time.perf_counter()
    session.prefill(ids)
    prefill_s = time.perf_counter() - start
    detok = IncrementalDetokenizer(tokenizer)
    start = time.perf_counter()
    n_out = 0
    params = SamplingParams(temperature=temp, min_p=0.05 if temp > 0 else 0.0, seed=seed)
    for token in session.generate(tokens, params, stop_tokens=[engine.args.eos_token_id]):
        n_out += 1
        if token != engine.args.eos_token_id:
            typer.echo(detok.push(token), nl=False)
    typer.echo(detok.flush())
    decode_s = time.perf_counter() - start
    typer.echo(
        f"load {load_s:.2f} s | prefill {len(ids)} tok at {len(ids) / max(prefill_s, 1e-9):.1f} tok/s | "
        f"decode {n_out} tok at {n_out / max(decode_s, 1e-9):.1f} tok/s",
        err=True,
    )
