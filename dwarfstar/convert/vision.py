"""`dwarfstar convert --vision`: a checkpoint's vision encoder -> ds4's encoder GGUF (issue 34).

DeepSeek V4 Flash Vision-Exp (flat `vision_*` config keys) and V4.1 Flash (`vision_config`) keep their
encoder in the same checkpoint as the language model; ds4 ships it as a separate GGUF that `--vision`
loads (`model.vision_file`). Its writers keep the checkpoint's tensor names and copy the payloads byte
for byte (shared/spec/RELEASES_2026.md), and so does this:

- the encoder's tensors (`VisionArgs.tensor_shapes`: ViT, aligner, image rows), stored as BF16;
- for Vision-Exp, the language model's router biases for image tokens, stored as F32: every layer's
  `layers.{i}.ffn.gate.bias_vl`, the MTP layers' `mtp.{j}.ffn.gate.bias_vl` and the hash-routed
  layers' text bias `layers.{i}.ffn.gate.bias` (`RouterShape.tensor_names`). V4.1's language file
  carries its own, so its encoder file has none;
- ds4's metadata (`vision_metadata`), the language model's layers and experts included.

Like `hf.plan_conversion`, `plan_vision` checks every tensor's presence, shape and storage type from
the safetensors headers before anything is written; `write_vision` then reads one tensor at a time (the
largest, the aligner's first matrix, 75 MB) and the language model's tensors are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dwarfstar.convert.checkpoint import Checkpoint, CheckpointTensor
from dwarfstar.convert.hf import Progress, check_all_present, check_out_path
from dwarfstar.convert.hf_config import VisionConfig, read_checkpoint_config, vision_config_from_hf_config
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.vision_file import vision_metadata

# the GGUF type of each checkpoint storage type ds4's writers accept, as safetensors names it
_STORED_AS = {GGMLType.BF16: "BF16", GGMLType.F32: "F32"}


@dataclass(frozen=True)
class VisionTensor:
    source: CheckpointTensor  # its name is the GGUF name too
    ggml_type: GGMLType


@dataclass
class VisionPlan:
    checkpoint: Checkpoint
    config: VisionConfig
    metadata: dict[str, tuple[ValueType, Any]]
    tensors: list[VisionTensor]

    @property
    def total_elements(self) -> int:
        return sum(t.source.n_elements for t in self.tensors)


def plan_vision(src_dir: str | Path, *, name: str | None = None) -> VisionPlan:
    """Read the config and the safetensors headers, and check every tensor of the encoder file: there,
    shaped for the config, stored as ds4 copies it. `name` defaults to the directory's."""
    src = Path(src_dir)
    config = vision_config_from_hf_config(read_checkpoint_config(src))
    wanted = {name: (shape, GGMLType.BF16) for name, shape in config.args.tensor_shapes().items()}
    if config.router is not None:
        wanted |= {bias: ((config.router.n_experts,), GGMLType.F32) for bias in config.router.tensor_names()}
    checkpoint = Checkpoint(src)
    check_all_present(checkpoint, {tensor: [tensor] for tensor in wanted})
    tensors = []
    for tensor, (shape, ggml_type) in wanted.items():
        source = checkpoint.tensors[tensor]
        _check_source(source, shape, ggml_type)
        tensors.append(VisionTensor(source, ggml_type))
    label = f"{name or src.resolve().name} vision encoder"
    return VisionPlan(checkpoint, config, vision_metadata(config.args, label, config.language), tensors)


def write_vision(plan: VisionPlan, out_path: str | Path, progress: Progress | None = None) -> None:
    """Copy the planned tensors into `out_path` (atomically: on any error no file is left behind)."""
    out = check_out_path(out_path)
    with plan.checkpoint, GGUFWriter(out, plan.metadata) as writer:
        for tensor in plan.tensors:
            writer.add_tensor(tensor.source.name, tensor.source.shape, tensor.ggml_type)
        for tensor in plan.tensors:
            writer.write_tensor(tensor.source.name, plan.checkpoint.read_stored(tensor.source))
            if progress is not None:
                progress(tensor.source.name, tensor.source.n_elements)


def convert_vision(
    src_dir: str | Path,
    out_path: str | Path,
    *,
    name: str | None = None,
    progress: Progress | None = None,
) -> VisionPlan:
    """Write the vision encoder of the checkpoint `src_dir` into `out_path`; returns the plan written."""
    plan = plan_vision(src_dir, name=name)
    write_vision(plan, out_path, progress)
    return plan


def _check_source(source: CheckpointTensor, shape: tuple[int, ...], ggml_type: GGMLType) -> None:
    if source.shape != shape:
        raise ModelFileError(
            f"checkpoint tensor {source.data.key!r} has shape {list(source.shape)}, "
            f"but the vision encoder needs {list(shape)} for this config.json"
        )
    stored = _STORED_AS[ggml_type]
    if source.scale is not None or source.data.dtype != stored:
        how = f"{source.data.dtype}, block-scaled" if source.scale is not None else source.data.dtype
        raise ModelFileError(
            f"checkpoint tensor {source.data.key!r} is stored as {how}; ds4's vision encoder file copies it "
            f"as {stored}, which it must be"
        )
