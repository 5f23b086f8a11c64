"""The tensor table of ds4's DeepSeek V4.1 GGUF (`deepseek41`, spec §4): names, shapes, allowed types.

Beside V4's table (tensors.py) it has no `output_hc_*` (the lagged mHC collapses with the last FFN's
pre), no compressor position bias, compressor and indexer parts by layer mode (owners: kv, norm and the
index-key projection, plus the gate at ratio 2; index sources: the indexer query), an image-route bias
`exp_probs_b_vl` on every layer, no hash-routing table, and on the Engram layers their gate norms,
projection and table. A table (`engram_embd`, I8 `[rows, 264]`: whole 264-byte rows) is stored after
every other tensor and read from the disk, never resident.

Shapes are torch order ([out, in]); float tensors accept every float type, as in tensors.py, so tests
and conversions may write F32 files; attention projections also take Q4_K (ds4's `--attention-proj q4_k`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.model.config_v41 import LayerSpec41, ModelArgs41
from dwarfstar.model.tensors import (
    DENSE,
    EMBED,
    EXPERT,
    EXPERTS,
    FLOAT,
    KV_NORM,
    NORM,
    OUT_A,
    OUT_B,
    OUTPUT,
    OUTPUT_NORM,
    Q_NORM,
    ROUTER,
    ROUTER_BIAS,
    SHARED_EXPERT,
    SINKS,
    SITES,
    TensorLike,
    TensorSpec,
    check_tensor,
    hc_mix,
    layer_tensor,
    stage_needs,
    sublayer_norm,
)

ATTN_PROJ = DENSE | {T.Q4_K}
V41_ALIGNMENT = 16384  # ds4's V4.1 files: a table's pages can be dropped without touching the tensor before it
ENGRAM_ROWS = frozenset({T.I8})

ROUTER_BIAS_VL = "exp_probs_b_vl.bias"  # the routing bias image-span rows use instead of `exp_probs_b`
COMPRESSOR_KV, COMPRESSOR_GATE, COMPRESSOR_NORM = (
    "attn_compressor_kv.weight",
    "attn_compressor_gate.weight",
    "attn_compressor_norm.weight",
)
INDEX_K, INDEX_K_NORM = "indexer.attn_k.weight", "indexer.k_norm.weight"  # index keys from the latent
INDEX_Q, INDEX_PROJ = "indexer.attn_q_b.weight", "indexer.proj.weight"
ENGRAM_Q_NORM, ENGRAM_K_NORM, ENGRAM_KV = "engram_q_norm.weight", "engram_k_norm.weight", "engram_kv.weight"
ENGRAM_TABLE = "engram_embd.weight"


def engram_table(il: int) -> str:
    return layer_tensor(il, ENGRAM_TABLE)


def is_engram_table(name: str) -> bool:
    """Whether `name` is an Engram layer's table (`blk.L.engram_embd.weight`)."""
    return name.startswith("blk.") and name.endswith(f".{ENGRAM_TABLE}")


def expected_tensors41(args: ModelArgs41) -> Iterator[TensorSpec]:
    """Every tensor of a ds4 V4.1 text file, in ds4's order: the Engram tables last."""
    yield TensorSpec(EMBED, (args.vocab_size, args.dim), DENSE)
    yield TensorSpec(OUTPUT_NORM, (args.dim,), NORM)
    yield TensorSpec(OUTPUT, (args.vocab_size, args.dim), DENSE)
    for layer in args.layers:
        yield from _layer_tensors(args, layer)
    for il, rows in zip(args.engram_layers, args.engram_rows, strict=True):
        yield TensorSpec(engram_table(il), (rows, ROW_BYTES), ENGRAM_ROWS)


