"""DeepSeek V4.1 Flash's DSpark drafter over a backend's `Ops41`: its support file's settings and tensors,
and its two passes (V4.1's reference `inference/model.py`: `DSparkBlock`, `DSparkAttention`,
`Transformer.forward_spec`; shared/spec/RELEASES_2026.md, "V4.1 dspark").

What differs from V4's drafter (model/dspark.py, whose heads and settings it shares):

- capture point: the *inputs* of the target layers (37, 38, 39 in Flash: each one's streams after its
  Engram, before its block; `forward_v41.Capture41`), averaged over the hc copies by `DSparkHeads.main_x`;
- the stages are V4.1 blocks (`stages` of them, layers n_layers.. of the reference's numbering, so a
  stage here is layer n_layers + k of `stage_args41`): lagged mHC (each sublayer collapses with the pre
  of the one before, the first with (1, 0, ..) and the heads with the last FFN's), window-only attention
  at base RoPE without YaRN, a routed MoE of the drafter's own expert count and top-k (Flash: 128 and 3,
  beside the trunk's 384 and 6) selecting with `exp_probs_b` (drafts are text) and a shared expert; no
  Engram, no compressor, no indexer, and no learned head collapse (`hc_head`);
- heads: logits = output(norm(collapse(H, pre))) with the last stage's norm and the target's output
  matrix; the Markov and confidence heads as V4's.

The two passes, per stage k (layer il = n_layers + k):

- context: each committed position p's main_x row (`DSparkHeads.main_x`) gives the window row
  kv_norm(wkv(main_x)) at p, FP8-rounded as the trunk's window rows; a stage keeps the last `window`
  (the reference's ring of `window_size` slots);
- block: the embedding of [anchor, noise x (block_size - 1)] at the positions after the context, copied
  into the hc streams, runs through the stages; every query attends to its stage's kept context rows
  and to every row of the block, both ways (the reference's `get_dspark_topk_idxs`), with the sink, and
  the block's rows are never kept.

Positions count from where the drafter started following the target (as V4's drafter's do); RoPE sees
only their differences.

The support file (`ARCH41`, ds4 publishes none for V4.1): V4's `dspark.*` keys (model/dspark.py) and
`dspark.expert_count`, `dspark.expert_used_count`; per stage `mtp.{k}.` the tensors of a window-only V4.1
layer under the trunk's leaf names (`tensors_v41`), `main_proj` and `main_norm` on stage 0, `norm`,
the Markov and the confidence heads on the last; the embedding and the output matrix are the target's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol

import torch

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark import ARCH41, CONFIDENCE, MAIN, MARKOV, PREFIX, DSparkArgs, support_metadata
from dwarfstar.model.forward_v41 import ATTN, FFN, A, Ops41
from dwarfstar.model.tensors import DENSE, EMBED, NORM, OUTPUT, OUTPUT_NORM, TensorSpec
from dwarfstar.model.tensors_v41 import expected_tensors41

EXPERTS_KEY, TOP_K_KEY = "dspark.expert_count", "dspark.expert_used_count"


@dataclass(frozen=True)
class DSparkArgs41:
    """V4's drafter settings and the stages' own routed-expert count and top-k (the reference's
    `dspark_n_routed_experts`, `dspark_n_activated_experts`)."""

    d: DSparkArgs
    n_experts: int
    top_k: int

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], target: ModelArgs41, where: str) -> DSparkArgs41:
        """The support file's `dspark.*` keys, checked against the target model."""
        d = DSparkArgs.from_metadata(metadata, target, where)
        missing = [key for key in (EXPERTS_KEY, TOP_K_KEY) if key not in metadata]
        if missing:
            raise ModelFileError(f"{where} is not a V4.1 DSpark support file: it has no {missing[0]}")
        args = cls(d, int(metadata[EXPERTS_KEY]), int(metadata[TOP_K_KEY]))
        if not 0 < args.top_k <= args.n_experts:
            raise ModelFileError(f"{where}: the DSpark stages route to {args.top_k} of {args.n_experts} experts")
        return args


def support_metadata41(d: DSparkArgs41, name: str) -> dict[str, tuple[ValueType, Any]]:
    """A V4.1 support file's GGUF metadata: V4's keys under `ARCH41`, and the stages' expert counts."""
    metadata = support_metadata(d.d, name)
    metadata["general.architecture"] = (ValueType.STRING, ARCH41)
    metadata[EXPERTS_KEY] = (ValueType.UINT32, d.n_experts)
    metadata[TOP_K_KEY] = (ValueType.UINT32, d.top_k)
    return metadata


def stage_args41(target: ModelArgs41, d: DSparkArgs41) -> ModelArgs41:
    """The target's layout with the stages after its layers (window-only, as the reference numbers them)
    and the stages' expert counts: the stages are its layers `stage_layers`; its others are never run."""
    return target.with_(
        n_layers=target.n_layers + d.d.stages,
        compress_ratios=target.compress_ratios + (0,) * d.d.stages,
        n_routed_experts=d.n_experts,
        n_activated_experts=d.top_k,
    )


