"""`dwarfstar steer build` / `steer eval` (the `--dir-steering-*` flags that apply a direction are
`SteeringFlags`, dwarfstar/commands/flags.py).

`build` renders each paired prompt as a one-turn chat, runs it, and takes the hook point's output at
its last row in every layer; the direction is the normalised difference of the means (good minus
bad), by default without its part along the bad mean (dwarfstar/steering/direction.py). `eval`
generates greedy replies at several scales and prints, per scale, the mean reply length and the
mean projection of the component on the direction, with a sample.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from dwarfstar.commands.apps import steer_app
from dwarfstar.commands.flags import ModelFlags, Think, comma_list, output

COMPONENTS_HELP = "Hook point: ffn_out or attn_out."  # steering.direction.COMPONENTS


@steer_app.command("build")
def build(
    model: ModelFlags,
    good: Annotated[Path, typer.Option(help="Prompts to steer toward: one a line, or JSON lines with 'prompt'.")],
    bad: Annotated[Path, typer.Option(help="The contrasting prompts, same layout.")],
    output_file: Annotated[Path, output("-o", "--output", help="Direction file to write (sidecar: FILE.json).")],
    component: Annotated[str, typer.Option(help=COMPONENTS_HELP)] = "ffn_out",
    think: Think = False,
    remove_bad_projection: Annotated[
        bool,
        typer.Option(
            "--remove-bad-projection/--keep-bad-projection", help="Take out the part along the bad mean (default)."
        ),
    ] = True,
) -> None:
    """Build a steering direction from paired prompt lists and write it in ds4's layout."""
    from dwarfstar.commands.engines import start
    from dwarfstar.console.terminal import count_bar
    from dwarfstar.quant.prompts import read_prompts
    from dwarfstar.steering.direction import COMPONENTS, SteeringError, build_direction, write_direction
    from dwarfstar.steering.probe import last_row_activations, prompt_ids

    if component not in COMPONENTS:
        raise SteeringError(f"--component must be one of {', '.join(COMPONENTS)}, got {component!r}")
    good_prompts, bad_prompts = read_prompts(good), read_prompts(bad)
    spec = model.spec()
    engine, _ = start(spec)
    good_ids = [prompt_ids(p, engine.tokenizer, think) for p in good_prompts]
    bad_ids = [prompt_ids(p, engine.tokenizer, think) for p in bad_prompts]
    with count_bar("capturing") as bar:
        task = bar.add_task("capture", total=len(good_ids) + len(bad_ids))

        def step() -> None:
            bar.advance(task)

        good_acts = last_row_activations(engine.backend, component, good_ids, step)
        bad_acts = last_row_activations(engine.backend, component, bad_ids, step)
    vectors = build_direction(good_acts, bad_acts, remove_bad_projection)
    settings = {
        "model": spec.model.name,
        "think": think,
        "remove_bad_projection": remove_bad_projection,
        "good": {"file": str(good), "prompts": len(good_ids)},
        "bad": {"file": str(bad), "prompts": len(bad_ids)},
    }
    write_direction(output_file, vectors, component, settings)
    n_layers, hidden = vectors.shape
    size = output_file.stat().st_size
    typer.echo(f"wrote {output_file} ({component}, [{n_layers}, {hidden}], {size} bytes) and its sidecar")


@steer_app.command("eval")
def eval_command(
    model: ModelFlags,
    direction: Annotated[Path, typer.Argument(help="Direction file (ds4's raw f32).")],
    prompts: Annotated[Path, typer.Option(help="Prompts: one a line, or JSON lines with 'prompt'.")],
    scales: Annotated[str, typer.Option(help="Scales to compare, comma-separated.")] = "-2,-1,0,1,2",
    tokens: Annotated[int, typer.Option("-n", "--tokens", min=1, help="Most tokens per reply.")] = 64,
    think: Think = False,
) -> None:
    """Greedy replies at each scale: mean length, mean projection on the direction, a sample."""
    from dwarfstar.commands.engines import start
    from dwarfstar.console.terminal import count_bar, note
    from dwarfstar.quant.prompts import read_prompts
    from dwarfstar.steering.apply import SteeringOptions
    from dwarfstar.steering.direction import SteeringError
    from dwarfstar.steering.probe import evaluate, prompt_ids

    values = comma_list(scales, float, "--scales", "numbers", SteeringError)
    texts = read_prompts(prompts)
    spec = replace(model.spec(), steering=SteeringOptions(direction, 0.0, 0.0))
    engine, _ = start(spec)
    ids = [prompt_ids(p, engine.tokenizer, think) for p in texts]
    with count_bar("evaluating") as bar:
        task = bar.add_task("eval", total=len(ids) * len(values))
        results = evaluate(engine.backend, engine.tokenizer, ids, values, tokens, lambda: bar.advance(task))
    run = f"{direction.name} on {spec.model.name} ({engine.backend_name})"
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
