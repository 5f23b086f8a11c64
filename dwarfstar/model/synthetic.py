"""Deterministic random-weight DeepSeek V4 models in ds4 layout, for tests and benches.

The real weights can never be downloaded on our machines, so every code path runs on models made
here. Presets keep the real ratios (4 and 128) and the real vocabulary, and shrink the rest:

* `tiny`: hidden 64, 6 layers in the Flash pattern (2 window-only, then ratio 4 / ratio 128), a raw
  window of 8 and indexer top-k 4, so a few hundred tokens fill the windows, emit rows in both
  compressed kinds and make the indexer choose a strict subset.
* `tiny-k`: hidden and expert widths of 256, so Q2_K, Q4_K and IQ2_XXS blocks can hold the experts.
* `flash-shaped`: the exact Flash dimensions with 2 layers (one ratio 4, one ratio 128), for benches.
* `pro-shaped`: the exact PRO dimensions (hidden 7168, 128 heads, 384 experts) with 2 layers (ratio
  128, then ratio 4), for benches; 18.0 GB in the ds4 layout (flash-shaped: 5.6 GB).

and vision encoders in ds4's encoder-GGUF layout (`write_synthetic_vision`, `VISION_PRESETS`):

* `vision-tiny`: `model.vision.VISION_TINY` (2 ViT blocks of width 64, output the width of `tiny`),
  Vision-Exp, with image router biases for `tiny`'s 6 layers and 8 experts (and one MTP layer, as
  `write_synthetic_mtp` writes for it);
* `vision-exp-shaped`: the exact Vision-Exp encoder (32 blocks of width 1024, output 4096, 933 MB),
  with the biases for Flash's 43 layers, 3 MTP layers and 256 experts, as ds4's sidecar.

`preset_with_layers` gives any preset another layer count (`synth --layers N`).

Float weights are drawn N(0, 1/fan_in) so activations stay O(1); K-quant experts are random
well-formed blocks (sane fp16 scales, random payload) until real quantizers exist.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, QK_K, GGMLType, ValueType
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import ModelArgs, flash_compress_ratios, pro_compress_ratios
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark import DSparkArgs, dspark_tensors, support_metadata
from dwarfstar.model.tensors import EXPERT, NORM, TensorSpec, expected_tensors, mtp_tensors
from dwarfstar.model.vision import VISION_EXP, VISION_TINY, VisionArgs
from dwarfstar.model.vision_file import RouterShape, vision_metadata
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, tokenizer_metadata

TINY = ModelArgs(
    n_layers=6,
    dim=64,
    n_heads=4,
    head_dim=128,
    rope_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    n_activated_experts=2,
    moe_inter_dim=32,
    n_hash_layers=3,
    window=8,
    compress_ratios=flash_compress_ratios(6),
    index_n_heads=16,
    index_head_dim=64,
    index_topk=4,
    max_seq_len=65536,
)
TINY_K = TINY.with_(dim=256, moe_inter_dim=256, q_lora_rank=64, o_lora_rank=64)
FLASH_SHAPED = ModelArgs.flash().with_(n_layers=2, n_hash_layers=1, compress_ratios=(4, 128))
# PRO's first layers are ratio 128 (not window-only), so its 2 layers keep PRO's order: 128, then 4
PRO_SHAPED = ModelArgs.pro().with_(n_layers=2, n_hash_layers=1, compress_ratios=(128, 4))

PRESETS: dict[str, ModelArgs] = {
    "tiny": TINY,
    "tiny-k": TINY_K,
    "flash-shaped": FLASH_SHAPED,
    "pro-shaped": PRO_SHAPED,
}
# vision encoder presets: the encoder, and the router biases for the language model it pairs with
VISION_PRESETS: dict[str, tuple[VisionArgs, RouterShape]] = {
    "vision-tiny": (VISION_TINY, RouterShape(TINY.n_layers, TINY.n_routed_experts, TINY.n_hash_layers, 1)),
    "vision-exp-shaped": (VisionArgs(), RouterShape(43, 256, 3, 3)),  # Flash's 43 layers, 3 MTP, 256 experts
}


def preset_with_layers(preset: str, n_layers: int) -> ModelArgs:
    """A preset's dimensions with `n_layers` layers in its family's compression pattern (PRO's for
    pro-shaped, Flash's for the others) and up to 3 hash-routed layers, as the real models have: a
    Flash-shaped file larger than a machine's memory (`synth --layers 14` is 27.3 GiB in ds4 layout)."""
    ratios = pro_compress_ratios if preset == "pro-shaped" else flash_compress_ratios
    hash_layers = min(ModelArgs.flash().n_hash_layers, n_layers)
    return PRESETS[preset].with_(n_layers=n_layers, n_hash_layers=hash_layers, compress_ratios=ratios(n_layers))


# Which type each tensor gets. "f32" keeps every float tensor F32 (parity runs); "ds4" follows the
# published files: Q8_0 projections, F16 embeddings/HC/compressor/indexer/router, F32 norms, and the
# q2 recipe for routed experts (IQ2_XXS gate/up, Q2_K down); "ds4-mxfp4" is "ds4" with every routed
# expert in MXFP4, as ds4's files that keep the official FP4 experts.
_DS4_F16 = ("token_embd", "hc_", "compressor", "indexer", "ffn_gate_inp", "engram")
LAYOUTS = ("f32", "ds4", "ds4-mxfp4")
MTP_SEED_OFFSET = 500_000  # a separate MTP file's tensors draw from other streams than the trunk's
DSPARK_SEED_OFFSET = 700_000  # and a DSpark support file's from others again
VISION_SEED_OFFSET = 900_000  # and a vision encoder's from others again


@dataclass(frozen=True)
class ExpertRecipe:
    gate_up: GGMLType
    down: GGMLType


Q2 = ExpertRecipe(GGMLType.IQ2_XXS, GGMLType.Q2_K)
MXFP4 = ExpertRecipe(GGMLType.MXFP4, GGMLType.MXFP4)


def layout_experts(layout: str) -> ExpertRecipe:
    return MXFP4 if layout == "ds4-mxfp4" else Q2


def tensor_type(spec: TensorSpec, layout: str, experts: ExpertRecipe = Q2) -> GGMLType:
    if len(spec.types) == 1:  # a pinned type: F32 norms, the I32 hash table, V4.1's I8 Engram rows
        return next(iter(spec.types))
    if layout == "f32":
        return GGMLType.F32
    short = _short_name(spec.name)
    if spec.types == EXPERT:
        return experts.down if "down" in short else experts.gate_up
    if any(part in short for part in _DS4_F16):
        return GGMLType.F16
    return GGMLType.Q8_0


def _short_name(name: str) -> str:
    """Tensor name without the `blk.N.` prefix and the `.weight`/`.bias` suffix."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return ".".join(parts[:-1])


def write_synthetic_model(
    path: str | os.PathLike,
    args: ModelArgs,
    layout: str = "f32",
    seed: int = 0,
    name: str = "synthetic",
    progress: Callable[[str], None] | None = None,
    in_file_mtp: bool = False,
) -> None:
    """Write a random model; the same (args, layout, seed) always gives the same bytes. `in_file_mtp`
    adds a random MTP block in llama.cpp's in-file layout (the trunk's tensors are unchanged by it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}, expected one of {LAYOUTS}")

    def data(index: int, spec: TensorSpec, ggml_type: GGMLType) -> Iterator:
        if progress:
            progress(spec.name)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return tensor_chunks(spec, ggml_type, args, gen)

    experts = layout_experts(layout)
    write_model_gguf(path, args, name, lambda spec: tensor_type(spec, layout, experts), data, in_file_mtp)