def stage_layers(target: ModelArgs41, d: DSparkArgs41) -> range:
    return range(target.n_layers, target.n_layers + d.d.stages)


def stage_names41(target: ModelArgs41, d: DSparkArgs41) -> dict[str, str]:
    """The stage layers' tensor names (and the output norm) -> the support file's; the embedding and the
    output matrix are the target's and keep their names."""
    names, first = {}, target.n_layers
    for spec in expected_tensors41(stage_args41(target, d)):
        part = spec.name.split(".", 2)
        if part[0] == "blk" and int(part[1]) >= first:
            names[spec.name] = PREFIX.format(int(part[1]) - first) + part[2]
    names[OUTPUT_NORM] = PREFIX.format(d.d.stages - 1) + "norm.weight"
    return names


def dspark_tensors41(target: ModelArgs41, d: DSparkArgs41) -> Iterator[TensorSpec]:
    """Every tensor of a V4.1 support file for `target` (file names, torch shapes)."""
    own = {spec.name: spec for spec in expected_tensors41(stage_args41(target, d))}
    for own_name, file_name in stage_names41(target, d).items():
        yield TensorSpec(file_name, own[own_name].shape, own[own_name].types)
    dim, rank, first, last = target.dim, d.d.markov_rank, PREFIX.format(0), PREFIX.format(d.d.stages - 1)
    yield TensorSpec(first + MAIN[0], (dim, len(d.d.target_layers) * dim), DENSE)
    yield TensorSpec(first + MAIN[1], (dim,), NORM)
    for name in MARKOV:
        yield TensorSpec(last + name, (target.vocab_size, rank), DENSE)
    yield TensorSpec(last + CONFIDENCE, (1, dim + rank), DENSE)


SHARED = (EMBED, OUTPUT)  # the target's tensors the stages read


class DSparkOps41(Ops41[A], Protocol[A]):
    """The V4.1 steps the stages run, over the stage layers' weights, and two of the drafter's own."""

    def block_keys(self, context: A, block: A) -> tuple[A, A]:
        """Every block query's keys [B, C + B, head_dim], the context rows [C, head_dim] then the block's
        own [B, head_dim], and their mask [B, C + B] (none masked: the block attends both ways)."""
        ...

    def collapse(self, h: A, pre: A) -> A:
        """sum_k pre_k h_k [T, dim] of streams [T, n, dim] (the confidence head's input)."""
        ...


@dataclass
class DSparkState41(Generic[A]):
    """A drafter's context: per stage layer, the window rows of its last `window` context positions."""

    rings: dict[int, A] = field(default_factory=dict)
    pos: int = 0  # context positions written


class DSparkForward41(Generic[A]):
    """The drafter's passes over its stages' `DSparkOps41`: context rows into a state, a block after it."""

    def __init__(self, ops: DSparkOps41[A], target: ModelArgs41, d: DSparkArgs41) -> None:
        self.ops, self.d = ops, d.d
        self.layers, self.window = stage_layers(target, d), target.window

    def new_state(self) -> DSparkState41[A]:
        return DSparkState41()

    def context(self, main_x: A, state: DSparkState41[A]) -> None:
        """The window rows of main_x [N, dim], at positions state.pos.., into every stage's kept rows."""
        ops, n = self.ops, main_x.shape[0]
        positions = torch.arange(state.pos, state.pos + n)
        for il in self.layers:
            rows = ops.window_rows(il, main_x, positions)
            kept = state.rings.get(il)
            state.rings[il] = (rows if kept is None else ops.append(kept, rows))[-self.window :]
        state.pos += n

    def block(self, anchor: int, state: DSparkState41[A]) -> tuple[A, torch.Tensor]:
        """The block after the context: its collapsed rows before the output norm [B, dim] and its logits
        before the Markov bias [B, vocab]; the state is left as it was."""
        if not state.pos:
            raise ValueError("a DSpark block drafts after a context: write one first")
        ops, size = self.ops, self.d.block_size
        positions = torch.arange(state.pos, state.pos + size)
        h = ops.embed(torch.tensor([anchor] + [self.d.noise_token_id] * (size - 1)), ())
        pre = ops.first_pre(size)
        for il in self.layers:
            a_pre, a_post, a_comb = ops.mix(il, ATTN, h)
            x = ops.sublayer_input(il, ATTN, h, pre)
            q, _ = ops.query(il, x, positions)
            keys = ops.block_keys(state.rings[il], ops.window_rows(il, x, positions))
            h = ops.hc_post(h, ops.attend(il, q, [keys], positions), a_post, a_comb)
            f_pre, f_post, f_comb = ops.mix(il, FFN, h)
            h = ops.hc_post(h, ops.moe(il, ops.sublayer_input(il, FFN, h, a_pre), None), f_post, f_comb)
            pre = f_pre
        return ops.collapse(h, pre), ops.head(h, pre)
