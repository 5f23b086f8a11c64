"""GGUF tools in the manner of ds4's gguf-tools: `quantize`, `imatrix`, `quality` and `inspect`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dwarfstar.commands.apps import TOOLS, app
from dwarfstar.commands.flags import output, writable

if TYPE_CHECKING:
    from collections.abc import Callable

    from dwarfstar.gguf.constants import GGMLType
    from dwarfstar.gguf.split import GGUFSet
    from dwarfstar.quant.quality import Quality

RECIPE_HELP = (  # quant.recipes.RECIPES
    "One of q2, q2-q4, q4, q8, mxfp4. q2: routed gate/up IQ2_XXS, down Q2_K; "
    "q2-q4: q2 with the last 6 layers' experts Q4_K; q4: experts Q4_K; q8: experts Q8_0; "
    "mxfp4: experts MXFP4 (copied when they already are). "
    "Everything else: Q8_0 projections, F16 embedding/HC/compressor/indexer/router, F32 norms."
)


def _gb(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.3f} GB"
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.3f} kB"


@app.command(rich_help_panel=TOOLS)
def quantize(
    src: Annotated[Path, typer.Argument(help="Input GGUF (any float or quantized types).")],
    dst: Annotated[Path, typer.Argument(help="Output GGUF.", callback=writable)],
    recipe: Annotated[str, typer.Option(help=RECIPE_HELP)],
    imatrix: Annotated[Path | None, typer.Option(help="Importance matrix from `dwarfstar imatrix` (.dat).")] = None,
) -> None:
    """Re-encode a DeepSeek V4 GGUF with one of ds4's recipes, tensor by tensor."""
    from dwarfstar.quant.imatrix import read_imatrix
    from dwarfstar.quant.recipes import quantize_model

    start = time.perf_counter()
    matrix = read_imatrix(imatrix) if imatrix is not None else None

    def progress(name: str, src_type: GGMLType, dst_type: GGMLType) -> None:
        action = "copy" if src_type == dst_type else f"{src_type.name} -> {dst_type.name}"
        typer.echo(f"[{time.perf_counter() - start:7.1f}s] {name:40} {action}", err=True)

    quantize_model(src, dst, recipe, matrix, progress)
    typer.echo(f"wrote {dst} ({recipe}): {_gb(dst.stat().st_size)} in {time.perf_counter() - start:.1f} s")
    growth = growth_note(src, dst)
    if growth:
        typer.echo(growth, err=True)


def growth_note(src: Path, dst: Path) -> str | None:
    """When the output is larger than the input: by how much, and the tensors the recipe stored wider."""
    with open_gguf(src) as old, open_gguf(dst) as new:
        before = sum(t.nbytes for t in old.tensors.values())
        after = sum(t.nbytes for t in new.tensors.values())
        grown = [
            (new.tensors[name].nbytes - t.nbytes, name, t.ggml_type.name, new.tensors[name].ggml_type.name)
            for name, t in old.tensors.items()
            if name in new.tensors and new.tensors[name].nbytes > t.nbytes
        ]
    if after <= before:
        return None
    grown.sort(reverse=True)
    wider = ", ".join(f"{name} as {now} (was {was}, +{_gb(extra)})" for extra, name, was, now in grown[:3])
    return f"note: {dst.name} is {_gb(after - before)} larger than {src.name}: the recipe stores {wider}"


def open_gguf(path: Path):
    """A GGUF file, or every part of the split set `path` is a part of."""
    from dwarfstar.gguf.reader import GGUFFile
    from dwarfstar.gguf.split import PartName, open_all_parts

    part = PartName.of(path)
    return GGUFFile(path) if part is None else open_all_parts(part)


