"""`dwarfstar bench kv`: state bytes per token, and disk KV cache save and load speed.

The state is built with random contents and the exact row counts of a real one (no model runs), in
the layer shapes of Flash: `--layers` layers alternating ratio 4 and ratio 128 as Flash does from
layer 2 on. Save and load go through `KVStore`, so they include the checksum, the fsync and the
rebuild of the `SequenceState`; loads read from a warm page cache right after the save.

A fork (what the server makes when a subagent's prompt shares a conversation's prefix) is timed two
ways in the same run: in the parent's cache block, where it shares the parent's row pages, and in
another block (the first is full), where it copies them. "KV added" is what the cache's accounting
(`SequenceState.nbytes`, shared pages counted once) grows by.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import bench_app
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.model.config import ModelArgs


def flash_layers(n_layers: int) -> ModelArgs:
    from dwarfstar.model.synthetic import FLASH_SHAPED

    ratios = tuple(4 if i % 2 == 0 else 128 for i in range(n_layers))
    return FLASH_SHAPED.with_(n_layers=n_layers, compress_ratios=ratios, n_hash_layers=min(1, n_layers))


def _render(tokens) -> bytes:
    import numpy as np

    # 4 bytes a token, about what decoded text takes; the real key is the decoded token text
    return np.asarray(tokens, dtype="<u4").tobytes()


@bench_app.command("kv")
def bench_kv(
    layers: Annotated[int, typer.Option(help="Flash-shaped layers (alternating ratio 4 and 128).")] = 2,
    tokens: Annotated[int, typer.Option(help="Tokens in the state.")] = 100_000,
    repeat: Annotated[int, typer.Option(help="Saves and loads to time; the best is reported.")] = 3,
    directory: Annotated[Path | None, typer.Option("--dir", help="Cache directory (default: a temporary one).")] = None,
) -> None:
    """Print the state's bytes per token and the disk KV cache save and load MB/s."""
    from dwarfstar.kvcache.kvfile import ModelIdentity
    from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason
    from dwarfstar.kvcache.kvstore import KVStore
    from dwarfstar.kvcache.payload import payload_nbytes
    from dwarfstar.model.config import ModelArgs
    from dwarfstar.session.accounting import random_state, state_footprint

    if layers < 1 or tokens < 1 or repeat < 1:
        raise DwarfStarError("--layers, --tokens and --repeat must be positive")
    args = flash_layers(layers)
    ctx = max(tokens + 1, 4096)
    state = random_state(args, tokens, block_slots=2)
    forks = _forks(state)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        store = KVStore(
            Path(tmp), args, ModelIdentity(2, bytes(32)), ctx, chunk=4096, render_key=_render,
            options=KVCacheOptions(min_tokens=1, budget_bytes=1 << 50),
        )  # fmt: skip
        saves, loads, size = [], [], 0
        for _ in range(repeat):
            start = time.perf_counter()
            path = store.save(state, SaveReason.SHUTDOWN)
            saves.append(time.perf_counter() - start)
            if path is None:
                raise DwarfStarError(f"the cache refused to store the state in {tmp} (see the log)")
            size = path.stat().st_size
            start = time.perf_counter()
            hit = store.lookup(_render(state.tokens))
            loads.append(time.perf_counter() - start)
            if hit is None or hit.n_tokens != tokens:
                raise DwarfStarError("the saved state did not load back")
            path.unlink()
    mine, flash = state_footprint(args), state_footprint(ModelArgs.flash())
    rows = [
        ("state", f"{layers} Flash-shaped layers", "Flash (43 layers)"),
        ("KV bytes/token, bf16", f"{mine.kv_bytes_per_token(2):,.0f}", f"{flash.kv_bytes_per_token(2):,.0f}"),
        ("KV bytes/token, f32", f"{mine.kv_bytes_per_token(4):,.0f}", f"{flash.kv_bytes_per_token(4):,.0f}"),
        ("KV bytes/token, compact", f"{mine.compact_bytes_per_token:,.0f}", f"{flash.compact_bytes_per_token:,.0f}"),
        ("payload bytes/token", f"{mine.payload_bytes_per_token:,.0f}", f"{flash.payload_bytes_per_token:,.0f}"),
        ("payload fixed bytes", f"{mine.payload_fixed_bytes:,}", f"{flash.payload_fixed_bytes:,}"),
        (f"file at {tokens:,} tokens", f"{size:,}", f"{payload_nbytes(ModelArgs.flash(), tokens):,} (payload)"),
        ("save MB/s (fsync)", f"{size / min(saves) / 1e6:,.0f}", ""),
        ("load MB/s (warm)", f"{size / min(loads) / 1e6:,.0f}", ""),
        *forks,
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for label, *cells in rows:
        figures = (cell.rjust(w) for cell, w in zip(cells, widths[1:], strict=True))
        typer.echo("  ".join([label.ljust(widths[0]), *figures]))


def _forks(state) -> list[tuple[str, str, str]]:
    """Fork the state twice: into its own block (the rows' pages shared), then into a new block
    (the rows copied): each one's time and the KV bytes it added."""
    held = [state]
    rows = []
    for label in ("fork, pages shared", "fork, rows copied"):
        before = sum(s.nbytes() for s in held)
        start = time.perf_counter()
        held.append(copy.deepcopy(state))
        seconds = time.perf_counter() - start
        added = sum(s.nbytes() for s in held) - before
        rows.append((f"{label}: ms / KV MB added", f"{seconds * 1e3:,.1f} / {added / 1e6:,.1f}", ""))
    if held[1].block != state.block or held[2].block == state.block:
        raise DwarfStarError("the forks did not land in the blocks the bench measures")
    return rows
