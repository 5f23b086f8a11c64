"""Convert a DeepSeek V4 checkpoint (`config.json` + `*.safetensors`) into a ds4-layout GGUF.

Both the official checkpoint layout and transformers' `save_pretrained` layout are accepted (names and
config dialects are handled in `names` and `hf_config`). Conversion is two steps, so a caller can show
progress against a known total and print the notes before the long part starts:

    plan = plan_conversion(src_dir, "q8_0")   # reads config + safetensors headers, checks every tensor
    write_gguf(plan, out_path, progress)      # streams tensor by tensor, expert by expert, in row bands

`convert_checkpoint` does both, quietly. Every source tensor is dequantized to float32 in torch and then
encoded in the GGUF type the output type's policy picks for it (`gguf_type`).

A checkpoint with a DSpark drafter (V4 Flash 0731, PRO 0813: `dspark_*` config keys, stages under
`mtp.{k}.`) converts its trunk alone, unless asked (`dspark=True`): then the plan also holds ds4's
support file for the drafter (`plan.support`), planned and encoded as the trunk's tensors are, and
`write_conversion` writes both.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.convert.checkpoint import ALL_ROWS, Checkpoint, CheckpointTensor
from dwarfstar.convert.fp8_fp4 import FP8_BLOCK
from dwarfstar.convert.hf_config import (
    dspark_args_from_hf_config,
    has_dspark_drafter,
    model_args_from_hf_config,
    read_checkpoint_config,
)
from dwarfstar.convert.hf_v41 import dspark_args41_from_hf_config, engram_rows, engram_source, v41_layout
from dwarfstar.convert.names import dspark_source_names, dspark_source_names41, source_names
from dwarfstar.engram.rows import ROW_VALUES
from dwarfstar.errors import ConfigError, DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGUF_DEFAULT_ALIGNMENT, GGMLType, ValueType
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import MODEL_TYPE, ModelArgs41
from dwarfstar.model.dspark import dspark_tensors, support_metadata
from dwarfstar.model.dspark_v41 import dspark_tensors41, support_metadata41
from dwarfstar.model.tensors import EXPERT, INDEX, NORM, TensorSpec, expected_tensors
from dwarfstar.model.tensors_v41 import ENGRAM_ROWS
from dwarfstar.model.vision import VISION_EXP
from dwarfstar.model.vision_file import LM_SIDECAR_KEY, LM_VARIANT_KEY
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, tokenizer_metadata


class OutType(StrEnum):
    """What the output holds: everything F32, matrices F16, ds4's Q8_0 layout, or that layout with the
    routed experts in MXFP4 (ds4's files that keep the official FP4 experts)."""

    F32 = "f32"
    F16 = "f16"
    Q8_0 = "q8_0"
    Q8_0_MXFP4 = "q8_0-mxfp4"


# llama.cpp's `llama_ftype` for `general.file_type`, and ggml's current quantization format version
_FILE_TYPE = {OutType.F32: 0, OutType.F16: 1, OutType.Q8_0: 7, OutType.Q8_0_MXFP4: 38}  # 38: MOSTLY_MXFP4_MOE
GGML_QUANTIZATION_VERSION = 2

# Called after each piece is written: (GGUF tensor name, number of values just written).
Progress = Callable[[str, int], None]
# Matrices are read, dequantized and encoded in bands of rows of about this many values, so memory stays
# bounded (float32 copy plus the encoder's temporaries, a few hundred MB) even for the 129280-row head.
PIECE_VALUES = 1 << 22


@dataclass(frozen=True)
class TensorPlan:
    spec: TensorSpec
    ggml_type: GGMLType
    sources: tuple[CheckpointTensor, ...]  # one tensor, or one per routed expert, stacked in order

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class ConversionPlan:
    checkpoint: Checkpoint
    args: ModelArgs | ModelArgs41
    outtype: OutType
    metadata: dict[str, tuple[ValueType, Any]]
    tensors: list[TensorPlan]
    notes: list[str]  # things a user should know, e.g. skipped tensors
    support: ConversionPlan | None = None  # the DSpark drafter's support file, when asked for

    @property
    def total_elements(self) -> int:
        return sum(math.prod(t.spec.shape) for t in self.tensors)


def convert_checkpoint(
    src_dir: str | Path,
    out_path: str | Path,
    outtype: OutType | str = OutType.F16,
    *,
    name: str | None = None,
    dspark: str | Path | None = None,
    progress: Progress | None = None,
) -> ConversionPlan:
    """Convert `src_dir` into the GGUF `out_path`, and its DSpark drafter into the support file `dspark`
    when given; returns the plan that was written (with its notes)."""
    check_outputs(out_path, dspark)
    plan = plan_conversion(src_dir, outtype, name=name, dspark=dspark is not None)
    write_conversion(plan, out_path, dspark, progress)
    return plan


def check_outputs(
    out_path: str | Path | None, support_path: str | Path | None = None, vision_path: str | Path | None = None
) -> None:
    """Refuse an output path given twice (the trunk's, `--dspark`'s, `--vision`'s), before any work starts."""
    seen: dict[Path, str] = {}
    for label, path in (("the output path", out_path), ("--dspark", support_path), ("--vision", vision_path)):
        if path is None:
            continue
        where = Path(path).resolve()
        if where in seen:
            raise DwarfStarError(f"{label} {path} is {seen[where]} too; give each file its own name")
        seen[where] = label if label == "the output path" else f"the {label} path"


def plan_conversion(
    src_dir: str | Path,
    outtype: OutType | str = OutType.F16,
    *,
    name: str | None = None,
    dspark: bool = False,
    elsewhere: Collection[str] = (),
) -> ConversionPlan:
    """Read the config and the safetensors headers, and map every GGUF tensor to its source and type;
    with `dspark`, the drafter's support file too (a checkpoint without one is an error). `elsewhere`:
    the checkpoint tensors another file of the same conversion writes (`--vision`'s encoder), which
    are not skipped. A Vision-Exp checkpoint's language file says so as ds4's does (its variant, and
    that it needs its encoder file).

    Everything that can be checked without reading tensor data is checked here, so a missing or
    mis-shaped tensor fails before any output is written. `name` defaults to the directory name.
    """
    src = Path(src_dir)
    kind = _outtype(outtype)
    config = read_checkpoint_config(src)
    if config.get("model_type") == MODEL_TYPE:
        return _plan_v41(src, config, kind, name, dspark, elsewhere)
    args = model_args_from_hf_config(config)
    d = dspark_args_from_hf_config(config, args) if dspark else None
    notes: list[str] = []
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        tokenizer = bundled_tokenizer_json()
        notes.append(f"no tokenizer.json in {src}: using the bundled DeepSeek V4 tokenizer")
    _check_tokenizer_size(tokenizer, args.vocab_size)
    specs = list(expected_tensors(args))
    sources = {spec.name: source_names(spec.name, args.n_routed_experts) for spec in specs}
    support_specs = list(dspark_tensors(args, d)) if d else []
    if d:
        sources |= dspark_source_names(args, d)
    checkpoint, tensors, support_tensors = _plan_tensors(src, specs, support_specs, sources, kind, elsewhere, notes)
    if d is None and has_dspark_drafter(config):
        notes.append(
            "the checkpoint has a DSpark drafter (config.json's dspark_* keys, the mtp.* tensors): "
            "--dspark FILE writes it as ds4's support file"
        )
    vision_exp = any(key.startswith("vision_") and key != "vision_config" for key in config)
    if vision_exp and not elsewhere:
        notes.append(
            "the checkpoint has a vision encoder (config.json's vision_* keys): --vision FILE writes it as ds4's "
            "encoder file, which `--vision FILE` loads beside this model"
        )
    name = name or src.resolve().name
    metadata = args.to_gguf_metadata()
    if vision_exp:
        metadata[LM_VARIANT_KEY] = (ValueType.STRING, VISION_EXP)
        metadata[LM_SIDECAR_KEY] = (ValueType.BOOL, True)
    metadata["general.name"] = (ValueType.STRING, name)
    metadata.update(_file_metadata(kind))
    metadata.update(tokenizer_metadata(tokenizer, args.vocab_size))
    support = support_metadata(d, f"{name} DSpark support") if d else None
    return _with_support(ConversionPlan(checkpoint, args, kind, metadata, tensors, notes), support, support_tensors)


def _plan_v41(
    src: Path, config: dict[str, Any], kind: OutType, name: str | None, dspark: bool, elsewhere: Collection[str]
) -> ConversionPlan:
    """`plan_conversion` of a DeepSeek V4.1 checkpoint (`hf_v41`): ds4's `deepseek41` file, and with
    `dspark` the drafter's support file (`deepseek41-dspark`)."""
    tokenizer = src / "tokenizer.json"
    args, specs, metadata, notes = v41_layout(src, config, tokenizer if tokenizer.is_file() else None, dspark)
    if tokenizer.is_file():
        _check_tokenizer_size(tokenizer, args.vocab_size)
    d = dspark_args41_from_hf_config(config["text_config"], args) if dspark else None
    sources = {spec.name: source_names(spec.name, args.n_routed_experts) for spec in specs}
    support_specs = list(dspark_tensors41(args, d)) if d else []
    if d:
        sources |= dspark_source_names41(args, d)
    checkpoint, tensors, support_tensors = _plan_tensors(src, specs, support_specs, sources, kind, elsewhere, notes)
    name = name or src.resolve().name
    metadata["general.name"] = (ValueType.STRING, name)
    metadata.update(_file_metadata(kind))
    support = support_metadata41(d, f"{name} DSpark support") if d else None
    return _with_support(ConversionPlan(checkpoint, args, kind, metadata, tensors, notes), support, support_tensors)


def _with_support(plan: ConversionPlan, metadata: dict | None, tensors: list[TensorPlan]) -> ConversionPlan:
    """`plan` with the drafter's support file planned beside it, when there is one (`metadata`)."""
    if metadata is not None:
        kind = plan.outtype
        plan.support = ConversionPlan(plan.checkpoint, plan.args, kind, metadata | _file_metadata(kind), tensors, [])
    return plan


def _plan_tensors(
    src: Path,
    specs: list[TensorSpec],
    support_specs: list[TensorSpec],
    sources: dict[str, list[str]],
    kind: OutType,
    elsewhere: Collection[str],
    notes: list[str],
) -> tuple[Checkpoint, list[TensorPlan], list[TensorPlan]]:
    """Index the checkpoint, check every source is there, and plan the file's and the support file's
    tensors; `notes` gains the type fallbacks and the checkpoint tensors no file writes."""
    checkpoint = Checkpoint(src)
    check_all_present(checkpoint, sources)
    tensors = [_plan_tensor(checkpoint, spec, sources[spec.name], kind) for spec in specs]
    support_tensors = [_plan_tensor(checkpoint, spec, sources[spec.name], kind) for spec in support_specs]
    written = {source.name for tensor in tensors + support_tensors for source in tensor.sources} | set(elsewhere)
    notes += _fallback_notes(tensors + support_tensors, kind) + _skipped_notes(checkpoint, written)
    return checkpoint, tensors, support_tensors


def write_conversion(
    plan: ConversionPlan, out_path: str | Path, support_path: str | Path | None, progress: Progress | None = None
) -> None:
    """The trunk into `out_path` and the planned support file into `support_path` (distinct paths:
    `check_outputs`); on any error neither is left behind. The support file, much the smaller, is
    written first, so its errors come before the trunk's long write."""
    if plan.support is None or support_path is None:
        if plan.support is not None or support_path is not None:
            raise ValueError("a support file path goes with a plan that has a support file, and only then")
        write_gguf(plan, out_path, progress)
        return
    write_gguf(plan.support, support_path, progress)
    try:
        write_gguf(plan, out_path, progress)
    except BaseException:
        Path(support_path).unlink(missing_ok=True)
        raise


def write_gguf(plan: ConversionPlan, out_path: str | Path, progress: Progress | None = None) -> None:
    """Stream the planned tensors into `out_path` (atomically: on any error no file is left behind)."""
    out = check_out_path(out_path)
    alignment = plan.metadata.get("general.alignment", (ValueType.UINT32, GGUF_DEFAULT_ALIGNMENT))[1]
    with plan.checkpoint, GGUFWriter(out, plan.metadata, alignment) as writer:
        for tensor in plan.tensors:
            writer.add_tensor(tensor.name, tensor.spec.shape, tensor.ggml_type)
        for tensor in plan.tensors:
            writer.write_tensor(tensor.name, _encoded_pieces(plan, tensor, progress))


def check_out_path(out_path: str | Path) -> Path:
    """An output file's path, refused when it is a directory or its directory does not exist."""
    out = Path(out_path)
    if out.is_dir():
        raise DwarfStarError(f"output path {out} is a directory; give a .gguf file name")
    if not out.parent.is_dir():
        raise DwarfStarError(f"output directory {out.parent} does not exist")
    return out


def gguf_type(spec: TensorSpec, outtype: OutType) -> GGMLType:
    """The GGUF type a tensor gets for an output type (before the Q8_0 row-length fallback)."""
    if spec.types == INDEX:
        return GGMLType.I32
    if spec.types == ENGRAM_ROWS:
        return GGMLType.I8  # V4.1's Engram table: its stored rows, copied (hf_v41)
    if spec.types == NORM or outtype == OutType.F32:
        return GGMLType.F32  # norms, biases, sinks, HC scale/base: tiny, and ds4 requires F32
    # The official FP4 experts (e2m1 codes, an E8M0 scale per 32 columns) re-encode to MXFP4 without loss:
    # the encoder's exponent floor(log2 amax) - 2 puts the block's largest code at 4 or 6 (the E2M1
    # binade [4, 6]), and smaller largest codes are doubled, which E2M1 holds exactly (tests/test_convert.py).
    if outtype == OutType.Q8_0_MXFP4 and spec.types == EXPERT:
        return GGMLType.MXFP4
    # ds4's Q8_0 layout: every Q8_0-capable matrix except the embedding, which is gathered row by row and
    # stays F16 like the compressor, indexer, router and HC matrices.
    quantized = outtype in (OutType.Q8_0, OutType.Q8_0_MXFP4)
    if quantized and GGMLType.Q8_0 in spec.types and spec.name != "token_embd.weight":
        return GGMLType.Q8_0
    return GGMLType.F16


def _outtype(value: OutType | str) -> OutType:
    try:
        return OutType(value)
    except ValueError:
        choices = ", ".join(t.value for t in OutType)
        raise DwarfStarError(f"unknown output type {value!r}; choose one of {choices}") from None


def _file_metadata(outtype: OutType) -> dict[str, tuple[ValueType, Any]]:
    """What the output type makes of a file, for readers that check it (llama.cpp's keys)."""
    return {
        "general.file_type": (ValueType.UINT32, _FILE_TYPE[outtype]),
        "general.quantization_version": (ValueType.UINT32, GGML_QUANTIZATION_VERSION),
    }


def _plan_tensor(checkpoint: Checkpoint, spec: TensorSpec, names: list[str], outtype: OutType) -> TensorPlan:
    if spec.types == ENGRAM_ROWS:
        return TensorPlan(spec, GGMLType.I8, (engram_source(checkpoint, spec, names[0]),))
    sources = tuple(checkpoint.tensors[n] for n in names)
    # experts are stored 2-D, one per expert, and stacked along a new leading axis
    piece_shape = spec.shape[1:] if len(sources) > 1 else spec.shape
    for source in sources:
        _check_source(source, spec, piece_shape)
    ggml_type = gguf_type(spec, outtype)
    if spec.shape[-1] % BLOCK_GEOMETRY[ggml_type][0]:
        ggml_type = GGMLType.F16  # Q8_0 rows must be whole 32-value blocks; F16 is the nearest type that fits
    return TensorPlan(spec, ggml_type, sources)


def _check_source(source: CheckpointTensor, spec: TensorSpec, shape: tuple[int, ...]) -> None:
    if source.shape != shape:
        raise ModelFileError(
            f"checkpoint tensor {source.data.key!r} has shape {list(source.shape)}, "
            f"but {spec.name} needs {list(shape)} for this config.json"
        )
    wants_integers = spec.types == INDEX
    if source.is_integer != wants_integers:
        needed = "integer expert ids" if wants_integers else "floating-point values"
        raise ModelFileError(
            f"checkpoint tensor {source.data.key!r} is stored as {source.data.dtype}; {spec.name} needs {needed}"
        )


def check_all_present(checkpoint: Checkpoint, sources: dict[str, list[str]]) -> None:
    """Every GGUF tensor's checkpoint names (`sources`) are in the checkpoint; the first missing is named."""
    missing = [
        (name, gguf_name) for gguf_name, names in sources.items() for name in names if name not in checkpoint.tensors
    ]
    if missing:
        first, gguf_name = missing[0]
        needed = "" if gguf_name == first else f", needed for {gguf_name}"
        more = f" ({len(missing) - 1} more required tensors are missing too)" if len(missing) > 1 else ""
        raise ModelFileError(f"checkpoint in {checkpoint.directory} has no tensor {first!r}{needed}{more}")


def _fallback_notes(tensors: list[TensorPlan], outtype: OutType) -> list[str]:
    fallen = [t.name for t in tensors if t.ggml_type != gguf_type(t.spec, outtype)]
    if not fallen:
        return []
    listed = ", ".join(fallen[:4]) + (f" and {len(fallen) - 4} more" if len(fallen) > 4 else "")
    return [f"{len(fallen)} tensors have rows that are not a multiple of 32 values, written as F16 instead: {listed}"]


def _skipped_notes(checkpoint: Checkpoint, written: set[str]) -> list[str]:
    skipped = sorted(set(checkpoint.tensors) - written)
    if not skipped:
        return []
    # Group by the first two name parts, so the MTP block reads as one entry ("mtp.0.*: 812").
    groups = Counter(".".join(n.split(".")[:2]) for n in skipped)
    listed = ", ".join(f"{prefix}.* ({count})" if count > 1 else prefix for prefix, count in groups.items())
    return [f"skipping {len(skipped)} checkpoint tensors that the ds4 trunk layout does not use: {listed}"]


def _check_tokenizer_size(path: Path, vocab_size: int) -> None:
    """The tokenizer must define exactly the model's token ids: no more (unreachable) and no fewer."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        ids = [*spec["model"]["vocab"].values(), *(t["id"] for t in spec.get("added_tokens", []))]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"cannot read tokenizer {path}: {exc}") from exc
    size = max(ids) + 1
    if size != vocab_size:
        raise ConfigError(f"tokenizer {path} has {size} token ids, but config.json says vocab_size={vocab_size}")


def _encoded_pieces(plan: ConversionPlan, tensor: TensorPlan, progress: Progress | None) -> Iterator[Any]:
    """The tensor's GGUF bytes, one source tensor (one expert) and one band of rows at a time."""
    if tensor.ggml_type == GGMLType.I8:  # an Engram table: its stored rows
        for rows in engram_rows(plan.checkpoint, tensor.sources[0]):
            yield rows
            if progress is not None:
                progress(tensor.name, rows.shape[0] * ROW_VALUES)
        return
    for source in tensor.sources:
        for rows in _row_bands(source.shape):
            values = plan.checkpoint.read(source, rows)
            if tensor.ggml_type == GGMLType.I32:
                yield _expert_ids(values, source, plan.args.n_routed_experts)
            else:
                yield quantize(values, tensor.ggml_type)
            if progress is not None:
                progress(tensor.name, values.numel())


def _row_bands(shape: tuple[int, ...]) -> Iterator[slice]:
    """Row ranges of about PIECE_VALUES values, whole FP8 scale blocks each (GGUF rows are independent)."""
    if len(shape) == 1:
        yield ALL_ROWS
        return
    rows = max(PIECE_VALUES // math.prod(shape[1:]) // FP8_BLOCK, 1) * FP8_BLOCK
    for start in range(0, shape[0], rows):
        yield slice(start, min(start + rows, shape[0]))


def _expert_ids(values: torch.Tensor, source: CheckpointTensor, n_experts: int) -> np.ndarray:
    """tid2eid as I32, refusing ids that would index past the expert table at inference time."""
    if values.numel() and (values.min() < 0 or values.max() >= n_experts):
        raise ModelFileError(
            f"{source.data.key!r} holds expert ids {int(values.min())}..{int(values.max())}, outside 0..{n_experts - 1}"
        )
    return values.to(torch.int32).numpy()
