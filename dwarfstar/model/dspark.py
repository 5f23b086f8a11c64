"""DeepSeek V4 Flash 0731's DSpark drafter, over a backend's `Ops`: its files' tensors and its forward pass.

The drafter is `stages` (3) more V4 blocks (mHC, window-only attention with sinks, learned-routed MoE
with a shared expert; no compressor, no indexer, no hash routing) and three heads, and it drafts a
block of `block_size` (5) tokens in one pass:

- context: the target's streams after `target_layers` (40, 41, 42), each averaged over its hc copies
  and concatenated, give `main_x = RMSNorm(main_proj(...))` per committed position; each stage keeps
  `kv_norm(wkv(main_x))`, RoPE'd at that position, in its own raw window ring (`context`). These are
  the only rows a stage keeps; main_x enters nothing else.
- block: the embedding of [anchor, noise x (block_size - 1)] at the positions after the context, copied
  into the hc streams, runs through the stages; each query attends to its stage's ring and to every
  row of the block, both ways, and the block's rows are never kept (`block`).
- heads: the last stage's streams collapse (`hc_head`'s sigmoid weights), go through the drafter's
  output norm and the target's output matrix; the Markov head adds W2 . W1[previous token] to each
  row's logits (the anchor for the first, the row before's draft after that), and the confidence
  head reads [the collapsed row before the norm; W1[previous token]] (`heads`, in torch float32).

Positions: the anchor is the token the target just produced, at the context's end p + 1; the block
row i sits at p + 1 + i and predicts the token at p + 2 + i. Every fact here comes from the public
descriptions (DeepSeek's reference, vLLM, SGLang, ds4's support-file writer, DeepSpec), checked
against each other; dwarfstar/speculative/NOTES.md says where they disagree and what we follow.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import torch

from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.forward import A, Rows, S, Transformer
from dwarfstar.model.state import SequenceState
from dwarfstar.model.tensors import (
    ATTN_INPUT,
    DENSE,
    EMBED,
    HEAD_HC,
    NORM,
    OUTPUT,
    OUTPUT_NORM,
    QUERY_INPUT,
    ROUTER,
    TensorSpec,
    expected_tensors,
)

ARCH = "deepseek4-dspark"  # ds4's support file
ARCH41 = "deepseek41-dspark"  # V4.1's drafter (model/dspark_v41.py): ds4 publishes none; our own layout
FAMILIES = {ARCH: "DeepSeek V4", ARCH41: "DeepSeek V4.1"}  # the target family each support file drafts for
PREFIX = "mtp.{}."  # a stage's tensors: mtp.0. .. mtp.2.
MAIN = ("main_proj.weight", "main_norm.weight")  # stage 0: the context projection and its norm
HEAD = ("hc_head_fn.weight", "hc_head_scale.weight", "hc_head_base.weight", "norm.weight")  # the last stage
MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")  # [vocab, rank] each
CONFIDENCE = "confidence_head.proj.weight"  # [1, dim + rank]


def check_support_arch(metadata: Mapping[str, Any], arch: str, where: str, target: str) -> None:
    """Refuse a file that is not a DSpark support file of `arch`, naming the family a drafter of the other
    one drafts for (`target`: the model file it was given with)."""
    found = metadata.get("general.architecture")
    if found == arch:
        return
    if found in FAMILIES:
        raise ModelFileError(
            f"{where} is a DSpark drafter for {FAMILIES[found]} ({found}); {target} is {FAMILIES[arch]}: "
            "give the drafter made for this model"
        )
    raise ModelFileError(f"{where} is not a DSpark support file: general.architecture is {found!r}, not {arch!r}")


@dataclass(frozen=True)
class DSparkArgs:
    block_size: int = 5
    markov_rank: int = 256
    noise_token_id: int = 128799
    target_layers: tuple[int, ...] = (40, 41, 42)
    stages: int = 3

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], target: ModelArgs | ModelArgs41, where: str) -> DSparkArgs:
        """The support file's `dspark.*` keys, checked against the target model."""

        def key(name: str) -> Any:
            if f"dspark.{name}" not in metadata:
                raise ModelFileError(f"{where} is not a DSpark support file: it has no dspark.{name}")
            return metadata[f"dspark.{name}"]

        args = cls(
            block_size=int(key("block_size")),
            markov_rank=int(key("markov_rank")),
            noise_token_id=int(key("noise_token_id")),
            target_layers=tuple(int(i) for i in key("target_layer_ids")),
            stages=int(key("stage_count")),
        )
        args.check(target, where)
        return args

    def check(self, target: ModelArgs | ModelArgs41, where: str, error: type[DwarfStarError] = ModelFileError) -> None:
        """Refuse settings the drafter cannot run with on `target`, as `error` (a support file's
        metadata and a checkpoint's config.json are checked alike)."""
        if self.block_size < 2 or self.stages < 1 or self.markov_rank < 1 or not self.target_layers:
            raise error(f"{where}: DSpark shape out of range: {self}")
        if not 0 <= self.noise_token_id < target.vocab_size:
            raise error(
                f"{where}: the noise token {self.noise_token_id} is outside the target's vocabulary "
                f"of {target.vocab_size}"
            )
        if not all(0 <= i < target.n_layers for i in self.target_layers):
            raise error(
                f"{where} drafts for a model with layers {list(self.target_layers)}; "
                f"the target has {target.n_layers} (a drafter for another model)"
            )