def write_synthetic_mtp(path: str | os.PathLike, args: ModelArgs, layout: str = "f32", seed: int = 0) -> None:
    """A random MTP block for the trunk `args` as ds4 ships it: a separate GGUF of `mtp.0.*` tensors,
    whose metadata is the trunk's config (ds4's loader reads none of it; ours checks it names the model)."""
    metadata = args.to_gguf_metadata()
    metadata["general.name"] = (ValueType.STRING, "synthetic-mtp")
    write_draft(path, args, metadata, mtp_tensors(args, "ds4"), layout, seed * 1_000_003 + MTP_SEED_OFFSET)


def write_synthetic_dspark(
    path: str | os.PathLike, args: ModelArgs, d: DSparkArgs, layout: str = "f32", seed: int = 0
) -> None:
    """A random DSpark drafter for the target `args` as ds4 ships it: a support GGUF of `mtp.{0..}.*`
    tensors whose metadata is the `dspark.*` keys."""
    metadata = support_metadata(d, "synthetic-dspark")
    write_draft(path, args, metadata, dspark_tensors(args, d), layout, seed * 1_000_003 + DSPARK_SEED_OFFSET)


def write_synthetic_vision(
    path: str | os.PathLike,
    args: VisionArgs,
    seed: int = 0,
    router: RouterShape | None = None,
    name: str = "synthetic-vision",
) -> None:
    """A random vision encoder as ds4 ships it: `deepseek4-vision` metadata (`vision_metadata`), BF16
    tensors under the checkpoint's names, then, for a Vision-Exp encoder given the language model's
    `router`, its F32 router biases (`RouterShape.tensor_names`); a V4.1 encoder states the language
    model's layers and experts but carries no biases, as ds4's. The same arguments write the same bytes."""
    tensors = synthetic_vision_tensors(args, seed, router)
    language = None if router is None else (router.n_layers, router.n_experts)
    with GGUFWriter(path, vision_metadata(args, name, language)) as writer:
        for tensor_name, shape, ggml_type, _ in tensors:
            writer.add_tensor(tensor_name, shape, ggml_type)
        for tensor_name, _, ggml_type, draw in tensors:
            writer.write_tensor(tensor_name, quantize(draw(), ggml_type))


