"""The tensor table of a ds4-layout DeepSeek V4 GGUF: names by role, fused groups, the inventory.

Every backend names tensors through this table (roles such as `KV_NORM`, groups such as
`ATTN_INPUT`), never with string literals of its own, so the file layout is described once.

Shapes are torch order ([out, in], experts [n_expert, out, in]); GGUF stores the reverse
(ne0 = in). Allowed types are what the loader can compute with: ds4 pins one type per tensor,
but tests and conversions also write F32/F16 files, so float tensors accept every float type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.model.config import LayerSpec, ModelArgs

FLOAT = frozenset({T.F32, T.F16, T.BF16})
NORM = frozenset({T.F32})
DENSE = FLOAT | {T.Q8_0}
EXPERT = DENSE | {T.Q2_K, T.Q4_K, T.IQ2_XXS, T.MXFP4}
INDEX = frozenset({T.I32})


# -- roles: a layer's tensors by what they do (names inside `blk.{il}.`) ------------------------------
EMBED = "token_embd.weight"
HEAD_HC = ("output_hc_fn.weight", "output_hc_scale.weight", "output_hc_base.weight")  # fn, scale, base
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"

SITES = ("attn", "ffn")  # the two sublayers of a block, each between an mHC pre and post


def hc_mix(site: str) -> tuple[str, str, str]:
    """The mHC pre-mix of a sublayer: fn [mix, n*D], scale [3], base [mix]."""
    return (f"hc_{site}_fn.weight", f"hc_{site}_scale.weight", f"hc_{site}_base.weight")


def sublayer_norm(site: str) -> str:
    return f"{site}_norm.weight"


Q_NORM = "attn_q_a_norm.weight"
KV_NORM = "attn_kv_a_norm.weight"
SINKS = "attn_sinks.weight"
OUT_A = "attn_output_a.weight"  # block-diagonal: o_groups blocks of [o_lora_rank, heads_per_group * head_dim]
OUT_B = "attn_output_b.weight"
COMPRESSORS = ("attn", "indexer")  # the KV compressor (compressed layers) and the indexer's (ratio 4)


def compressor(kind: str) -> tuple[str, str]:
    """A compressor's position bias [ratio, width] and output norm; its kv/gate live in `ATTN_INPUT`."""
    return (f"{kind}_compressor_ape.weight", f"{kind}_compressor_norm.weight")


ROUTER = "ffn_gate_inp.weight"
ROUTER_BIAS = "exp_probs_b.bias"  # learned routing: steers the choice, not the weights
HASH_TABLE = "ffn_gate_tid2eid.weight"  # hash routing: token id -> expert ids
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")  # [n_expert, out, in]
SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def layer_tensor(il: int, name: str) -> str:
    return f"blk.{il}.{name}"


@dataclass(frozen=True)
class Part:
    """One matrix of a fused projection group; `key` names its output in the forward pass."""

    key: str
    tensor: str
    needs: str = ""  # "": every layer; "compressor": compressed layers; "indexer": ratio-4 layers

    def present(self, layer: LayerSpec) -> bool:
        if self.needs == "compressor":
            return bool(layer.compress_ratio)
        return layer.has_indexer if self.needs == "indexer" else True


@dataclass(frozen=True)
class ProjectionGroup:
    """Matrices that read the same input, so a backend may fuse them into one pass over the input.

    Rows of a matrix are independent, so stacking the present parts row-wise and slicing the
    product's columns gives each part's product exactly.
    """

    name: str
    parts: tuple[Part, ...]

    def present(self, layer: LayerSpec) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if p.present(layer))


# everything the attention computes from the normalised sublayer input
ATTN_INPUT = ProjectionGroup(
    "attn_input",
    (
        Part("q_a", "attn_q_a.weight"),
        Part("kv", "attn_kv.weight"),
        Part("attn_kv", "attn_compressor_kv.weight", "compressor"),
        Part("attn_gate", "attn_compressor_gate.weight", "compressor"),
        Part("indexer_kv", "indexer_compressor_kv.weight", "indexer"),
        Part("indexer_gate", "indexer_compressor_gate.weight", "indexer"),
        Part("index_weights", "indexer.proj.weight", "indexer"),
    ),
)
# everything computed from the normalised low-rank query
QUERY_INPUT = ProjectionGroup(
    "query_input", (Part("q", "attn_q_b.weight"), Part("index_q", "indexer.attn_q_b.weight", "indexer"))
)
PROJECTION_GROUPS = (ATTN_INPUT, QUERY_INPUT)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order
    types: frozenset[T]


class TensorLike(Protocol):
    """What validation needs from a tensor in a file: its torch-order shape and ggml type."""

    shape: tuple[int, ...]
    ggml_type: T


