"""Trainable DeepSeek V4 weights keyed by GGUF tensor name: initialisation, a weight source, export.

Training runs over a compact vocabulary, the ids that occur in the corpus renumbered 0..n-1 in id
order: the embedding, the hash-routing table and the output head keep only those rows, so an
optimiser step touches 7 thousand rows instead of 129 thousand. The model sees nothing else of a
token id, so this is the same network. Export scatters the rows back into the full vocabulary.

The head has one more learned row, `output.rest`, that stands for every id outside the corpus: its
logit counts once per such id (+ log of their number). Export copies it into all of their rows, so
the full-vocabulary softmax of the file is exactly the restricted softmax that was trained.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence

import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.synthetic import write_model_gguf
from dwarfstar.model.tensors import EMBED, EXPERT, INDEX, NORM, OUTPUT, TensorSpec, expected_tensors

REST = "output.rest"
LAYOUTS = ("q8_0", "f32")
COMB_DIAGONAL = 2.0  # HC comb logits start near the identity: each stream first keeps itself


def init_params(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of `expected_tensors(args)` plus `output.rest`, drawn deterministically from `seed`.

    Matrices are N(0, 1/fan_in) so activations stay O(1); the projections that write into the
    residual streams are scaled down by the depth (GPT-2 style) so the streams start near the
    embedding. Norms start at 1, sinks, router biases and window position biases at 0.
    """
    gen = torch.Generator().manual_seed(seed)
    params = {spec.name: _init(spec, args, gen) for spec in expected_tensors(args)}
    params[REST] = torch.randn(args.dim, generator=gen) / math.sqrt(args.dim)
    return params


def _init(spec: TensorSpec, args: ModelArgs, gen: torch.Generator) -> torch.Tensor:
    short = short_name(spec.name)
    if spec.types == INDEX:  # token -> k distinct experts
        ranks = torch.rand(spec.shape[0], args.n_routed_experts, generator=gen).argsort(dim=1)
        return ranks[:, : args.n_activated_experts].to(torch.int32)
    if spec.types == NORM:
        if short.endswith("norm"):
            return torch.ones(spec.shape)
        if short.endswith("scale"):
            return torch.full(spec.shape, 0.1)
        if short.startswith("hc_") and short.endswith("base"):
            return _hc_base(args)
        return torch.zeros(spec.shape)  # sinks, router bias, output HC base
    if short.endswith("ape"):
        return torch.zeros(spec.shape)
    x = torch.randn(spec.shape, generator=gen)
    if short == "token_embd":
        return x
    x /= math.sqrt(spec.shape[-1])
    if short in ("attn_output_b", "ffn_down_exps", "ffn_down_shexp"):
        x /= math.sqrt(2 * args.n_layers)
    return x


def _hc_base(args: ModelArgs) -> torch.Tensor:
    """[pre(n) | post(n) | comb(n*n)]: pre and post at sigmoid(0), comb biased toward the identity."""
    n = args.hc_mult
    comb = torch.eye(n) * COMB_DIAGONAL
    return torch.cat((torch.zeros(2 * n), comb.flatten()))


def short_name(name: str) -> str:
    """Tensor name without the `blk.N.` prefix and the `.weight`/`.bias` suffix."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return ".".join(parts[:-1])


class ParamWeights:
    """A `WeightSource` over a dict of tensors, so the reference model computes with them (and autograd sees them)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def dense(self, name: str) -> torch.Tensor:
        return self.params[name]

    def expert(self, name: str, e: int) -> torch.Tensor:
        return self.params[name][e]