def synthetic_vision_tensors(
    args: VisionArgs, seed: int = 0, router: RouterShape | None = None
) -> list[tuple[str, tuple[int, ...], GGMLType, Callable[[], torch.Tensor]]]:
    """The tensors `write_synthetic_vision` writes, in file order: (name, [out, in] shape, type, draw),
    `draw()` giving their float32 values, each from its own stream of `seed`: N(0, 1/fan_in) matrices,
    1 ± 0.1 norm weights, small linear biases, unit-scale image rows, router biases 0.5 · N(0, 1)."""
    specs = [(name, shape, GGMLType.BF16) for name, shape in args.tensor_shapes().items()]
    if router is not None and args.family == VISION_EXP:
        specs += [(bias, (router.n_experts,), GGMLType.F32) for bias in router.tensor_names()]
    base = seed * 1_000_003 + VISION_SEED_OFFSET
    return [
        (name, shape, ggml_type, functools.partial(_vision_values, name, shape, base + index))
        for index, (name, shape, ggml_type) in enumerate(specs)
    ]


def _vision_values(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if ".ffn.gate." in name:  # the language model's router biases
        return 0.5 * x
    if "norm" in name:
        return 1.0 + 0.1 * x
    if name.endswith(".bias"):
        return 0.02 * x
    if len(shape) == 1:  # image_start, image_newline...: rows in the language model's embedding space
        return x
    return x / shape[-1] ** 0.5


def write_draft(
    path: str | os.PathLike,
    args: ModelArgs | ModelArgs41,
    metadata: dict,
    inventory: Iterable[TensorSpec],
    layout: str,
    seed: int,
) -> None:
    """A separate draft file of random tensors, tensor i drawn from seed + i."""
    specs = [(spec, tensor_type(spec, layout, layout_experts(layout))) for spec in inventory]
    with GGUFWriter(path, metadata) as writer:
        for spec, ggml_type in specs:
            writer.add_tensor(spec.name, spec.shape, ggml_type)
        for index, (spec, ggml_type) in enumerate(specs):
            gen = torch.Generator().manual_seed(seed + index)
            writer.write_tensor(spec.name, tensor_chunks(spec, ggml_type, args, gen))


def write_model_gguf(
    path: str | os.PathLike,
    args: ModelArgs,
    name: str,
    type_of: Callable[[TensorSpec], GGMLType],
    data_of: Callable[[int, TensorSpec, GGMLType], Iterator],
    in_file_mtp: bool = False,
) -> None:
    """Write a ds4-layout GGUF: the config and V4 tokenizer metadata, then every tensor of the inventory
    in order, with the type `type_of(spec)` and the bytes `data_of(index, spec, type)` yields.

    `in_file_mtp` appends an MTP block in llama.cpp's layout (`blk.{n}.nextn.*`, counted in block_count)."""
    file_args = args
    if in_file_mtp:
        file_args = args.with_(
            n_layers=args.n_layers + 1, compress_ratios=(*args.compress_ratios[: args.n_layers], 0), n_mtp_layers=1
        )
    metadata = file_args.to_gguf_metadata()
    metadata["general.name"] = (ValueType.STRING, name)
    metadata.update(tokenizer_metadata(bundled_tokenizer_json(), args.vocab_size))
    inventory = [*expected_tensors(args), *(mtp_tensors(args, "nextn") if in_file_mtp else ())]
    specs = [(spec, type_of(spec)) for spec in inventory]
    with GGUFWriter(path, metadata) as writer:
        for spec, ggml_type in specs:
            writer.add_tensor(spec.name, spec.shape, ggml_type)
        for index, (spec, ggml_type) in enumerate(specs):
            writer.write_tensor(spec.name, data_of(index, spec, ggml_type))


def tensor_chunks(
    spec: TensorSpec, ggml_type: GGMLType, args: ModelArgs | ModelArgs41, gen: torch.Generator
) -> Iterator:
    """Yield the tensor's bytes in row chunks of about 16M elements, so Flash shapes stream."""
    short = _short_name(spec.name)
    if ggml_type == GGMLType.I32:  # token -> expert table: k distinct experts per token
        ranks = torch.rand(args.vocab_size, args.n_routed_experts, generator=gen).argsort(dim=1)
        yield ranks[:, : args.n_activated_experts].to(torch.int32).numpy()
        return
    row = spec.shape[-1]
    n_rows = int(np.prod(spec.shape[:-1], dtype=np.int64)) if len(spec.shape) > 1 else 1
    rows_per_chunk = max(1, (1 << 24) // row)
    for start in range(0, n_rows, rows_per_chunk):
        count = min(rows_per_chunk, n_rows - start)
        if ggml_type in (GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS):
            yield _random_kquant_blocks(ggml_type, count * row, row, gen)
            continue
        values = _random_values(short, spec, (count, row), gen)
        yield quantize(values.reshape(-1) if len(spec.shape) == 1 else values, ggml_type)


def _random_values(short: str, spec: TensorSpec, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if spec.types == NORM:
        if "norm" in short:
            return 1.0 + 0.1 * x
        if "hc_" in short and "scale" in short:
            return 0.2 + 0.3 * x.abs()
        return 0.5 * x  # sinks, HC bases, router bias
    if short == "token_embd":
        return x
    if short.endswith("ape"):
        return 0.5 * x
    return x / spec.shape[-1] ** 0.5


def _random_kquant_blocks(ggml_type: GGMLType, n_elements: int, row: int, gen: torch.Generator) -> np.ndarray:
    """Random well-formed super-blocks: random payload bytes, fp16 scales sized for ~N(0, 1/row)."""
    _, block_bytes = BLOCK_GEOMETRY[ggml_type]
    n_blocks = n_elements // QK_K
    payload = torch.randint(0, 256, (n_blocks, block_bytes), generator=gen, dtype=torch.uint8).numpy()
    d = np.float16(0.5 / row**0.5)
    blocks = payload.copy()
    halves = np.array([d, d / 4], dtype=np.float16).view(np.uint8)
    if ggml_type == GGMLType.IQ2_XXS:  # f16 d first
        blocks[:, 0:2] = halves[0:2]
    elif ggml_type == GGMLType.Q2_K:  # scales[16], qs[64], then f16 d, f16 dmin
        blocks[:, 80:84] = halves
    else:  # Q4_K: f16 d, f16 dmin first
        blocks[:, 0:4] = halves
    return blocks