def expected_tensors(args: ModelArgs) -> Iterator[TensorSpec]:
    """Every tensor of the trunk, in the order ds4's files store them."""
    d, hc = args.dim, args.hc_mult
    yield TensorSpec(EMBED, (args.vocab_size, d), DENSE)
    yield TensorSpec(HEAD_HC[0], (hc, hc * d), FLOAT)
    yield TensorSpec(HEAD_HC[1], (1,), NORM)
    yield TensorSpec(HEAD_HC[2], (hc,), NORM)
    yield TensorSpec(OUTPUT_NORM, (d,), NORM)
    yield TensorSpec(OUTPUT, (args.vocab_size, d), DENSE)
    for layer in args.layers:
        yield from _layer_tensors(args, layer.index)


def _layer_tensors(args: ModelArgs, il: int) -> Iterator[TensorSpec]:
    layer = args.layer(il)
    d, mix = args.dim, args.hc_mix_dim
    e, ffn = args.n_routed_experts, args.moe_inter_dim

    def spec(name: str, shape: tuple[int, ...], types: frozenset[T]) -> TensorSpec:
        return TensorSpec(layer_tensor(il, name), shape, types)

    for site in SITES:
        fn, scale, base = hc_mix(site)
        yield spec(fn, (mix, args.hc_mult * d), FLOAT)
        yield spec(scale, (3,), NORM)
        yield spec(base, (mix,), NORM)
    yield spec(sublayer_norm("attn"), (d,), NORM)
    yield spec("attn_q_a.weight", (args.q_lora_rank, d), DENSE)
    yield spec(Q_NORM, (args.q_lora_rank,), NORM)
    yield spec("attn_q_b.weight", (args.n_heads * args.head_dim, args.q_lora_rank), DENSE)
    yield spec("attn_kv.weight", (args.head_dim, d), DENSE)
    yield spec(KV_NORM, (args.head_dim,), NORM)
    yield spec(SINKS, (args.n_heads,), NORM)
    yield spec(OUT_A, (args.o_groups * args.o_lora_rank, args.heads_per_group * args.head_dim), DENSE)
    yield spec(OUT_B, (d, args.o_groups * args.o_lora_rank), DENSE)
    if layer.compress_ratio:
        width = layer.compressor_overlap * args.head_dim
        ape, norm = compressor("attn")
        yield spec(ape, (layer.compress_ratio, width), FLOAT)
        yield spec("attn_compressor_kv.weight", (width, d), FLOAT)
        yield spec("attn_compressor_gate.weight", (width, d), FLOAT)
        yield spec(norm, (args.head_dim,), NORM)
    if layer.has_indexer:
        width = 2 * args.index_head_dim
        ape, norm = compressor("indexer")
        yield spec("indexer.attn_q_b.weight", (args.index_n_heads * args.index_head_dim, args.q_lora_rank), FLOAT)
        yield spec("indexer.proj.weight", (args.index_n_heads, d), FLOAT)
        yield spec(ape, (layer.compress_ratio, width), FLOAT)
        yield spec("indexer_compressor_kv.weight", (width, d), FLOAT)
        yield spec("indexer_compressor_gate.weight", (width, d), FLOAT)
        yield spec(norm, (args.index_head_dim,), NORM)
    yield spec(sublayer_norm("ffn"), (d,), NORM)
    yield spec(ROUTER, (e, d), FLOAT)
    if layer.hash_routed:
        yield spec(HASH_TABLE, (args.vocab_size, args.n_activated_experts), INDEX)
    else:
        yield spec(ROUTER_BIAS, (e,), NORM)
    for name, shape in zip(EXPERTS, ((e, ffn, d), (e, ffn, d), (e, d, ffn)), strict=True):
        yield spec(name, shape, EXPERT)
    shared = ffn * args.n_shared_experts
    for name, shape in zip(SHARED_EXPERT, ((shared, d), (shared, d), (d, shared)), strict=True):
        yield spec(name, shape, DENSE)


def validate_tensors(args: ModelArgs, tensors: Mapping[str, TensorLike], layers: range | None = None) -> None:
    """Raise ModelFileError naming the first missing, mis-shaped or mistyped tensor. With `layers` (a
    pipeline stage's slice), only those layers, the embedding if it starts at 0 and the head if it ends last."""
    layers = range(args.n_layers) if layers is None else layers
    for spec in expected_tensors(args):
        if stage_needs(spec.name, args.n_layers, layers):
            check_tensor(spec, tensors.get(spec.name))
    for il in layers:
        gate, up = (tensors[layer_tensor(il, name)].ggml_type for name in EXPERTS[:2])
        if gate != up:
            raise ModelFileError(
                f"blk.{il}: ffn_gate_exps is {gate.name} but ffn_up_exps is {up.name}; they must match"
            )