def support_metadata(d: DSparkArgs, name: str) -> dict[str, tuple[ValueType, Any]]:
    """A support file's GGUF metadata: ds4's `dspark.*` keys (its provenance strings aside)."""
    u32 = ValueType.UINT32
    return {
        "general.architecture": (ValueType.STRING, ARCH),
        "general.name": (ValueType.STRING, name),
        "dspark.block_size": (u32, d.block_size),
        "dspark.markov_rank": (u32, d.markov_rank),
        "dspark.noise_token_id": (u32, d.noise_token_id),
        "dspark.target_layer_ids": (ValueType.ARRAY, (u32, list(d.target_layers))),
        "dspark.stage_count": (u32, d.stages),
        "dspark.n_layers": (u32, d.stages),
    }


def stage_args(target: ModelArgs, d: DSparkArgs) -> ModelArgs:
    """The stages as a model of the target's shapes: window-only attention (ratio 0, base RoPE, no
    YaRN) and learned top-k routing, never hashed."""
    return target.with_(n_layers=d.stages, compress_ratios=(0,) * d.stages, n_hash_layers=0, n_mtp_layers=0)


def stage_names(target: ModelArgs, d: DSparkArgs) -> dict[str, str]:
    """The stage model's tensor names -> the support file's; the embedding and the output matrix are
    the target's and keep their names."""
    names = {}
    for spec in expected_tensors(stage_args(target, d)):
        if spec.name.startswith("blk."):
            il, leaf = spec.name.removeprefix("blk.").split(".", 1)
            names[spec.name] = PREFIX.format(il) + leaf
    last = PREFIX.format(d.stages - 1)
    names.update({own: last + name for own, name in zip((*HEAD_HC, OUTPUT_NORM), HEAD, strict=True)})
    return names


def dspark_tensors(target: ModelArgs, d: DSparkArgs) -> Iterator[TensorSpec]:
    """Every tensor of a support file for `target` (file names, torch shapes)."""
    own = {spec.name: spec for spec in expected_tensors(stage_args(target, d)) if spec.name not in (EMBED, OUTPUT)}
    for own_name, file_name in stage_names(target, d).items():
        types = DENSE if own_name.endswith(ROUTER) else own[own_name].types  # ds4 writes the routers in Q8_0
        yield TensorSpec(file_name, own[own_name].shape, types)
    dim, rank, first, last = target.dim, d.markov_rank, PREFIX.format(0), PREFIX.format(d.stages - 1)
    yield TensorSpec(first + MAIN[0], (dim, len(d.target_layers) * dim), DENSE)
    yield TensorSpec(first + MAIN[1], (dim,), NORM)
    for name in MARKOV:
        yield TensorSpec(last + name, (target.vocab_size, rank), DENSE)
    yield TensorSpec(last + CONFIDENCE, (1, dim + rank), DENSE)