def compact(params: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters restricted to the vocabulary rows `ids` (sorted, unique): row i is token ids[i]."""
    return {name: t[ids].clone() if is_vocab_rows(name) else t.clone() for name, t in params.items()}


def is_vocab_rows(name: str) -> bool:
    """Tensors with one row per vocabulary id: the embedding, the output head, the hash-routing tables."""
    return name in ("token_embd.weight", "output.weight") or name.endswith("ffn_gate_tid2eid.weight")


def expand(
    full: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Full-vocabulary parameters: `trained` everywhere, its rows scattered to `ids` over `full`.

    Embedding and hash rows of ids outside the corpus keep their initial values; every such output
    row becomes the learned `output.rest` row (see the module docstring).
    """
    out = {name: t.detach().clone() for name, t in trained.items()}
    for name in filter(is_vocab_rows, full):
        rows = full[name].clone()
        if name == "output.weight":
            rows[:] = out[REST]
        rows[ids] = out[name]
        out[name] = rows
    return out


def rest_log_count(vocab_size: int, n_corpus: int) -> float:
    """The `output.rest` logit offset: log of how many vocabulary ids it stands for."""
    return math.log(vocab_size - n_corpus)


def balanced_hash_table(counts: torch.Tensor, n_experts: int, k: int, seed: int) -> torch.Tensor:
    """Token -> k distinct experts for the compact vocabulary, balancing the experts' token load.

    DeepSeek V4 hashes token ids to experts; with a few thousand ids of Zipfian frequency a random
    hash leaves some experts with far more tokens than others, so tokens are placed from the most
    frequent down, each on the k experts with the least load so far (ties broken by a seeded draw).
    """
    gen = torch.Generator().manual_seed(seed)
    jitter = torch.rand(counts.numel(), n_experts, generator=gen) * 1e-3
    load = torch.zeros(n_experts, dtype=torch.float64)
    table = torch.zeros(counts.numel(), k, dtype=torch.int32)
    for token in counts.argsort(descending=True, stable=True).tolist():
        chosen = (load + jitter[token]).topk(k, largest=False).indices
        table[token] = chosen.to(torch.int32)
        load[chosen] += float(counts[token])
    return table


def export_type(spec: TensorSpec, layout: str) -> GGMLType:
    """`q8_0`: Q8_0 for every matrix (the embedding included, to fit 40 MB), F32 for norms; or all F32."""
    if spec.types == INDEX:
        return GGMLType.I32
    if layout == "f32" or spec.types == NORM:
        return GGMLType.F32
    if spec.types == EXPERT or GGMLType.Q8_0 in spec.types:
        return GGMLType.Q8_0
    return GGMLType.F16  # HC mixes, compressors, indexer and router: F16, as ds4 stores them


def write_gguf(
    path: str | os.PathLike, args: ModelArgs, params: dict[str, torch.Tensor], layout: str, name: str
) -> None:
    """Write full-vocabulary parameters as a ds4-layout GGUF with the V4 tokenizer in its metadata."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}, expected one of {LAYOUTS}")
    write_model_gguf(
        path,
        args,
        name,
        lambda spec: export_type(spec, layout),
        lambda _index, spec, ggml_type: _chunks(params[spec.name].detach(), ggml_type),
    )


def _chunks(tensor: torch.Tensor, ggml_type: GGMLType) -> Iterator:
    if ggml_type == GGMLType.I32:
        yield tensor.to(torch.int32).numpy()
        return
    values = tensor.float().contiguous()
    yield quantize(values.reshape(-1) if values.dim() == 1 else values.reshape(-1, values.shape[-1]), ggml_type)


def draft_optimizer(named: Iterable[tuple[str, torch.Tensor]], lr: float) -> torch.optim.AdamW:
    """AdamW over a draft's float tensors (the model's embedding and output matrix, and the router
    biases, which move by the balancing rule, excepted), now requiring gradients."""
    trainable = [
        t
        for name, t in named
        if name not in (EMBED, OUTPUT) and t.dtype == torch.float32 and not name.endswith("exp_probs_b.bias")
    ]
    for t in trainable:
        t.requires_grad_()
    return torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def write_f32(
    path: str | os.PathLike,
    metadata: dict,
    specs: Sequence[TensorSpec],
    tensors: dict,
    matrices: GGMLType = GGMLType.F32,
) -> None:
    """A GGUF of `specs`, each tensors[name] in F32, or in `matrices` (Q8_0, say) for a matrix whose
    spec takes that type and whose rows are whole blocks of it."""

    def ggml_type(spec: TensorSpec) -> GGMLType:
        fits = len(spec.shape) == 2 and spec.shape[-1] % BLOCK_GEOMETRY[matrices][0] == 0
        return matrices if fits and matrices in spec.types else GGMLType.F32

    with GGUFWriter(path, metadata) as writer:
        for spec in specs:
            writer.add_tensor(spec.name, spec.shape, ggml_type(spec))
        for spec in specs:
            value = tensors[spec.name].detach()
            rows = value.reshape(-1) if value.dim() == 1 else value.reshape(-1, spec.shape[-1])
            writer.write_tensor(spec.name, iter([quantize(rows, ggml_type(spec))]))
