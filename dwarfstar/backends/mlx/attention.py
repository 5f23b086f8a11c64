"""DeepSeek V4 attention in MLX: raw window, KV compressors, lightning indexer, sink attention.

A line-for-line port of `dwarfstar.backends.reference.attention` (read that module for the model):
a layer runs a chunk of T consecutive tokens against its state, so a full pass, chunked prefill and
decode share one code path. Positions stay on the host as numpy integers, so the masks, slot
indices and rope tables are built there and the device graph has no data-dependent shapes; a
whole forward pass is evaluated once.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from dwarfstar.backends.mlx import ops
from dwarfstar.backends.mlx.state import MLXCompressorState, MLXLayerState
from dwarfstar.backends.mlx.weights import LayerWeights
from dwarfstar.model.config import LayerSpec, ModelArgs, yarn_inv_freq

RowFinish = Callable[[mx.array, np.ndarray], mx.array]


class Compressor:
    """Softmax-gated pooling of `ratio` tokens into one row (ratio 4 pools 8 slots with overlap)."""

    def __init__(self, ratio: int, out_dim: int, w: LayerWeights, prefix: str, eps: float, finish: RowFinish) -> None:
        self.ratio, self.out_dim, self.eps, self.finish = ratio, out_dim, eps, finish
        self.overlap = ratio == 4
        self.wkv = w.matrix(f"{prefix}_kv.weight")
        self.wgate = w.matrix(f"{prefix}_gate.weight")
        self.ape = w.dense(f"{prefix}_ape.weight")  # [ratio, width]: bias for the token's slot in its window
        self.norm = w.dense(f"{prefix}_norm.weight")

    def __call__(self, a: mx.array, positions: np.ndarray, state: MLXCompressorState) -> None:
        r, off = self.ratio, state.current_offset
        front_kv, front_gate = state.mx_frontier_kv, state.mx_frontier_gate
        n_pending = int(positions[0]) % r  # tokens of the window in progress already in the frontier
        slots = mx.array(positions % r)
        kv = mx.concatenate((front_kv[off : off + n_pending], self.wkv.matmul(a)))
        gate = mx.concatenate((front_gate[off : off + n_pending], self.wgate.matmul(a) + self.ape[slots]))
        n = kv.shape[0] // r
        kept_kv, kept_gate = front_kv[:off], front_gate[:off]  # ratio 4: the previous window
        if n:
            win_kv, win_gate = kv[: n * r].reshape(n, r, -1), gate[: n * r].reshape(n, r, -1)
            if self.overlap:
                # row w pools the first half of window w-1 and the second half of window w; before
                # window 0 the frontier holds gate -inf, which gives those slots weight 0
                d = self.out_dim
                prev_kv = mx.concatenate((front_kv[None, :r], win_kv[:-1]))[..., :d]
                prev_gate = mx.concatenate((front_gate[None, :r], win_gate[:-1]))[..., :d]
                win_kv = mx.concatenate((prev_kv, win_kv[..., d:]), axis=1)
                win_gate = mx.concatenate((prev_gate, win_gate[..., d:]), axis=1)
                kept_kv, kept_gate = kv[(n - 1) * r : n * r], gate[(n - 1) * r : n * r]
            pooled = (win_kv * mx.softmax(win_gate, axis=1)).sum(1)
            row_positions = (state.rows.n + np.arange(n)) * r  # a row sits at its window's first token
            state.rows.append(self.finish(ops.rms_norm(pooled, self.norm, self.eps), row_positions))
        rest = kv.shape[0] - n * r
        pad = front_kv.shape[0] - off - rest
        width = front_kv.shape[1]
        state.mx_frontier_kv = mx.concatenate((kept_kv, kv[n * r :], mx.zeros((pad, width))))
        state.mx_frontier_gate = mx.concatenate((kept_gate, gate[n * r :], mx.full((pad, width), -mx.inf)))


class Attention:
    def __init__(self, args: ModelArgs, layer: LayerSpec, w: LayerWeights, qat: bool, fused: ops.Fused) -> None:
        self.args, self.layer, self.qat, self.fused = args, layer, qat, fused
        self.inv_freq = np.array(yarn_inv_freq(args, layer), dtype=np.float64)
        self.wq_a = w.matrix("attn_q_a.weight")
        self.q_norm = w.dense("attn_q_a_norm.weight")
        self.wq_b = w.matrix("attn_q_b.weight")
        self.wkv = w.matrix("attn_kv.weight")
        self.kv_norm = w.dense("attn_kv_a_norm.weight")
        self.sinks = w.dense("attn_sinks.weight")
        # wo_a is block-diagonal over groups: group g maps its heads' concat to o_lora_rank dims,
        # so it is loaded as a stack of o_groups matrices and applied with a gathered product
        self.wo_a = w.matrix("attn_output_a.weight", groups=args.o_groups)
        self.group_ids = mx.arange(args.o_groups)[None, :]
        self.wo_b = w.matrix("attn_output_b.weight")
        ratio = layer.compress_ratio
        self.compressor = (
            Compressor(ratio, args.head_dim, w, "attn_compressor", args.norm_eps, self._finish_kv_row)
            if ratio
            else None
        )
        self.indexer = None
        if layer.has_indexer:
            self.indexer = Compressor(
                ratio, args.index_head_dim, w, "indexer_compressor", args.norm_eps, self._finish_index_row
            )
            self.wq_index = w.matrix("indexer.attn_q_b.weight")
            self.w_index_heads = w.matrix("indexer.proj.weight")

    def _finish_kv_row(self, rows: mx.array, positions: np.ndarray) -> mx.array:
        rows = self.fused.rope(rows, *ops.rope_tables(positions, self.inv_freq))
        return self.fused.fp8_round_nope(rows) if self.qat else rows

    def _finish_index_row(self, rows: mx.array, positions: np.ndarray) -> mx.array:
        rows = self.fused.rope(rows, *ops.rope_tables(positions, self.inv_freq))
        return self.fused.indexer_round(rows) if self.qat else rows

    def __call__(self, a: mx.array, positions: np.ndarray, state: MLXLayerState) -> mx.array:
        args, T = self.args, a.shape[0]
        cos, sin = ops.rope_tables(positions, self.inv_freq)
        qr = ops.rms_norm(self.wq_a.matmul(a), self.q_norm, args.norm_eps)
        q = ops.rms_norm(self.wq_b.matmul(qr).reshape(T, args.n_heads, args.head_dim), None, args.norm_eps)
        q = self.fused.rope(q, cos, sin)
        kv = self.fused.rope(ops.rms_norm(self.wkv.matmul(a), self.kv_norm, args.norm_eps), cos, sin)
        if self.qat:
            kv = self.fused.fp8_round_nope(kv)

        n_old = state.mx_raw_kv.shape[0]
        raw = mx.concatenate((state.mx_raw_kv, kv))
        raw_pos = np.arange(int(positions[0]) - n_old, int(positions[-1]) + 1)
        age = positions[:, None] - raw_pos[None, :]
        mask = mx.array((age >= 0) & (age < args.window))
        keys = raw
        if self.compressor is not None:
            self.compressor(a, positions, state.compressor)
            rows = state.compressor.rows.mx_rows
            # row w is complete, hence visible, once token ratio * (w + 1) - 1 has been seen
            visible = mx.array(
                np.arange(rows.shape[0])[None, :] < ((positions + 1) // self.layer.compress_ratio)[:, None]
            )
            if self.indexer is not None:
                self.indexer(a, positions, state.indexer)
                visible = self._select(qr, a, cos, sin, state.indexer.rows.mx_rows, visible)
            keys = mx.concatenate((raw, rows))
            mask = mx.concatenate((mask, visible), axis=1)
        state.mx_raw_kv = raw[-args.window :]

        o = ops.sink_attention(q, keys, mask, self.sinks)
        o = self.fused.unrope(o, cos, sin)
        groups = mx.broadcast_to(self.group_ids, (T, args.o_groups))
        grouped = self.wo_a.gather(o.reshape(T, args.o_groups, 1, -1), groups)
        return self.wo_b.matmul(grouped.reshape(T, -1))

    def _select(
        self, qr: mx.array, a: mx.array, cos: mx.array, sin: mx.array, index_rows: mx.array, visible: mx.array
    ) -> mx.array:
        """Lightning indexer: keep the top-k visible compressed rows per query (all if fewer)."""
        args, T = self.args, a.shape[0]
        q = self.wq_index.matmul(qr).reshape(T, args.index_n_heads, args.index_head_dim)
        q = self.fused.rope(q, cos, sin)
        if self.qat:
            q = self.fused.indexer_round(q)
        head_weights = self.w_index_heads.matmul(a) * (args.index_head_dim**-0.5 * args.index_n_heads**-0.5)
        per_head = mx.maximum(q @ index_rows.T, 0.0)  # [T, heads, rows]
        scores = mx.where(visible, (per_head * head_weights[..., None]).sum(1), -mx.inf)
        n_rows = scores.shape[1]
        k = min(args.index_topk, n_rows)
        if k == 0 or k == n_rows:
            return visible
        top = mx.argpartition(-scores, kth=k - 1, axis=1)[:, :k]
        chosen = mx.put_along_axis(mx.zeros((T, n_rows), dtype=mx.bool_), top, mx.array(True), axis=1)
        return chosen & visible