@app.command("imatrix", rich_help_panel=TOOLS)
def imatrix_command(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model to run (the reference backend).")],
    prompts: Annotated[Path, typer.Option(help="Prompt file: JSON lines, ds4 rendered prompts, or one per line.")],
    output_file: Annotated[Path, output("-o", "--output", help="Imatrix file to write (llama.cpp legacy .dat).")],
) -> None:
    """Collect routed-expert activation statistics (ds4's routed-MoE imatrix).

    For every routed expert: the mean square of each input column of its gate/up/down matrices, over the
    tokens routed to it. Written as llama.cpp's legacy .dat, laid out as ds4 writes it: one entry per
    routed tensor (blk.N.ffn_{gate,up,down}_exps.weight) with n_expert × n_columns values, expert after
    expert; the format is spelled out in dwarfstar/quant/imatrix.py.
    """
    from dwarfstar.model.loader import open_model
    from dwarfstar.quant.imatrix import collect_imatrix, write_imatrix
    from dwarfstar.quant.prompts import read_prompts, tokenize_prompt
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    start = time.perf_counter()
    model_file = open_model(model)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(model_file.gguf.metadata)
        token_lists = [tokenize_prompt(p, tokenizer) for p in read_prompts(prompts)]

        def progress(done: int, tokens: int) -> None:
            typer.echo(f"\r{done}/{len(token_lists)} prompts, {tokens} tokens", nl=False, err=True)

        result = collect_imatrix(model_file, token_lists, str(prompts), progress)
    finally:
        model_file.close()
    typer.echo("", err=True)
    write_imatrix(output_file, result)
    n_tokens = sum(len(t) for t in token_lists)
    typer.echo(
        f"wrote {output_file}: {len(result.entries)} entries from {result.chunks} prompts, {n_tokens} tokens "
        f"in {time.perf_counter() - start:.1f} s"
    )