def stage_needs(name: str, n_layers: int, layers: range) -> bool:
    """Whether a stage holding `layers` of a model of `n_layers` (V4 or V4.1) reads the tensor `name`:
    its layers' tensors, the embedding on the first stage and the output head on the last."""
    if name == EMBED:
        return layers.start == 0
    if not name.startswith("blk."):  # the output head: HC collapse, norm, output matrix
        return layers.stop == n_layers
    return int(name.split(".")[1]) in layers


# -- the MTP block (spec §2.6, §4.4, §8 item 9) ---------------------------------------------------------
# Two file layouts hold it. ds4 ships a separate GGUF with every tensor under `mtp.0.`; llama.cpp keeps
# it in the model file as one more block `blk.{n_trunk}` (counted in block_count) whose extra tensors
# sit under `blk.{n_trunk}.nextn.`, with one eh_proj [D, 2D] over the concatenated [embedding, hidden]
# instead of ds4's e_proj and h_proj. Either way the block itself has a trunk layer's tensor names.
MTP_LAYOUTS = ("ds4", "nextn")
MTP_PREFIX = "mtp.0."
MTP_INPUT_NORMS = ("enorm.weight", "hnorm.weight")  # RMS norm of the embedding, of each hidden stream
MTP_DS4_PROJ = ("e_proj.weight", "h_proj.weight")  # [D, D] each
MTP_NEXTN_PROJ = "nextn.eh_proj.weight"  # [D, 2D]: columns 0..D-1 read the embedding, D..2D-1 the hidden
# the block's own head: HC collapse weights and output norm (what `HEAD_HC` / `OUTPUT_NORM` are to the trunk)
MTP_DS4_HEAD = ("hc_head_fn.weight", "hc_head_scale.weight", "hc_head_base.weight", "norm.weight")
MTP_NEXTN_HEAD = (
    "nextn.hc_head_fn.weight",
    "nextn.hc_head_scale.weight",
    "nextn.hc_head_base.weight",
    "nextn.shared_head_norm.weight",
)


def mtp_block_args(args: ModelArgs) -> ModelArgs:
    """The MTP block as a one-layer model of the trunk's shapes: window-only attention (ratio 0, base
    RoPE, no YaRN) and learned top-k routing, never hashed."""
    return args.with_(n_layers=1, compress_ratios=(0,), n_hash_layers=0, n_mtp_layers=0)


def mtp_prefix(args: ModelArgs, layout: str) -> str:
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"unknown MTP layout {layout!r}, expected one of {MTP_LAYOUTS}")
    return MTP_PREFIX if layout == "ds4" else f"blk.{args.n_layers}."


def mtp_block_names(args: ModelArgs, layout: str) -> dict[str, str]:
    """The one-layer model's tensor names (`mtp_block_args`) -> the file's, for the block and its head.

    The embedding and the output matrix are the trunk's and keep their names."""
    prefix = mtp_prefix(args, layout)
    block = {spec.name: prefix + spec.name.removeprefix("blk.0.") for spec in _layer_tensors(mtp_block_args(args), 0)}
    head = MTP_DS4_HEAD if layout == "ds4" else MTP_NEXTN_HEAD
    block.update({own: prefix + name for own, name in zip((*HEAD_HC, OUTPUT_NORM), head, strict=True)})
    return block


def mtp_tensors(args: ModelArgs, layout: str) -> Iterator[TensorSpec]:
    """Every tensor of the MTP block in a file of `layout`, for the trunk `args` (file names)."""
    prefix, d = mtp_prefix(args, layout), args.dim
    for name in MTP_INPUT_NORMS:
        yield TensorSpec(prefix + ("nextn." if layout == "nextn" else "") + name, (d,), NORM)
    if layout == "ds4":
        for name in MTP_DS4_PROJ:
            yield TensorSpec(prefix + name, (d, d), DENSE)
    else:
        yield TensorSpec(prefix + MTP_NEXTN_PROJ, (d, 2 * d), DENSE)
    own = {spec.name: spec for spec in expected_tensors(mtp_block_args(args)) if spec.name not in (EMBED, OUTPUT)}
    for own_name, file_name in mtp_block_names(args, layout).items():
        spec = own[own_name]
        yield TensorSpec(file_name, spec.shape, spec.types)


def check_tensor(spec: TensorSpec, info: TensorLike | None) -> None:
    """Raise ModelFileError when a tensor is missing, mis-shaped or mistyped."""
    if info is None:
        raise ModelFileError(f"missing tensor {spec.name!r} (expected shape {list(spec.shape)})")
    if tuple(info.shape) != spec.shape:
        raise ModelFileError(
            f"tensor {spec.name!r} has shape {list(info.shape)}, expected {list(spec.shape)} (torch order: [out, in])"
        )
    if info.ggml_type not in spec.types:
        allowed = ", ".join(sorted(t.name for t in spec.types))
        raise ModelFileError(f"tensor {spec.name!r} has type {info.ggml_type.name}, expected one of {allowed}")