def _layer_tensors(args: ModelArgs41, layer: LayerSpec41) -> Iterator[TensorSpec]:
    d, e, ffn, mix = args.dim, args.n_routed_experts, args.moe_inter_dim, args.hc_mix_dim

    def spec(name: str, shape: tuple[int, ...], types: frozenset[T]) -> TensorSpec:
        return TensorSpec(layer_tensor(layer.index, name), shape, types)

    for site in SITES:
        fn, scale, base = hc_mix(site)
        yield spec(fn, (mix, args.hc_mult * d), FLOAT)
        yield spec(base, (mix,), NORM)
        yield spec(scale, (3,), NORM)
        yield spec(sublayer_norm(site), (d,), NORM)
    yield spec(SINKS, (args.n_heads,), NORM)
    yield spec("attn_q_a.weight", (args.q_lora_rank, d), ATTN_PROJ)
    yield spec("attn_q_b.weight", (args.n_heads * args.head_dim, args.q_lora_rank), ATTN_PROJ)
    yield spec("attn_kv.weight", (args.head_dim, d), ATTN_PROJ)
    yield spec(OUT_A, (args.o_groups * args.o_lora_rank, args.heads_per_group * args.head_dim), ATTN_PROJ)
    yield spec(OUT_B, (d, args.o_groups * args.o_lora_rank), ATTN_PROJ)
    yield spec(Q_NORM, (args.q_lora_rank,), NORM)
    yield spec(KV_NORM, (args.head_dim,), NORM)
    if layer.has_compressor:
        yield spec(COMPRESSOR_KV, (args.head_dim, d), FLOAT)
        if layer.has_gate:
            yield spec(COMPRESSOR_GATE, (args.head_dim, d), FLOAT)
        yield spec(COMPRESSOR_NORM, (args.head_dim,), NORM)
        yield spec(INDEX_K, (args.index_head_dim, args.head_dim), FLOAT)
        yield spec(INDEX_K_NORM, (args.index_head_dim,), NORM)
    if layer.has_index_query:
        yield spec(INDEX_Q, (args.index_n_heads * args.index_head_dim, args.q_lora_rank), FLOAT)
        yield spec(INDEX_PROJ, (args.index_n_heads, d), FLOAT)
    yield spec(ROUTER, (e, d), FLOAT)
    yield spec(ROUTER_BIAS, (e,), NORM)
    yield spec(ROUTER_BIAS_VL, (e,), NORM)
    shared = ffn * args.n_shared_experts
    shared_shapes = ((shared, d), (shared, d), (d, shared))
    expert_shapes = ((e, ffn, d), (e, ffn, d), (e, d, ffn))
    for shexp, exps, shexp_shape, exps_shape in zip(SHARED_EXPERT, EXPERTS, shared_shapes, expert_shapes, strict=True):
        yield spec(shexp, shexp_shape, DENSE)
        yield spec(exps, exps_shape, EXPERT)
    if layer.engram:
        yield spec(ENGRAM_Q_NORM, (args.hc_mult, d), NORM)
        yield spec(ENGRAM_K_NORM, (args.hc_mult, d), NORM)
        yield spec(ENGRAM_KV, ((args.hc_mult + 1) * d, args.engram_columns * args.engram_head_dim), FLOAT)


def validate_tensors41(args: ModelArgs41, tensors: Mapping[str, TensorLike], layers: range | None = None) -> None:
    """Raise ModelFileError naming the first missing, misshapen or mistyped tensor, or a tensor the model
    has no use for. With `layers` (a stage's slice, from the parts of a split set holding it), only those
    layers' tensors must be there, the embedding if it starts at 0 and the head if it ends last."""
    layers = range(args.n_layers) if layers is None else layers
    specs = list(expected_tensors41(args))
    for spec in specs:
        if stage_needs(spec.name, args.n_layers, layers):
            check_tensor(spec, tensors.get(spec.name))
    if extra := sorted(set(tensors) - {spec.name for spec in specs}):
        raise ModelFileError(f"unexpected tensor {extra[0]!r} ({len(extra)} tensors a V4.1 file does not have)")
    for il in layers:
        gate, up = (tensors[layer_tensor(il, name)].ggml_type for name in EXPERTS[:2])
        if gate != up:
            raise ModelFileError(f"blk.{il}: ffn_gate_exps is {gate.name} but ffn_up_exps is {up.name}")
