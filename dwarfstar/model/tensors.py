"""The tensor inventory of a ds4-layout DeepSeek V4 GGUF, and its validation.

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
from dwarfstar.model.config import ModelArgs

FLOAT = frozenset({T.F32, T.F16, T.BF16})
NORM = frozenset({T.F32})
DENSE = FLOAT | {T.Q8_0}
EXPERT = DENSE | {T.Q2_K, T.Q4_K, T.IQ2_XXS}
INDEX = frozenset({T.I32})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order
    types: frozenset[T]

    @property
    def gguf_dims(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class TensorLike(Protocol):
    """What validation needs from a tensor in a file: its torch-order shape and ggml type."""

    shape: tuple[int, ...]
    ggml_type: T


def expected_tensors(args: ModelArgs) -> Iterator[TensorSpec]:
    """Every tensor of the trunk, in the order ds4's files store them."""
    d, hc = args.dim, args.hc_mult
    yield TensorSpec("token_embd.weight", (args.vocab_size, d), DENSE)
    yield TensorSpec("output_hc_fn.weight", (hc, hc * d), FLOAT)
    yield TensorSpec("output_hc_scale.weight", (1,), NORM)
    yield TensorSpec("output_hc_base.weight", (hc,), NORM)
    yield TensorSpec("output_norm.weight", (d,), NORM)
    yield TensorSpec("output.weight", (args.vocab_size, d), DENSE)
    for layer in args.layers:
        yield from _layer_tensors(args, layer.index)


def _layer_tensors(args: ModelArgs, il: int) -> Iterator[TensorSpec]:
    layer = args.layer(il)
    d, mix, p = args.dim, args.hc_mix_dim, f"blk.{il}."
    e, ffn = args.n_routed_experts, args.moe_inter_dim
    for kind in ("attn", "ffn"):
        yield TensorSpec(f"{p}hc_{kind}_fn.weight", (mix, args.hc_mult * d), FLOAT)
        yield TensorSpec(f"{p}hc_{kind}_scale.weight", (3,), NORM)
        yield TensorSpec(f"{p}hc_{kind}_base.weight", (mix,), NORM)
    yield TensorSpec(f"{p}attn_norm.weight", (d,), NORM)
    yield TensorSpec(f"{p}attn_q_a.weight", (args.q_lora_rank, d), DENSE)
    yield TensorSpec(f"{p}attn_q_a_norm.weight", (args.q_lora_rank,), NORM)
    yield TensorSpec(f"{p}attn_q_b.weight", (args.n_heads * args.head_dim, args.q_lora_rank), DENSE)
    yield TensorSpec(f"{p}attn_kv.weight", (args.head_dim, d), DENSE)
    yield TensorSpec(f"{p}attn_kv_a_norm.weight", (args.head_dim,), NORM)
    yield TensorSpec(f"{p}attn_sinks.weight", (args.n_heads,), NORM)
    yield TensorSpec(
        f"{p}attn_output_a.weight", (args.o_groups * args.o_lora_rank, args.heads_per_group * args.head_dim), DENSE
    )
    yield TensorSpec(f"{p}attn_output_b.weight", (d, args.o_groups * args.o_lora_rank), DENSE)
    if layer.compress_ratio:
        width = layer.compressor_overlap * args.head_dim
        yield TensorSpec(f"{p}attn_compressor_ape.weight", (layer.compress_ratio, width), FLOAT)
        yield TensorSpec(f"{p}attn_compressor_kv.weight", (width, d), FLOAT)
        yield TensorSpec(f"{p}attn_compressor_gate.weight", (width, d), FLOAT)
        yield TensorSpec(f"{p}attn_compressor_norm.weight", (args.head_dim,), NORM)
    if layer.has_indexer:
        width = 2 * args.index_head_dim
        yield TensorSpec(
            f"{p}indexer.attn_q_b.weight", (args.index_n_heads * args.index_head_dim, args.q_lora_rank), FLOAT
        )
        yield TensorSpec(f"{p}indexer.proj.weight", (args.index_n_heads, d), FLOAT)
        yield TensorSpec(f"{p}indexer_compressor_ape.weight", (layer.compress_ratio, width), FLOAT)
        yield TensorSpec(f"{p}indexer_compressor_kv.weight", (width, d), FLOAT)
        yield TensorSpec(f"{p}indexer_compressor_gate.weight", (width, d), FLOAT)
        yield TensorSpec(f"{p}indexer_compressor_norm.weight", (args.index_head_dim,), NORM)
    yield TensorSpec(f"{p}ffn_norm.weight", (d,), NORM)
    yield TensorSpec(f"{p}ffn_gate_inp.weight", (e, d), FLOAT)
    if layer.hash_routed:
        yield TensorSpec(f"{p}ffn_gate_tid2eid.weight", (args.vocab_size, args.n_activated_experts), INDEX)
    else:
        yield TensorSpec(f"{p}exp_probs_b.bias", (e,), NORM)
    yield TensorSpec(f"{p}ffn_gate_exps.weight", (e, ffn, d), EXPERT)
    yield TensorSpec(f"{p}ffn_up_exps.weight", (e, ffn, d), EXPERT)
    yield TensorSpec(f"{p}ffn_down_exps.weight", (e, d, ffn), EXPERT)
    shared = ffn * args.n_shared_experts
    yield TensorSpec(f"{p}ffn_gate_shexp.weight", (shared, d), DENSE)
    yield TensorSpec(f"{p}ffn_up_shexp.weight", (shared, d), DENSE)
    yield TensorSpec(f"{p}ffn_down_shexp.weight", (d, shared), DENSE)


def validate_tensors(args: ModelArgs, tensors: Mapping[str, TensorLike]) -> None:
    """Raise ModelFileError naming the first missing, mis-shaped or mistyped tensor."""
    for spec in expected_tensors(args):
        info = tensors.get(spec.name)
        if info is None:
            raise ModelFileError(f"missing tensor {spec.name!r} (expected shape {list(spec.shape)})")
        if tuple(info.shape) != spec.shape:
            raise ModelFileError(
                f"tensor {spec.name!r} has shape {list(info.shape)}, expected {list(spec.shape)} "
                "(torch order: [out, in])"
            )
        if info.ggml_type not in spec.types:
            allowed = ", ".join(sorted(t.name for t in spec.types))
            raise ModelFileError(f"tensor {spec.name!r} has type {info.ggml_type.name}, expected one of {allowed}")
    for il in range(args.n_layers):
        gate, up = (tensors[f"blk.{il}.ffn_{k}_exps.weight"].ggml_type for k in ("gate", "up"))
        if gate != up:
            raise ModelFileError(
                f"blk.{il}: ffn_gate_exps is {gate.name} but ffn_up_exps is {up.name}; they must match"
            )
