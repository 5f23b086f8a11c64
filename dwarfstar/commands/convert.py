"""`dwarfstar convert`: a Hugging Face DeepSeek V4 checkpoint -> a ds4-layout GGUF."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app
from dwarfstar.commands.flags import writable

OUTTYPES_HELP = (  # convert.hf.OutType
    "f32, f16, q8_0, q8_0-mxfp4: all F32; matrices F16; ds4's Q8_0 layout (experts Q8_0 too); "
    "that layout with the routed experts MXFP4 (the official FP4 experts, without loss)."
)


@app.command(rich_help_panel=TOOLS)
def convert(
    src_dir: Annotated[Path, typer.Argument(help="Checkpoint directory: config.json and *.safetensors.")],
    out: Annotated[Path, typer.Argument(help="Output .gguf path.", callback=writable)],
    outtype: Annotated[str, typer.Option(help=OUTTYPES_HELP)] = "f16",
) -> None:
    """Convert an official or transformers-saved DeepSeek V4 checkpoint into a GGUF that ds4 can load."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from dwarfstar.convert.hf import plan_conversion, write_gguf

    console = Console(stderr=True)
    start = time.perf_counter()
    plan = plan_conversion(src_dir, outtype)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),  # share of all tensor values written, whatever the output type
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("converting", total=plan.total_elements)
        write_gguf(plan, out, lambda name, n: bar.update(task, advance=n, description=name))
    size = out.stat().st_size / 1e9
    typer.echo(
        f"wrote {out} ({plan.outtype.value}, {len(plan.tensors)} tensors): {size:.2f} GB "
        f"in {time.perf_counter() - start:.1f} s"
    )
