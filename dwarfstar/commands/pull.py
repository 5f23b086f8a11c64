"""`dwarfstar pull NAME`: download one of ds4's published model files through `huggingface_hub`
(`dwarfstar.model.hub`); `--list` shows them and what is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import app
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.hub import DEFAULT_MODEL_LINK, REPO, TARGETS, download, find_token, link_default_model

GGUF_DIR_ENV = "DS4_GGUF_DIR"  # ds4's variable, so both tools share one download directory


def _file_state(path: Path) -> str:
    if not path.exists():
        return "-"
    where = f" (in the HF cache: {path.resolve().parent})" if path.is_symlink() else ""
    return f"downloaded, {path.stat().st_size / 1e9:.1f} GB{where}"


def show_targets(out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    default = DEFAULT_MODEL_LINK.resolve() if DEFAULT_MODEL_LINK.is_symlink() else None
    table = Table(title=f"{REPO} (into {out_dir}/)", title_justify="left")
    for column in ("name", "size", "on disk", "what"):
        table.add_column(column)
    for target in TARGETS.values():
        paths = [out_dir / f for f in target.files]
        states = ", ".join(_file_state(p) for p in paths)
        if default is not None and any(p.resolve() == default for p in paths):
            states += f" (default: ./{DEFAULT_MODEL_LINK})"
        table.add_row(target.name, f"~{target.approx_gb:g} GB", states, target.about)
    Console().print(table)


@app.command()
def pull(
    name: Annotated[str | None, typer.Argument(help=f"What to download: {', '.join(TARGETS)}.")] = None,
    token: Annotated[
        str | None, typer.Option(help="Hugging Face token (default: HF_TOKEN, then HF's token file).")
    ] = None,
    out_dir: Annotated[
        Path, typer.Option("--dir", envvar=GGUF_DIR_ENV, help="Where the files' links go (the data: the HF cache).")
    ] = Path("gguf"),
    list_targets: Annotated[bool, typer.Option("--list", help="Show the files and what is downloaded.")] = False,
) -> None:
    """Download a DeepSeek V4 GGUF published for ds4 into the shared Hugging Face cache, resuming
    dropped connections; `--dir` gets a link under ds4's file name."""
    from dwarfstar.console.terminal import note

    if list_targets:
        show_targets(out_dir)
        return
    if name is None:
        raise DwarfStarError(f"name what to download ({', '.join(TARGETS)}), or use --list")
    target = TARGETS.get(name)
    if target is None:
        raise DwarfStarError(f"unknown model {name!r}; choose one of {', '.join(TARGETS)}")
    secret, source = find_token(token)
    for file in target.files:
        path = _pull_one(file, out_dir, secret, source)
        note(f"{path} -> {path.resolve()}" if path.is_symlink() else str(path), "")
    if target.links_default:
        link_default_model(out_dir / target.files[-1])
        note(f"./{DEFAULT_MODEL_LINK} -> {out_dir / target.files[-1]} (the default model now)", "")


def _pull_one(file: str, out_dir: Path, token: str | None, source: str) -> Path:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from dwarfstar.console.terminal import note, stderr_console

    if (out_dir / file).exists():
        note(f"already downloaded: {out_dir / file}", "")
        return out_dir / file
    note(f"downloading {file} from {REPO}", "")
    # huggingface_hub draws the download's progress bar; ours, for the hash check after it, starts
    # only then, so the two never share the terminal
    bar = Progress(
        TextColumn("verify SHA-256"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console,
        transient=True,
    )
    task = bar.add_task("verify", total=None, start=False)

    def show(done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
            bar.start_task(task)
        bar.update(task, completed=done, total=total)

    try:
        return download(file, out_dir, token, source, on_progress=show)
    finally:
        if bar.live.is_started:
            bar.stop()
