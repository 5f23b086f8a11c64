"""DeepSeek V4 attention in torch: raw window, KV compressors, lightning indexer, sink attention.

A layer processes a chunk of T consecutive tokens against its per-sequence state, so one full
pass, chunked prefill and token-by-token decode all run the same code and give the same result
(spec §3.1). Order inside a chunk follows the official one: raw KV rows, then compressor rows
(a row completed by token p is visible to p), then indexer selection, then attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.model.config import LayerSpec, ModelArgs, yarn_inv_freq
from dwarfstar.model.state import CompressorState, LayerState

WeightGetter = Callable[[str], torch.Tensor]
# observer(layer index, attention mass on the compressed rows [T, H, N], indexer scores [T, N] with -inf
# where a row is not visible): lets training fit the indexer to the attention (tools/train_nano.py).
IndexerObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


class Compressor:
    """Softmax-gated pooling of `ratio` tokens into one row (ratio 4 pools 8 slots with overlap)."""

    def __init__(
        self,
        ratio: int,
        out_dim: int,
        w: WeightGetter,
        prefix: str,
        eps: float,
        finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.ratio, self.out_dim, self.eps, self.finish = ratio, out_dim, eps, finish
        self.overlap = ratio == 4
        self.wkv = w(f"{prefix}_kv.weight")
        self.wgate = w(f"{prefix}_gate.weight")
        self.ape = w(f"{prefix}_ape.weight")  # [ratio, width]: bias for the token's slot in its window
        self.norm = w(f"{prefix}_norm.weight")

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, state: CompressorState) -> None:
        r, off = self.ratio, state.current_offset
        n_pending = int(positions[0]) % r  # tokens of the window in progress already in the frontier
        kv = torch.cat((state.frontier_kv[off : off + n_pending], a @ self.wkv.T))
        gate = torch.cat((state.frontier_gate[off : off + n_pending], a @ self.wgate.T + self.ape[positions % r]))
        n = kv.shape[0] // r
        if n:
            win_kv, win_gate = kv[: n * r].view(n, r, -1), gate[: n * r].view(n, r, -1)
            if self.overlap:
                # row w pools the first half of window w-1 and the second half of window w; before
                # window 0 the frontier holds gate -inf, which gives those slots weight 0
                d = self.out_dim
                prev_kv = torch.cat((state.frontier_kv[None, :r], win_kv[:-1]))[..., :d]
                prev_gate = torch.cat((state.frontier_gate[None, :r], win_gate[:-1]))[..., :d]
                slots_kv = torch.cat((prev_kv, win_kv[..., d:]), dim=1)
                slots_gate = torch.cat((prev_gate, win_gate[..., d:]), dim=1)
                state.frontier_kv[:r], state.frontier_gate[:r] = win_kv[-1], win_gate[-1]
            else:
                slots_kv, slots_gate = win_kv, win_gate
            pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(1)
            row_positions = (state.rows.n + torch.arange(n)) * r  # a row sits at its window's first token
            state.rows.append(self.finish(ops.rms_norm(pooled, self.norm, self.eps), row_positions))
        rest = kv.shape[0] - n * r
        state.frontier_kv[off:] = 0.0
        state.frontier_gate[off:] = float("-inf")
        state.frontier_kv[off : off + rest] = kv[n * r :]
        state.frontier_gate[off : off + rest] = gate[n * r :]


class Attention:
    def __init__(self, args: ModelArgs, layer: LayerSpec, w: WeightGetter, qat: bool) -> None:
        self.args, self.layer, self.qat = args, layer, qat
        self.inv_freq = torch.tensor(yarn_inv_freq(args, layer), dtype=torch.float64)
        self.wq_a = w("attn_q_a.weight")
        self.q_norm = w("attn_q_a_norm.weight")
        self.wq_b = w("attn_q_b.weight")
        self.wkv = w("attn_kv.weight")
        self.kv_norm = w("attn_kv_a_norm.weight")
        self.sinks = w("attn_sinks.weight")
        # wo_a is block-diagonal over groups: group g maps its heads' concat to o_lora_rank dims
        self.wo_a = w("attn_output_a.weight").view(args.o_groups, args.o_lora_rank, -1)
        self.wo_b = w("attn_output_b.weight")
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
            self.wq_index = w("indexer.attn_q_b.weight")
            self.w_index_heads = w("indexer.proj.weight")
        self.observer: IndexerObserver | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        cos, sin = ops.rope_angles(positions, self.inv_freq)
        return ops.apply_rope(x, cos, sin, inverse)

    def _finish_kv_row(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = self._rope(rows, positions)
        return ops.fp8_round_nope(rows, self.args.rope_dim) if self.qat else rows

    def _finish_index_row(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = self._rope(rows, positions)
        return ops.indexer_round(rows) if self.qat else rows

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, state: LayerState) -> torch.Tensor:
        args, T = self.args, a.shape[0]
        qr = ops.rms_norm(a @ self.wq_a.T, self.q_norm, args.norm_eps)
        q = ops.rms_norm((qr @ self.wq_b.T).view(T, args.n_heads, args.head_dim), None, args.norm_eps)
        q = self._rope(q, positions)
        kv = self._rope(ops.rms_norm(a @ self.wkv.T, self.kv_norm, args.norm_eps), positions)
        if self.qat:
            kv = ops.fp8_round_nope(kv, args.rope_dim)

        raw = torch.cat((state.raw_kv, kv))
        raw_pos = torch.arange(int(positions[0]) - state.raw_kv.shape[0], int(positions[-1]) + 1)
        age = positions[:, None] - raw_pos[None, :]
        mask = (age >= 0) & (age < args.window)
        keys, index_scores = raw, None
        if self.compressor is not None:
            self.compressor(a, positions, state.compressor)
            rows = state.compressor.rows.rows
            # row w is complete, hence visible, once token ratio * (w + 1) - 1 has been seen
            visible = torch.arange(rows.shape[0])[None, :] < ((positions + 1) // self.layer.compress_ratio)[:, None]
            if self.indexer is not None:
                self.indexer(a, positions, state.indexer)
                index_scores = self._index_scores(qr, a, positions, state.indexer.rows.rows, visible)
                k = min(self.args.index_topk, index_scores.shape[1])
                if k:  # keep the top-k visible compressed rows per query (all if fewer)
                    chosen = torch.zeros_like(visible).scatter_(1, index_scores.topk(k, dim=1).indices, True)
                    visible = chosen & visible
            keys = torch.cat((raw, rows))
            mask = torch.cat((mask, visible), dim=1)
        state.raw_kv = raw[-args.window :]

        probs = ops.sink_attention_probs(q, keys, mask, self.sinks)
        if self.observer is not None and index_scores is not None:
            self.observer(self.layer.index, probs[..., raw.shape[0] :], index_scores)
        o = torch.einsum("thn,nd->thd", probs, keys)
        o = self._rope(o, positions, inverse=True)
        grouped = torch.einsum("tgi,goi->tgo", o.reshape(T, args.o_groups, -1), self.wo_a)
        return grouped.flatten(1) @ self.wo_b.T

    def _index_scores(
        self,
        qr: torch.Tensor,
        a: torch.Tensor,
        positions: torch.Tensor,
        index_rows: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Lightning indexer scores [T, N] of the compressed rows, -inf where a row is not visible."""
        args, T = self.args, a.shape[0]
        q = self._rope((qr @ self.wq_index.T).view(T, args.index_n_heads, args.index_head_dim), positions)
        if self.qat:
            q = ops.indexer_round(q)
        head_weights = (a @ self.w_index_heads.T) * (args.index_head_dim**-0.5 * args.index_n_heads**-0.5)
        per_head = torch.einsum("thd,nd->thn", q, index_rows).relu()
        return (per_head * head_weights[..., None]).sum(1).masked_fill(~visible, float("-inf"))
