"""`dwarfstar convert`: a Hugging Face DeepSeek V4 or V4.1 checkpoint -> a ds4-layout GGUF (and its side files)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app
from dwarfstar.commands.flags import writable
from dwarfstar.errors import DwarfStarError

OUTTYPES_HELP = (  # convert.hf.OutType
    "f32, f16, q8_0, q8_0-mxfp4: all F32; matrices F16; ds4's Q8_0 layout (experts Q8_0 too); "
    "that layout with the routed experts MXFP4 (the official FP4 experts, without loss)."
)


@app.command(rich_help_panel=TOOLS)
def convert(
    src_dir: Annotated[Path, typer.Argument(help="Checkpoint directory: config.json and *.safetensors.")],
    out: Annotated[
        Path | None,
        typer.Argument(
            help="Output .gguf path of the language model; may be left out with --vision.", callback=writable
        ),
    ] = None,
    outtype: Annotated[str, typer.Option(help=OUTTYPES_HELP)] = "f16",
    dspark: Annotated[
        Path | None,
        typer.Option(
            help="Also write the checkpoint's DSpark drafter (V4 Flash 0731, PRO 0813) to this file, as ds4's "
            "support GGUF that `run --dspark FILE` loads; its tensors get the same types as the trunk's.",
            callback=writable,
        ),
    ] = None,
    vision: Annotated[
        Path | None,
        typer.Option(
            help="Also (or, without OUT, only) write the checkpoint's vision encoder (V4 Flash Vision-Exp, V4.1 "
            "Flash) to this file, as ds4's encoder GGUF that `--vision FILE` loads: its tensors copied as stored.",
            callback=writable,
        ),
    ] = None,
) -> None:
    """Convert an official or transformers-saved DeepSeek V4 checkpoint (or an official V4.1 one) into a ds4 GGUF."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from dwarfstar.convert.hf import ConversionPlan, check_outputs, plan_conversion, write_conversion
    from dwarfstar.convert.vision import VisionPlan, plan_vision, write_vision

    console = Console(stderr=True)
    start = time.perf_counter()
    if out is None and vision is None:
        raise DwarfStarError("convert writes OUT (the language model), --vision FILE (its encoder) or both; give one")
    if out is None and dspark is not None:
        raise DwarfStarError("--dspark writes the language model's drafter beside it: give the OUT path too")
    check_outputs(out, dspark, vision)
    # every file is planned (and checked) before any is written; the small encoder file is written first
    files: list[tuple[Path, str, ConversionPlan | VisionPlan]] = []  # (path, what it holds, its plan)
    encoder = plan_vision(src_dir) if vision is not None else None
    elsewhere = [t.source.name for t in encoder.tensors] if encoder is not None else []
    plan = (
        plan_conversion(src_dir, outtype, dspark=dspark is not None, elsewhere=elsewhere) if out is not None else None
    )
    if vision is not None and encoder is not None:
        files.append((vision, "vision encoder", encoder))
    if out is not None and plan is not None:
        files.append((out, plan.outtype.value, plan))
        if dspark is not None and plan.support is not None:
            files.append((dspark, plan.outtype.value, plan.support))
        for note in plan.notes:
            console.print(f"note: {note}", highlight=False)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),  # share of all tensor values written, whatever the output type
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("converting", total=sum(part.total_elements for _, _, part in files))

        def advance(name: str, n: int) -> None:
            bar.update(task, advance=n, description=name)

        if vision is not None and encoder is not None:
            write_vision(encoder, vision, advance)
        try:
            if out is not None and plan is not None:
                write_conversion(plan, out, dspark, advance)
        except BaseException:  # as with --dspark: on any error no file is left behind
            if vision is not None:
                vision.unlink(missing_ok=True)
            raise
    seconds = time.perf_counter() - start
    for path, kind, part in files:
        size = path.stat().st_size / 1e9
        typer.echo(f"wrote {path} ({kind}, {len(part.tensors)} tensors): {size:.2f} GB in {seconds:.1f} s")