@app.command(rich_help_panel=TOOLS)
def quality(
    ref: Annotated[Path, typer.Argument(help="Reference GGUF.")],
    test: Annotated[Path, typer.Argument(help="GGUF to measure against the reference.")],
    prompts: Annotated[Path, typer.Option(help="Prompt file: JSON lines, ds4 rendered prompts, or one per line.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """KL divergence, top-1 agreement and perplexity of TEST against REF, per prompt and overall."""
    from dwarfstar.model.loader import open_model
    from dwarfstar.quant.prompts import read_prompts, tokenize_prompt
    from dwarfstar.quant.quality import compare_models
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    ref_file = open_model(ref)
    try:
        test_file = open_model(test)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(ref_file.gguf.metadata)
            token_lists = [(p.id, tokenize_prompt(p, tokenizer)) for p in read_prompts(prompts)]
            per_prompt, overall = compare_models(ref_file, test_file, token_lists)
        finally:
            test_file.close()
    finally:
        ref_file.close()
    if json_output:
        body = {
            "ref": str(ref),
            "test": str(test),
            "prompts": [q.as_dict() for q in per_prompt],
            "overall": overall.as_dict(),
        }
        typer.echo(json.dumps(body, indent=2))
        return
    typer.echo(f"{'prompt':24} {'tokens':>6} {'mean KL':>10} {'top-1':>7} {'ppl ref':>9} {'ppl test':>9}")
    for q in [*per_prompt, overall]:
        typer.echo(_quality_row(q))


def _quality_row(q: Quality) -> str:
    return f"{q.id[:24]:24} {q.positions:6d} {q.kl:10.6f} {q.top1:7.3f} {q.ppl_ref:9.3f} {q.ppl_test:9.3f}"


@app.command("inspect", rich_help_panel=TOOLS)
def inspect_command(
    model: Annotated[Path, typer.Argument(help="GGUF file, or any part of a split set (…-Layers00-30.gguf).")],
) -> None:
    """Metadata, tensor table, totals per type, and the weight bytes read per decoded token; for a
    split set, its parts and their layer ranges first, then the set as one model; for a vision encoder
    (ds4's --vision file), its family, shapes, image budget and router biases first; for DeepSeek V4.1,
    its layer modes and Engram tables (resident vs on-disk bytes) first (of a split set, after its parts)."""
    from dwarfstar.gguf.split import GGUFSet
    from dwarfstar.model.config_v41 import ARCH41
    from dwarfstar.model.file_v41 import FAMILY41, read_model41
    from dwarfstar.model.file_v41 import describe as describe41
    from dwarfstar.model.vision import PREFIX as VISION_ARCH
    from dwarfstar.model.vision_file import describe as describe_vision
    from dwarfstar.model.vision_file import read_vision
    from dwarfstar.quant import inspection

    with open_gguf(model) as gguf:
        if isinstance(gguf, GGUFSet):
            _show_parts(gguf)
        else:
            typer.echo(
                f"{model}: GGUF v{gguf.version}, {len(gguf.metadata)} metadata keys, {len(gguf.tensors)} tensors"
            )
            if gguf.metadata.get("general.architecture") == VISION_ARCH:
                _show_summary("vision encoder", lambda: describe_vision(read_vision(gguf)))
        if gguf.metadata.get("general.architecture") == ARCH41:  # a file, or a set as one model
            _show_summary(FAMILY41, lambda: describe41(read_model41(gguf, model)))
        typer.echo("\nmetadata")
        for key, value in gguf.metadata.items():
            typer.echo(f"  {key} = {inspection.describe_value(value)}")
        rows = inspection.file_tensors(gguf)
        typer.echo(f"\n{'tensor':44} {'shape (torch order)':>22} {'type':>8} {'bytes':>14}")
        for t in rows:
            typer.echo(f"{t.name:44} {str(list(t.shape)):>22} {t.ggml_type.name:>8} {t.nbytes:>14,}")
        typer.echo("\ntotals per type")
        for ggml_type, (count, size) in inspection.totals_by_type(rows).items():
            typer.echo(f"  {ggml_type.name:8} {count:5d} tensors {_gb(size):>12}")
        typer.echo(f"  {'all':8} {len(rows):5d} tensors {_gb(sum(t.nbytes for t in rows)):>12}")
        experts = inspection.expert_counts(gguf.metadata)
        if gguf.metadata.get("general.architecture") == VISION_ARCH:
            return  # an encoder reads every weight once per image, no decoded token
        if experts is None:
            typer.echo("\nbytes read per decoded token: not a deepseek4 file, no expert counts")
            return
        per_token = inspection.token_bytes(rows, *experts)
        typer.echo(
            f"\nbytes read per decoded token ({experts[1]} of {experts[0]} routed experts): {_gb(per_token.total)}"
        )
        for kind, size in sorted(per_token.by_kind.items(), key=lambda kv: -kv[1]):
            typer.echo(f"  {kind:22} {_gb(size):>12}")


def _show_summary(what: str, lines: Callable[[], list[str]]) -> None:
    """A file's summary (`lines()`: a vision encoder's, a V4.1 model's `describe`), or what makes it no
    valid `what`."""
    from dwarfstar.errors import DwarfStarError

    try:
        shown = lines()
    except DwarfStarError as e:
        shown = [f"{what}: INVALID: {e}"]
    typer.echo("")
    for line in shown:
        typer.echo(line)


def _show_parts(gguf_set: GGUFSet) -> None:
    from dwarfstar.gguf.split import PartName, set_problem

    problem = set_problem(gguf_set)
    where = gguf_set.parts[0].path.parent
    typer.echo(
        f"split set of {len(gguf_set.parts)} parts in {where}, {len(gguf_set.tensors)} tensors: "
        + ("complete" if problem is None else f"INCOMPLETE: {problem}")
    )
    for part in gguf_set.parts:
        name = PartName.parse(part.path)
        size = sum(t.nbytes for t in part.tensors.values())
        typer.echo(
            f"  {part.path.name:48} {name.describe():18} GGUF v{part.version} {len(part.tensors):5d} tensors "
            f"{_gb(size):>12}"
        )
