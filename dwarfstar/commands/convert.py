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
    dspark: Annotated[
        Path | None,
        typer.Option(
            help="Also write the checkpoint's DSpark drafter (V4 Flash 0731, PRO 0813) to this file, as ds4's "
            "support GGUF that `run --dspark FILE` loads; its tensors get the same types as the trunk's.",
            callback=writable,
        ),
    ] = None,
) -> None:
    """Convert an official or transformers-saved DeepSeek V4 checkpoint into a GGUF that ds4 can load."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from dwarfstar.convert.hf import check_outputs, plan_conversion, write_conversion

    console = Console(stderr=True)
    start = time.perf_counter()
    check_outputs(out, dspark)
    plan = plan_conversion(src_dir, outtype, dspark=dspark is not None)
    files = [(out, plan), *([(dspark, plan.support)] if dspark and plan.support else [])]
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),  # share of all tensor values written, whatever the output type
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("converting", total=sum(part.total_elements for _, part in files))
        write_conversion(plan, out, dspark, lambda name, n: bar.update(task, advance=n, description=name))
    seconds = time.perf_counter() - start
    for path, part in files:
        size = path.stat().st_size / 1e9
        typer.echo(
            f"wrote {path} ({plan.outtype.value}, {len(part.tensors)} tensors): {size:.2f} GB in {seconds:.1f} s"
        )