class DSparkForward(Generic[A, S]):
    """The drafter's passes over the stage model's `Ops` (a `Transformer` of `stage_args`): context
    rows into its state, and a block drafted from it."""

    def __init__(self, stages: Transformer[A, S], d: DSparkArgs) -> None:
        self.stages, self.d = stages, d

    def new_state(self) -> SequenceState:
        return self.stages.new_state()

    def context(self, main_x: A, state: SequenceState) -> None:
        """The rows of main_x [N, dim], at positions state.pos.., into every stage's ring."""
        model, ops = self.stages, self.stages.ops
        batch = model.batch([[self.d.noise_token_id] * main_x.shape[0]], [state])
        model.embed(batch)  # prepares the call (positions, RoPE tables)
        for il in range(self.d.stages):
            kv = ops.project(il, ATTN_INPUT, main_x, batch)["kv"]
            ops.extend_window(il, ops.norm_rope(il, Rows.KV, kv, batch), batch)
        model.advance(batch)

    def block(self, anchor: int, state: SequenceState) -> tuple[A, torch.Tensor]:
        """The block after the context: (the collapsed rows before the output norm [B, dim], their
        logits through the target's output matrix [B, vocab]); the state is left as it was."""
        model, ops = self.stages, self.stages.ops
        batch = model.batch([[anchor] + [self.d.noise_token_id] * (self.d.block_size - 1)], [state])
        h = model.embed(batch)
        x, mix = ops.hc_pre(0, "attn", h, batch)
        h, out, mix = self._stage(0, h, x, mix, batch)
        for il in range(1, self.d.stages):
            h, x, mix = ops.hc_post_pre(il, "attn", h, out, mix, batch)
            h, out, mix = self._stage(il, h, x, mix, batch)
        collapsed = ops.hc_collapse(ops.hc_post(h, out, mix, batch), batch)
        return collapsed, ops.logits(ops.output_norm(collapsed, batch), batch)

    def _stage(self, il: int, h: A, x: A, mix: Any, batch: Any) -> tuple[A, A, Any]:
        """Stage il from its attention input x to its FFN output, whose post is the caller's."""
        ops = self.stages.ops
        h, x, mix = ops.hc_post_pre(il, "ffn", h, self._attention(il, x, batch), mix, batch)
        ids, weights = ops.route(il, x, batch)
        return h, ops.moe(il, x, ids, weights, self.stages.experts, batch), mix

    def _attention(self, il: int, x: A, batch: Any) -> A:
        ops = self.stages.ops
        proj = ops.project(il, ATTN_INPUT, x, batch)
        kv = ops.norm_rope(il, Rows.KV, proj["kv"], batch)
        query = ops.project(il, QUERY_INPUT, ops.norm_rope(il, Rows.Q_LORA, proj["q_a"], batch), batch)
        q = ops.norm_rope(il, Rows.QUERY, query["q"], batch)
        return ops.attn_output(il, ops.block_attention(il, q, kv, batch), batch)


@dataclass(frozen=True)
class DSparkHeads:
    """The heads beside the target's output matrix, in torch float32: main_x's projection and norm,
    the Markov head and the confidence head."""

    main_proj: torch.Tensor  # [dim, n_target_layers * dim]
    main_norm: torch.Tensor  # [dim]
    markov_w1: torch.Tensor  # [vocab, rank]
    markov_w2: torch.Tensor  # [vocab, rank]
    confidence: torch.Tensor  # [1, dim + rank]
    eps: float

    def main_x(self, captured: Sequence[torch.Tensor]) -> torch.Tensor:
        """main_x [N, dim] from each target layer's streams [N, n, dim], in `target_layers` order."""
        x = torch.cat([h.float().mean(1) for h in captured], dim=-1) @ self.main_proj.T
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.main_norm

    def markov(self, previous: int) -> tuple[torch.Tensor, torch.Tensor]:
        """W1[previous] [rank] and the logit bias it adds, W2 . W1[previous] [vocab]."""
        e = self.markov_w1[previous]
        return e, self.markov_w2 @ e

    def confidence_of(self, collapsed: torch.Tensor, e: torch.Tensor) -> float:
        """The row's confidence, sigmoid(proj([collapsed; e]))."""
        return float(torch.sigmoid(torch.cat((collapsed.float(), e)) @ self.confidence[0]))
