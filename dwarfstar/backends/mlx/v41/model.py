"""V4.1's steps in MLX (`forward_v41.Ops41[mx.array]`) over a ds4 `deepseek41` file: the order is
`forward_v41.Transformer41`'s, this module only says how each step is computed.

As V4's `MLXOps`: every step only records MLX's lazy graph, and `head` (a call's last step) evaluates
it once, together with the state arrays the call wrote (its window rows, compressed rows, index keys
and frontiers); the logits come back as torch tensors. Positions stay on the host (numpy), where the
rope angles (float64), the window indices and the row visibility are formed, so the graph has no
data-dependent shapes. The matrices are `weights.py`'s (Metal kernels for GGUF blocks on Apple, MLX's
products elsewhere); V4's pieces are reused where V4.1 shares a step (RMSNorm, RoPE, the mHC mixes,
sink attention, the grouped output, the routing and the experts). Engram rows are read on the host
from the file through an `EngramStore`. The routed experts come from `experts` (V4's sources: the
packed stacks, or `streaming`'s packed cache with `--ssd-streaming`); a `--cpu-moe` layer's run on the
host's CPU kernels (`model.host_moe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.mlx.model import grouped_output, host_moe, resident_experts, routed_experts, shared_expert
from dwarfstar.backends.mlx.v41 import csa2, engram, select, window
from dwarfstar.backends.mlx.weights import LayerWeights, Matrix, Weights
from dwarfstar.engram.hashing import EngramHash
from dwarfstar.engram.store import EngramStore
from dwarfstar.model import tensors as tt
from dwarfstar.model import tensors_v41 as tt41
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.forward import ExpertSource
from dwarfstar.model.forward_v41 import LaggedSteps41
from dwarfstar.model.image_spans import ImageSpan

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts


@dataclass
class Layer41:
    """One V4.1 block's weights, named by the tensor tables' roles."""

    hc: dict[str, tuple[mx.array, mx.array, mx.array]]
    norm: dict[str, mx.array]
    q_a: Matrix
    q_b: Matrix
    q_norm: mx.array
    kv: Matrix
    kv_norm: mx.array
    sinks: mx.array
    wo_a: Matrix  # a stack of o_groups matrices (`model.grouped_output`)
    wo_b: Matrix
    inv_freq: np.ndarray  # float64 rotary frequencies per pair
    router: Matrix
    bias: mx.array
    image_bias: mx.array  # the router's bias at image positions (`exp_probs_b_vl`)
    shared: tuple[Matrix, Matrix, Matrix]
    compressor: tuple[Matrix, Matrix | None, mx.array, Matrix, mx.array] | None  # kv, gate, norm, W_k, k_norm
    indexer: tuple[Matrix, Matrix] | None  # the index query's W_q and its head weights' projection
    engram: tuple[Matrix, mx.array, mx.array] | None  # W_kv, q_norm, k_norm


class MLXOps41(LaggedSteps41):
    def __init__(
        self,
        args: ModelArgs41,
        weights: Weights,
        engram_hash: EngramHash,
        store: EngramStore,
        fused: ops.Fused,
        routed_experts: bool = True,
        host: HostExperts | None = None,
        layers: range | None = None,
        shares: MLXOps41 | None = None,
        stage: bool = False,
    ) -> None:
        """Without `routed_experts` none is packed: they stream from the file (the entry's `attach_experts`
        sets the source). `host`: the layers whose routed experts the CPU kernels compute from the file
        (`--cpu-moe`): never packed. `layers`: the layers loaded (None: all of them), `layers` keyed by
        their index; with `stage` they are a pipeline stage's, which loads the embedding only where they
        start at 0 and the head only where they end last (`tensors.stage_needs`). `shares`: ops whose
        embedding and output matrix these take rather than load (a DSpark drafter's target's)."""
        self.args, self.hash, self.store, self.fused, self.host = args, engram_hash, store, fused, host
        self.packing = weights.packing
        held = range(args.n_layers) if layers is None else layers

        def own(name: str) -> bool:
            return not stage or tt.stage_needs(name, args.n_layers, held)

        self.embedding = shares.embedding if shares is not None else weights.dense(tt.EMBED) if own(tt.EMBED) else None
        self.output = shares.output if shares is not None else weights.matrix(tt.OUTPUT) if own(tt.OUTPUT) else None
        self.out_norm = weights.dense(tt.OUTPUT_NORM) if own(tt.OUTPUT_NORM) else None
        self.layers = {il: self._load_layer(weights, il) for il in held}
        self.experts: ExpertSource = resident_experts(weights, held if routed_experts else (), host)
        self.group_ids = mx.arange(args.o_groups)[None, :]
        self._written: list[mx.array] = []  # the state arrays of the call so far, evaluated by `head`
        self._rope: dict[tuple[bytes, bytes], tuple[mx.array, mx.array]] = {}  # cos/sin of the call

    def _load_layer(self, weights: Weights, il: int) -> Layer41:
        a, spec, w = self.args, self.args.layer(il), LayerWeights(weights, il)
        compressor = indexer = engram_weights = None
        if spec.has_compressor:
            gate = w.matrix(tt41.COMPRESSOR_GATE) if spec.has_gate else None
            compressor = (
                w.matrix(tt41.COMPRESSOR_KV), gate, w.dense(tt41.COMPRESSOR_NORM),
                w.matrix(tt41.INDEX_K), w.dense(tt41.INDEX_K_NORM),
            )  # fmt: skip
        if spec.has_index_query:
            indexer = w.matrix(tt41.INDEX_Q), w.matrix(tt41.INDEX_PROJ)
        if spec.engram:
            engram_weights = w.matrix(tt41.ENGRAM_KV), w.dense(tt41.ENGRAM_Q_NORM), w.dense(tt41.ENGRAM_K_NORM)
        return Layer41(
            hc={site: tuple(w.dense(n) for n in tt.hc_mix(site)) for site in tt.SITES},
            norm={site: w.dense(tt.sublayer_norm(site)) for site in tt.SITES},
            q_a=w.matrix("attn_q_a.weight"),
            q_b=w.matrix("attn_q_b.weight"),
            q_norm=w.dense(tt.Q_NORM),
            kv=w.matrix("attn_kv.weight"),
            kv_norm=w.dense(tt.KV_NORM),
            sinks=w.dense(tt.SINKS),
            wo_a=w.matrix(tt.OUT_A, groups=a.o_groups),
            wo_b=w.matrix(tt.OUT_B),
            inv_freq=np.array(yarn_inv_freq(a, spec), dtype=np.float64),  # type: ignore[arg-type]
            router=w.matrix(tt.ROUTER),
            bias=w.dense(tt.ROUTER_BIAS),
            image_bias=w.dense(tt41.ROUTER_BIAS_VL),
            shared=tuple(w.matrix(n) for n in tt.SHARED_EXPERT),
            compressor=compressor,
            indexer=indexer,
            engram=engram_weights,
        )

    def _tables(self, il: int, positions: torch.Tensor) -> tuple[mx.array, mx.array]:
        """cos/sin at the call's positions for the layer's frequencies, built once per call."""
        inv_freq, at = self.layers[il].inv_freq, positions.numpy()
        key = inv_freq.tobytes(), at.tobytes()
        if key not in self._rope:
            self._rope[key] = ops.rope_tables(at, inv_freq)
        return self._rope[key]

    def _wrote(self, *arrays: mx.array) -> None:
        self._written.extend(arrays)

    # -- streams -----------------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, images: Sequence[ImageSpan]) -> mx.array:
        ids = tokens.clamp(max=self.args.vocab_size - 1).numpy().astype(np.int32)  # image ids: their span's rows
        x = self.embedding[mx.array(ids)]
        for span in images:
            x[span.offset : span.stop] = mx.array(span.rows.numpy()).astype(x.dtype)
        return mx.broadcast_to(x[:, None, :], (x.shape[0], self.args.hc_mult, self.args.dim))

    def engram_rows(self, tokens: Sequence[int], start: int) -> dict[int, np.ndarray]:
        return self.store.call_rows(self.hash, tokens, start)

    def engram(self, il: int, h: mx.array, rows: np.ndarray, image: torch.Tensor | None) -> mx.array:
        out = engram.engram(h, mx.array(self.store.rows(il, rows)), *self.layers[il].engram, self.args.norm_eps)  # type: ignore[misc]
        if image is None:
            return out
        return mx.where(mx.array(image.numpy())[:, None, None], h, out)  # the gate is shut at image positions

    def mix(self, il: int, site: str, h: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.fused.hc_mix(h, *self.layers[il].hc[site])

    def sublayer_input(self, il: int, site: str, h: mx.array, pre: mx.array) -> mx.array:
        return ops.rms_norm(ops.collapse(h, pre), self.layers[il].norm[site], self.args.norm_eps)

    def hc_post(self, h: mx.array, out: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        return self.fused.hc_post(out, h, post, comb)

    def first_pre(self, tokens: int) -> mx.array:
        one_hot = (mx.arange(self.args.hc_mult) == 0).astype(mx.float32)
        return mx.broadcast_to(one_hot[None, :], (tokens, self.args.hc_mult))

    def head(self, h: mx.array, pre: mx.array) -> torch.Tensor:
        y = ops.rms_norm(ops.collapse(h, pre), self.out_norm, self.args.norm_eps)
        logits = self.output.matmul(y)
        mx.eval(logits, *self._written)
        self._written, self._rope = [], {}
        # a numpy copy, not torch ops: torch's thread hand-offs cost more than a copy on busy cores
        return torch.from_numpy(np.array(logits))

    # -- attention ---------------------------------------------------------------------------------------
    def query(self, il: int, x: mx.array, positions: torch.Tensor) -> tuple[mx.array, mx.array]:
        a, layer = self.args, self.layers[il]
        qr = ops.rms_norm(layer.q_a.matmul(x), layer.q_norm, a.norm_eps)
        q = layer.q_b.matmul(qr).reshape(x.shape[0], a.n_heads, a.head_dim)
        return self.fused.rope(q, *self._tables(il, positions)), qr

    def window_rows(self, il: int, x: mx.array, positions: torch.Tensor) -> mx.array:
        layer = self.layers[il]
        return window.window_rows(layer.kv.matmul(x), layer.kv_norm, *self._tables(il, positions), self.args.norm_eps)

    def window(
        self, kept: mx.array, new: mx.array, positions: torch.Tensor
    ) -> tuple[tuple[mx.array, mx.array], mx.array]:
        part, keep = window.window_keys(kept, new, positions.numpy(), self.args.window)
        self._wrote(keep)
        return part, keep

    def compress(
        self, il: int, x: mx.array, frontier: tuple[mx.array, mx.array] | None, start: int
    ) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None]:
        a, layer = self.args, self.layers[il]
        kv, gate, norm, w_k, k_norm = layer.compressor  # type: ignore[misc]
        score = None if gate is None else gate.matmul(x)
        if score is not None and frontier is None:
            frontier = csa2.new_frontier(a.head_dim)
        rows, keys, frontier = csa2.compress(
            kv.matmul(x), score, frontier, norm, w_k, k_norm, a.index_head_dim, layer.inv_freq, start, a.norm_eps
        )
        self._wrote(*(frontier or ()))
        return rows, keys, frontier

    def append(self, rows: mx.array, new: mx.array) -> mx.array:
        joined = mx.concatenate((rows, new))
        self._wrote(joined)
        return joined

    def index_scores(self, il: int, qr: mx.array, x: mx.array, keys: mx.array, positions: torch.Tensor) -> mx.array:
        a, layer = self.args, self.layers[il]
        w_q, proj = layer.indexer  # type: ignore[misc]
        iq = w_q.matmul(qr).reshape(x.shape[0], a.index_n_heads, a.index_head_dim)
        iq = ops.fp4_round(self.fused.rope(iq, *self._tables(il, positions)))
        return select.index_scores(iq, proj.matmul(x), keys, positions.numpy(), a.compress_ratios[il])

    def candidates(self, scores: mx.array, positions: torch.Tensor, ratio: int) -> mx.array:
        a = self.args
        return select.candidate_mask(scores, positions.numpy(), ratio, a.candidate_block_size, a.candidate_topk_blocks)

    def top_k(
        self, scores: mx.array, positions: torch.Tensor, ratio: int, end: int, candidates: mx.array | None
    ) -> mx.array:
        return select.top_k(scores, positions.numpy(), ratio, end, self.args.index_topk, candidates)

    def pick(self, rows: mx.array, picks: mx.array) -> tuple[mx.array, mx.array]:
        return mx.take(rows, mx.maximum(picks, 0), axis=0), picks >= 0

    def attend(self, il: int, q: mx.array, parts: list[tuple[mx.array, mx.array]], positions: torch.Tensor) -> mx.array:
        layer = self.layers[il]
        keys = mx.concatenate([k for k, _ in parts], axis=1)
        mask = mx.concatenate([m for _, m in parts], axis=1)
        o = self.fused.unrope(ops.sink_attention(q, keys, mask, layer.sinks), *self._tables(il, positions))
        return grouped_output(o, layer.wo_a, layer.wo_b, self.group_ids)

    # -- mixture of experts --------------------------------------------------------------------------------
    def moe(self, il: int, x: mx.array, image: torch.Tensor | None) -> mx.array:
        a, layer, swiglu = self.args, self.layers[il], self.fused.swiglu
        shut = None if image is None else mx.array(image.numpy())
        logits = layer.router.matmul(x)
        ids, weights = ops.route(logits, a.n_activated_experts, a.route_scale, layer.bias, None, shut, layer.image_bias)
        if self.host is not None and il in self.host:
            return host_moe(self.host, il, x, ids, weights, layer.shared, swiglu)
        stack, slots = self.experts.experts(il, ids)
        return routed_experts(x, stack, slots, weights, swiglu) + shared_expert(x, layer.shared, swiglu)
