"""Tensor names: Hugging Face checkpoint dialects <-> ds4 GGUF names (spec §4.3 and §8.11).

Checkpoint keys are first brought to the official spelling (`canonical_name`), so the GGUF-side table
only has to know one dialect. transformers' `save_pretrained` differs from the official checkpoint by a
`model.` prefix, three renamed globals, `lm_head.weight` for `head.weight`, and `attn.norm.weight` for
the main attention's `attn.kv_norm.weight`. A DSpark drafter's tensors (`dspark_source_names`) are
named from the same table, as ds4's support file names them after the trunk's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark import MARKOV, PREFIX, DSparkArgs, dspark_tensors, stage_names
from dwarfstar.model.dspark_v41 import DSparkArgs41, dspark_tensors41, stage_names41
from dwarfstar.model.tensors import TensorSpec

_TRANSFORMERS_GLOBALS = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")

# GGUF global tensor -> official checkpoint name
_GLOBAL_SOURCES = {
    "token_embd.weight": "embed.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_scale.weight": "hc_head_scale",
    "output_hc_base.weight": "hc_head_base",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
}
# GGUF `blk.{i}.` suffix -> official name under `layers.{i}.`
_LAYER_SOURCES = {
    "hc_attn_fn.weight": "hc_attn_fn",
    "hc_attn_scale.weight": "hc_attn_scale",
    "hc_attn_base.weight": "hc_attn_base",
    "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_scale.weight": "hc_ffn_scale",
    "hc_ffn_base.weight": "hc_ffn_base",
    "attn_norm.weight": "attn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    # V4.1's own (tensors_v41): index keys from the compressor's latent, the image-route bias, Engram
    "indexer.attn_k.weight": "attn.indexer.wk.weight",
    "indexer.k_norm.weight": "attn.indexer.k_norm.weight",
    "exp_probs_b_vl.bias": "ffn.gate.bias_vl",
    "engram_q_norm.weight": "engram.q_weight",
    "engram_k_norm.weight": "engram.k_weight",
    "engram_kv.weight": "engram.wkv.weight",
    "engram_embd.weight": "engram.embed.weight",
}
# GGUF stacked routed-expert tensor -> the per-expert projection it stacks (w1 gate, w3 up, w2 down)
_EXPERT_SOURCES = {
    "ffn_gate_exps.weight": "w1",
    "ffn_up_exps.weight": "w3",
    "ffn_down_exps.weight": "w2",
}
_GGUF_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def canonical_name(key: str) -> str:
    """The official checkpoint name of a checkpoint key written in either dialect."""
    name = key.removeprefix("model.")
    name = _TRANSFORMERS_GLOBALS.get(name, name)
    layer = _LAYER_KEY.match(name)
    if layer and layer.group(2) == "attn.norm.weight":
        # Only the main attention's KV norm is renamed; compressor and indexer norms keep `.norm.`.
        name = f"layers.{layer.group(1)}.attn.kv_norm.weight"
    return name


def source_names(gguf_name: str, n_experts: int) -> list[str]:
    """Official checkpoint names whose data makes up GGUF tensor `gguf_name`, in storage order.

    One name for every tensor except the stacked routed experts, which take one per expert.
    """
    if gguf_name in _GLOBAL_SOURCES:
        return [_GLOBAL_SOURCES[gguf_name]]
    layer = _GGUF_LAYER_NAME.match(gguf_name)
    if layer:
        il, suffix = layer.groups()
        if suffix in _LAYER_SOURCES:
            return [f"layers.{il}.{_LAYER_SOURCES[suffix]}"]
        if suffix in _EXPERT_SOURCES:
            proj = _EXPERT_SOURCES[suffix]
            return [f"layers.{il}.ffn.experts.{e}.{proj}.weight" for e in range(n_experts)]
    # expected_tensors() and these tables describe the same layout; a miss is a bug, not bad input.
    raise KeyError(f"no checkpoint name is known for GGUF tensor {gguf_name!r}")


def dspark_source_names(args: ModelArgs, d: DSparkArgs) -> dict[str, list[str]]:
    """Every tensor of the DSpark support file for the trunk `args` -> the official checkpoint names of
    its data, in storage order (`drafter_source_names`)."""
    return drafter_source_names(stage_names(args, d), dspark_tensors(args, d), args.n_routed_experts)


def dspark_source_names41(args: ModelArgs41, d: DSparkArgs41) -> dict[str, list[str]]:
    """The same for V4.1's drafter: its stages are the layers after the trunk's, with their own experts,
    and its reference names the Markov head's two tables `embed` and `head` (`DSparkMarkovHead`)."""
    names = drafter_source_names(stage_names41(args, d), dspark_tensors41(args, d), d.n_experts)
    last = PREFIX.format(d.d.stages - 1)
    for file_name, official in zip(MARKOV, _MARKOV41, strict=True):
        names[last + file_name] = [last + official]
    return names


_MARKOV41 = ("markov_head.embed.weight", "markov_head.head.weight")  # V4.1's checkpoint names of MARKOV


def drafter_source_names(
    stages: Mapping[str, str], tensors: Iterable[TensorSpec], n_experts: int
) -> dict[str, list[str]]:
    """A support file's tensors -> the official checkpoint names of their data, in storage order, from
    `stages` (the stage model's tensor names -> the file's, `mtp.{k}.` names) and the file's `tensors`.

    The checkpoint names a stage as the trunk names a layer, under `mtp.{k}.` instead of `layers.{i}.`,
    and the last stage's output head (hc_head, norm) as the trunk's own, under that stage's prefix; the
    DSpark heads (main_proj, main_norm, markov_head, confidence_head) have the file's names.
    """
    stage_sources = {}
    for own, file_name in stages.items():
        sources = source_names(own, n_experts)
        stage = PREFIX.format(file_name.split(".")[1])
        layer = _GGUF_LAYER_NAME.match(own)
        trunk = f"layers.{layer.group(1)}." if layer else ""
        stage_sources[file_name] = [stage + s.removeprefix(trunk) for s in sources]
    return {spec.name: stage_sources.get(spec.name, [spec.name]) for spec in tensors}
