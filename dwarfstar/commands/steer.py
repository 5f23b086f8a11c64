"""`dwarfstar steer build` / `steer eval`, and the `--dir-steering-*` flags `run`, `serve` and `bench` share.

`build` renders each paired prompt as a one-turn chat, runs it, and takes the hook point's output at
its last row in every layer; the direction is the normalised difference of the means (good minus
bad), by default without its part along the bad mean (dwarfstar/steering/direction.py). `eval`
generates greedy replies at several scales and prints, per scale, the mean reply length and the
mean projection of the component on the direction, with a sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dwarfstar.cli import app
from dwarfstar.engine import BACKENDS, load_engine
from dwarfstar.hub import resolve_model
from dwarfstar.quant.prompts import read_prompts
from dwarfstar.steering.apply import SteeringOptions
from dwarfstar.steering.direction import COMPONENTS, MAX_SCALE, SteeringError, build_direction, write_direction
from dwarfstar.steering.probe import evaluate, last_row_activations, prompt_ids
from dwarfstar.terminal import loading, note, stderr_console

steer_app = typer.Typer(no_args_is_help=True, help="Directional steering: build a direction, measure its effect.")
app.add_typer(steer_app, name="steer")

_SCALE_HELP = f"-{MAX_SCALE:g}..{MAX_SCALE:g}; positive removes the direction, negative amplifies it"
DirSteeringFile = Annotated[
    Path | None, typer.Option("--dir-steering-file", help="Steering direction (ds4's raw f32 [n_layers][hidden]).")
]
DirSteeringFfn = Annotated[
    float | None, typer.Option("--dir-steering-ffn", help=f"FFN steering scale (default 1 with a file; {_SCALE_HELP}).")
]
DirSteeringAttn = Annotated[
    float | None,
    typer.Option("--dir-steering-attn", help=f"Attention steering scale (default 0; {_SCALE_HELP})."),
]


def steering_options(path: Path | None, ffn: float | None, attn: float | None) -> SteeringOptions | None:
    """The `--dir-steering-*` flags: None without a file; a scale without one is an error."""
    if path is None:
        if ffn is not None or attn is not None:
            raise SteeringError("--dir-steering-ffn and --dir-steering-attn need --dir-steering-file")
        return None
    return SteeringOptions(path, ffn, attn)


def _bar(label: str) -> Progress:
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr_console,
        transient=True,
    )


def parse_scales(text: str) -> list[float]:
    try:
        scales = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SteeringError(f"--scales must be comma-separated numbers, got {text!r}") from None
    if not scales:
        raise SteeringError("--scales is empty")
    return scales


@steer_app.command("build")
def build(
    good: Annotated[Path, typer.Option(help="Prompts to steer toward: one a line, or JSON lines with 'prompt'.")],
    bad: Annotated[Path, typer.Option(help="The contrasting prompts, same layout.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Direction file to write (sidecar: FILE.json).")],
    model: Annotated[Path | None, typer.Option("-m", "--model", help="GGUF model (default: the bundled one).")] = None,
    component: Annotated[str, typer.Option(help=f"Hook point: {', '.join(COMPONENTS)}.")] = "ffn_out",
    think: Annotated[bool, typer.Option("--think/--nothink", help="Render the prompts with thinking on.")] = False,
    remove_bad_projection: Annotated[
        bool,
        typer.Option(
            "--remove-bad-projection/--keep-bad-projection", help="Take out the part along the bad mean (default)."
        ),
    ] = True,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
) -> None:
    """Build a steering direction from paired prompt lists and write it in ds4's layout."""
    if component not in COMPONENTS:
        raise SteeringError(f"--component must be one of {', '.join(COMPONENTS)}, got {component!r}")
    good_prompts, bad_prompts = read_prompts(good), read_prompts(bad)
    path = resolve_model(model)
    with loading(path) as progress:
        engine = load_engine(path, backend, progress=progress)
    good_ids = [prompt_ids(p, engine.tokenizer, think) for p in good_prompts]
    bad_ids = [prompt_ids(p, engine.tokenizer, think) for p in bad_prompts]
    with _bar("capturing") as bar:
        task = bar.add_task("capture", total=len(good_ids) + len(bad_ids))

        def step() -> None:
            bar.advance(task)

        good_acts = last_row_activations(engine.backend, component, good_ids, step)
        bad_acts = last_row_activations(engine.backend, component, bad_ids, step)
    vectors = build_direction(good_acts, bad_acts, remove_bad_projection)
    settings = {
        "model": path.name,
        "think": think,
        "remove_bad_projection": remove_bad_projection,
        "good": {"file": str(good), "prompts": len(good_ids)},
        "bad": {"file": str(bad), "prompts": len(bad_ids)},
    }
    write_direction(output, vectors, component, settings)
    n_layers, hidden = vectors.shape
    typer.echo(f"wrote {output} ({component}, [{n_layers}, {hidden}], {output.stat().st_size} bytes) and its sidecar")


@steer_app.command("eval")
def eval_command(
    direction: Annotated[Path, typer.Argument(help="Direction file (ds4's raw f32).")],
    prompts: Annotated[Path, typer.Option(help="Prompts: one a line, or JSON lines with 'prompt'.")],
    scales: Annotated[str, typer.Option(help="Scales to compare, comma-separated.")] = "-2,-1,0,1,2",
    model: Annotated[Path | None, typer.Option("-m", "--model", help="GGUF model (default: the bundled one).")] = None,
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Most tokens per reply.")] = 64,
    think: Annotated[bool, typer.Option("--think/--nothink", help="Render the prompts with thinking on.")] = False,
    backend: Annotated[str, typer.Option(help=f"Compute backend: {', '.join(BACKENDS)}.")] = "auto",
) -> None:
    """Greedy replies at each scale: mean length, mean projection on the direction, a sample."""
    values = parse_scales(scales)
    texts = read_prompts(prompts)
    path = resolve_model(model)
    with loading(path) as progress:
        engine = load_engine(path, backend, progress=progress, steering=SteeringOptions(direction, 0.0, 0.0))
    ids = [prompt_ids(p, engine.tokenizer, think) for p in texts]
    with _bar("evaluating") as bar:
        task = bar.add_task("eval", total=len(ids) * len(values))
        results = evaluate(engine.backend, engine.tokenizer, ids, values, tokens, lambda: bar.advance(task))
    run = f"{direction.name} on {path.name} ({engine.backend_name})"
    note(f"{run}, {len(ids)} prompts, greedy, at most {tokens} tokens per reply")
    typer.echo(f"{'scale':>7}  {'mean length':>11}  {'projection in':>13}  {'projection out':>14}  sample")
    for r in results:
        sample = r.samples[0].replace("\n", " ")[:60]
        projections = f"{r.mean_projection_in:>13.5f}  {r.mean_projection_out:>14.5f}"
        typer.echo(f"{r.scale:>7g}  {r.mean_length:>11.2f}  {projections}  {sample}")
    typer.echo(
        "projection: v . y at each prompt's last row (where the reply starts), mean over layers and prompts; "
        "in: before the layer's own steering, out: after it"
    )
