"""ds4's quantization recipes and the streaming `quantize` that applies one to a model file.

Only the routed experts change between recipes; every other tensor gets ds4's fixed type (Q8_0
projections and shared expert, F16 embedding/HC/compressor/indexer/router, F32 norms, I32 hash table):

    recipe  gate/up exps   down exps   notes
    q2      IQ2_XXS        Q2_K        ds4's 2-bit files (~81 GiB for Flash)
    q2-q4   IQ2_XXS        Q2_K        but the last 6 layers' experts all Q4_K (ds4's layers 37-42 splice)
    q4      Q4_K           Q4_K        ds4's 4-bit files (~153 GiB)
    q8      Q8_0           Q8_0        a near-lossless reference
    mxfp4   MXFP4          MXFP4       ds4's files that keep the official FP4 experts (MXFP4 input: copied)

The output keeps the input's metadata (tokenizer included) and adds `quantize.recipe`, plus ds4's
`quantize.imatrix.*` keys when an imatrix steered the encoders.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType, ValueType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.reader import GGUFFile, TensorInfo
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.model.synthetic import MXFP4, ExpertRecipe, tensor_type
from dwarfstar.model.tensors import expected_tensors
from dwarfstar.quant.imatrix import Imatrix, check_imatrix

Q2 = ExpertRecipe(GGMLType.IQ2_XXS, GGMLType.Q2_K)
Q4 = ExpertRecipe(GGMLType.Q4_K, GGMLType.Q4_K)
Q8 = ExpertRecipe(GGMLType.Q8_0, GGMLType.Q8_0)
RECIPES = ("q2", "q2-q4", "q4", "q8", "mxfp4")
Q4_TAIL_LAYERS = 6  # q2-q4: ds4's best mixed file upgrades the experts of the last six layers

# Rows per chunk when a tensor is not split by expert: ~16M elements, so embeddings stream too.
_CHUNK_ELEMENTS = 1 << 24


class RecipeError(DwarfStarError):
    """An unknown recipe, or a model the recipe cannot encode."""


def expert_recipe(recipe: str, layer: int, n_layers: int) -> ExpertRecipe:
    if recipe not in RECIPES:
        raise RecipeError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if recipe == "q2-q4":
        return Q4 if layer >= n_layers - Q4_TAIL_LAYERS else Q2
    return {"q2": Q2, "q4": Q4, "q8": Q8, "mxfp4": MXFP4}[recipe]


def recipe_types(args: ModelArgs, recipe: str) -> dict[str, GGMLType]:
    """The ggml type of every tensor of a model with `args` under `recipe`, in file order."""
    types = {}
    for spec in expected_tensors(args):
        layer = int(spec.name.split(".")[1]) if spec.name.startswith("blk.") else -1
        experts = expert_recipe(recipe, layer, args.n_layers)
        ggml_type = tensor_type(spec, "ds4", experts)
        block = BLOCK_GEOMETRY[ggml_type][0]
        if spec.shape[-1] % block:
            raise RecipeError(
                f"recipe {recipe} puts {spec.name} in {ggml_type.name}, which needs rows that are multiples of "
                f"{block}; this model's rows are {spec.shape[-1]} wide"
            )
        types[spec.name] = ggml_type
    return types


def output_metadata(src: GGUFFile, recipe: str, imatrix: Imatrix | None) -> dict[str, tuple[ValueType, Any]]:
    meta = {k: v for k, v in src.typed_metadata().items() if not k.startswith("quantize.")}
    meta.pop("general.file_type", None)  # it named the input's type; the recipe key says what this file is
    meta["quantize.recipe"] = (ValueType.STRING, recipe)
    if imatrix is not None:
        meta["quantize.imatrix.file"] = (ValueType.STRING, imatrix.source)
        meta["quantize.imatrix.dataset"] = (ValueType.STRING, imatrix.dataset)
        meta["quantize.imatrix.entries_count"] = (ValueType.UINT64, len(imatrix.entries))
        meta["quantize.imatrix.chunks_count"] = (ValueType.UINT64, imatrix.chunks)
    return meta


def _tensor_chunks(
    src: GGUFFile, info: TensorInfo, target: GGMLType, importance: torch.Tensor | None
) -> Iterator[np.ndarray]:
    """The tensor's bytes in `target`, one expert or ~16M elements at a time."""
    raw = src.raw(info.name)
    if info.ggml_type == target:  # already in the right type: copy, never requantize
        yield raw
        return
    cols = info.shape[-1]
    n_rows = info.n_elements // cols
    # experts go one at a time so each gets its own importance; other tensors in row chunks
    rows_per_chunk = info.shape[-2] if len(info.shape) == 3 else max(1, _CHUNK_ELEMENTS // cols)
    row_bytes = info.nbytes // n_rows
    for start in range(0, n_rows, rows_per_chunk):
        count = min(rows_per_chunk, n_rows - start)
        values = dequantize(raw[start * row_bytes : (start + count) * row_bytes], info.ggml_type, count * cols)
        weight = None
        if importance is not None:
            weight = importance[start // rows_per_chunk] if len(info.shape) == 3 else importance
        yield quantize(values.reshape(count, cols), target, weight)


def quantize_model(
    src_path: str | os.PathLike,
    dst_path: str | os.PathLike,
    recipe: str,
    imatrix: Imatrix | None = None,
    progress: Callable[[str, GGMLType, GGMLType], None] | None = None,
) -> None:
    """Write `src_path` re-encoded with `recipe`, tensor by tensor, in bounded memory."""
    if Path(src_path).resolve() == Path(dst_path).resolve():
        raise DwarfStarError("the output must be a different file from the input")
    model: ModelFile = open_model(src_path)
    try:
        src = model.gguf
        types = recipe_types(model.args, recipe)
        # anything else in the file (an MTP block, say) is carried over as it is
        types.update({name: info.ggml_type for name, info in src.tensors.items() if name not in types})
        if imatrix is not None:
            check_imatrix(imatrix, src.tensors)
        with GGUFWriter(dst_path, output_metadata(src, recipe, imatrix), alignment=src.alignment) as writer:
            for name, ggml_type in types.items():
                writer.add_tensor(name, src.tensors[name].shape, ggml_type)
            for name, ggml_type in types.items():
                info = src.tensors[name]
                if progress:
                    progress(name, info.ggml_type, ggml_type)
                importance = imatrix.importance(name, info.shape) if imatrix is not None else None
                writer.write_tensor(name, _tensor_chunks(src, info, ggml_type, importance))
    finally:
        model.close()
