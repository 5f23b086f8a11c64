"""`dwarfstar pull NAME`: download one of ds4's published model files, resumably; `--list` shows them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from dwarfstar.cli import app
from dwarfstar.errors import DwarfStarError
from dwarfstar.hub import DEFAULT_MODEL_LINK, REPO, TARGETS, download, find_token, link_default_model
from dwarfstar.terminal import note, stderr_console

GGUF_DIR_ENV = "DS4_GGUF_DIR"  # ds4's variable, so both tools share one download directory


def _file_state(path: Path) -> str:
    part = path.with_name(path.name + ".part")
    if path.exists():
        return f"downloaded, {path.stat().st_size / 1e9:.1f} GB"
    if part.exists():
        return f"partial, {part.stat().st_size / 1e9:.1f} GB so far"
    return "-"


def show_targets(out_dir: Path) -> None:
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
    out_dir: Annotated[Path, typer.Option("--dir", envvar=GGUF_DIR_ENV, help="Download directory.")] = Path("gguf"),
    list_targets: Annotated[bool, typer.Option("--list", help="Show the files and what is downloaded.")] = False,
    retries: Annotated[int, typer.Option(min=0, help="Resume attempts after a dropped connection.")] = 5,
) -> None:
    """Download a DeepSeek V4 GGUF published for ds4; an interrupted download resumes where it stopped."""
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
        path = _pull_one(file, out_dir, secret, source, retries)
        note(str(path), "")
    if target.links_default:
        link_default_model(out_dir / target.files[-1])
        note(f"./{DEFAULT_MODEL_LINK} -> {out_dir / target.files[-1]} (the default model now)", "")


def _pull_one(file: str, out_dir: Path, token: str | None, source: str, retries: int) -> Path:
    if (out_dir / file).exists():
        note(f"already downloaded: {out_dir / file}", "")
        return out_dir / file
    note(f"downloading {file} from {REPO}", "")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console,
    ) as progress:
        task = progress.add_task("download", total=None)

        def show(phase: str, done: int, total: int | None) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        return download(file, out_dir, token, source, retries=retries, on_progress=show)
