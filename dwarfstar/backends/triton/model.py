"""The DeepSeek V4 forward pass lowered onto the Triton kernels.

Same structure and order as the reference backend (`backends/reference/model.py`, spec §2, §3.1):
per layer, mHC pre -> attention -> mHC post -> mHC pre -> MoE -> mHC post; inside attention the raw
KV row is written first, then the compressors (a row completed by token p is visible to p), then the
indexer's selection, then attention. The state is the backend-neutral `SequenceState`, kept on the
device: raw windows, row buffers and compressor frontiers are read and updated in place by the
kernels.

Everything that depends on the position is read on the device from `pos` (an int32 scalar): row
visibility, compressed-row indices, frontier slots, RoPE angles. What the host decides from the
position is only the launch shape (how many compressor rows a chunk emits, whether the raw window
is full), which is what lets `graphs.DecodeGraphs` capture a decode step once per shape and replay
it at every later position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import (
    attention,
    compressor,
    hc_head,
    hc_post,
    hc_pre,
    indexer_scores,
    moe_experts,
    moe_route,
    moe_sort,
    quant_blocks,
    topk,
)
from dwarfstar.backends.triton.kernels.qmatmul import GEMV_MAX_ROWS, qmatmul
from dwarfstar.backends.triton.kernels.rms_norm_rope import NORM_NONE, NORM_PLAIN, QAT_FP4, QAT_FP8, QAT_NONE
from dwarfstar.backends.triton.kernels.rms_norm_rope import rms_norm_rope as norm_rope
from dwarfstar.backends.triton.runtime import EXACT, Precision, interpreting
from dwarfstar.backends.triton.weights import FusedLinear, LayerWeights, ModelWeights
from dwarfstar.model.config import LayerSpec, yarn_inv_freq
from dwarfstar.model.state import CompressorState, LayerState, RowBuffer, SequenceState, check_batch

DECODE_SPLIT = 8  # attention row splits per head group when a chunk has few tokens (flash decoding)


def fused(linear: FusedLinear, x: torch.Tensor, precision: Precision = EXACT) -> dict[str, torch.Tensor]:
    """Run each part of a fused projection once; outputs are column slices of the parts' products."""
    out: dict[str, torch.Tensor] = {}
    for weight, names in linear.parts:
        y = qmatmul(x, weight, precision=precision)
        col = 0
        for name, rows in names:
            out[name] = y[:, col : col + rows]
            col += rows
    return out


def reserve(rows: RowBuffer, n: int) -> None:
    """Grow a row buffer's storage to hold n rows (kernels write rows in place, by index).

    Capacities stay multiples of 64: Triton specialises kernels on integer arguments divisible by
    16, and a captured decode graph must not need a new compilation when a buffer has grown.
    """
    if rows.data.shape[0] < n:
        capacity = -(-max(n, 2 * rows.data.shape[0]) // 64) * 64
        grown = torch.empty(capacity, rows.data.shape[1], device=rows.data.device)
        grown[: rows.n] = rows.data[: rows.n]
        rows.data = grown


class TritonModel:
    def __init__(
        self,
        weights: ModelWeights,
        qat: bool = True,
        precision: Precision = EXACT,
        max_seq_len: int | None = None,
    ) -> None:
        self.w, self.args, self.qat, self.precision = weights, weights.args, qat, precision
        self.device = weights.embed.data.device
        self.max_seq_len = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        self._inv_freq: dict[tuple[float, bool], torch.Tensor] = {}
        for layer in self.args.layers:
            key = (layer.rope_theta, layer.yarn)
            if key not in self._inv_freq:
                freq = yarn_inv_freq(self.args, layer)
                self._inv_freq[key] = torch.tensor(freq, dtype=torch.float64, device=self.device)

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.args, self.device)

    # -- checks and bookkeeping shared with the graph path -------------------------------------------------
    def check(self, tokens: torch.Tensor, state: SequenceState) -> None:
        check_batch([tokens], [state], self.args.vocab_size, self.max_seq_len)

    def prepare(self, state: SequenceState, t: int) -> None:
        """Make room in every row buffer for the rows this chunk can emit (kernels write by index)."""
        for layer in state.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    reserve(comp.rows, (state.pos + t) // comp.ratio)

    def commit(self, state: SequenceState, tokens: list[int], logits: torch.Tensor) -> None:
        """Host-side bookkeeping after the device work: positions, row counts, tokens, logits."""
        t = len(tokens)
        for layer in state.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.rows.n += compressor.emitted(state.pos, t, comp.ratio)
        state.pos += t
        state.tokens.extend(tokens)
        state.logits = logits[-1].clone()

    # -- the forward pass --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, tokens: Sequence[int] | torch.Tensor, state: SequenceState, all_logits: bool = True
    ) -> torch.Tensor:
        """Logits [T, vocab] (or [1, vocab] for the last token only) after the tokens; updates the state."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if tokens.numel() == 0:
            return torch.empty(0, self.args.vocab_size, device=self.device)
        self.check(tokens, state)
        self.prepare(state, tokens.numel())
        # a fill launches a kernel; a copy of a pageable host tensor would wait for the stream to drain
        if tokens.numel() == 1:
            tok = torch.full((1,), int(tokens[0]), dtype=torch.int32, device=self.device)
        else:
            tok = tokens.to(device=self.device, dtype=torch.int32)
        pos = torch.full((1,), state.pos, dtype=torch.int32, device=self.device)
        logits = self.launch(tok, pos, state, all_logits)
        self.commit(state, tokens.tolist(), logits)
        return logits

    def launch(self, tok: torch.Tensor, pos: torch.Tensor, state: SequenceState, all_logits: bool) -> torch.Tensor:
        """All device work of one chunk. Host values it uses: T, the window fill and the emitted row
        counts, all functions of (state.pos, T) fixed for a captured decode shape."""
        a, w = self.args, self.w
        t = tok.numel()
        # bf16 tensor-core operands pay off only for prefill-sized chunks; decode stays in fp32
        precision = self.precision if t > GEMV_MAX_ROWS else EXACT
        positions = pos.long() + torch.arange(t, device=self.device)
        angles = {key: ops.rope_angles(positions, inv) for key, inv in self._inv_freq.items()}
        h = quant_blocks.gather_rows(w.embed.data, w.embed.ggml_type, a.dim, tok, copies=a.hc_mult)
        for layer, lw, ls in zip(a.layers, w.layers, state.layers, strict=True):
            x, post, comb = hc_pre.hc_pre(h, *lw.hc_attn, lw.attn_norm, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
            hc_post.hc_post(h, self._attention(layer, lw, ls, x, pos, angles, state.pos, precision), post, comb)
            x, post, comb = hc_pre.hc_pre(h, *lw.hc_ffn, lw.ffn_norm, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
            hc_post.hc_post(h, self._moe(lw, x, tok, precision), post, comb)
        rows = h if all_logits else h[-1:]
        y = hc_head.hc_head(rows, *w.head_hc, w.out_norm, a.hc_eps, a.norm_eps)
        return qmatmul(y, w.output)

    def _attention(
        self,
        layer: LayerSpec,
        lw: LayerWeights,
        ls: LayerState,
        x: torch.Tensor,
        pos: torch.Tensor,
        angles: dict,
        p0: int,
        precision: Precision,
    ) -> torch.Tensor:
        a, t = self.args, x.shape[0]
        ang = angles[(layer.rope_theta, layer.yarn)]
        proj = fused(lw.from_a, x, precision)
        qr = norm_rope(proj["q_a"], weight=lw.q_norm, eps=a.norm_eps)
        qproj = fused(lw.from_qr, qr, precision)
        q = norm_rope(
            qproj["q_b"].unflatten(1, (a.n_heads, a.head_dim)), norm=NORM_PLAIN, eps=a.norm_eps,
            angles=ang, rope_dim=a.rope_dim,
        )  # fmt: skip
        n_prev = ls.raw_kv.shape[0]
        window_rows = torch.empty(n_prev + t, a.head_dim, device=self.device)
        window_rows[:n_prev] = ls.raw_kv
        norm_rope(
            proj["kv"], weight=lw.kv_norm, eps=a.norm_eps, angles=ang, rope_dim=a.rope_dim,
            qat=QAT_FP8 if self.qat else QAT_NONE, out=window_rows[n_prev:],
        )  # fmt: skip
        comp_rows = selected = None
        if layer.compress_ratio:
            comp_rows = self._compress(ls.compressor, proj, "comp", lw.compressor, layer, pos, p0, t, QAT_FP8)
        if layer.has_indexer:
            index_rows = self._compress(ls.indexer, proj, "idx", lw.indexer, layer, pos, p0, t, QAT_FP4)
            qi = norm_rope(
                qproj["idx_q"].unflatten(1, (a.index_n_heads, a.index_head_dim)), norm=NORM_NONE, angles=ang,
                rope_dim=a.rope_dim, qat=QAT_FP4 if self.qat else QAT_NONE,
            )  # fmt: skip
            # scores stay fp32 even in fast mode: the top-k boundary is where small errors change the model
            scores, valid = indexer_scores.indexer_scores(qi, proj["idx_heads"], index_rows, pos, layer.compress_ratio)
            selected = topk.topk_indices(scores, valid, a.index_topk)
        o = attention.attention(
            q, window_rows, n_prev, a.window, lw.sinks, ang, a.rope_dim, pos,
            comp_rows=comp_rows, ratio=layer.compress_ratio, selected=selected,
            split=DECODE_SPLIT if t <= 4 and not interpreting() else 1, precision=precision,
        )  # fmt: skip
        if n_prev == a.window and t == 1:
            ls.raw_kv.copy_(window_rows[1:])  # in place: a captured decode step keeps its pointers
        else:
            ls.raw_kv = window_rows[-a.window :].clone()
        grouped = qmatmul(o.view(t, -1), lw.wo_a, groups=a.o_groups, precision=precision)
        return qmatmul(grouped, lw.wo_b, precision=precision)

    def _compress(
        self,
        state: CompressorState,
        proj: dict[str, torch.Tensor],
        prefix: str,
        params: tuple[torch.Tensor, torch.Tensor],
        layer: LayerSpec,
        pos: torch.Tensor,
        p0: int,
        t: int,
        rounding: int,
    ) -> torch.Tensor:
        """Advance one compressor over the chunk; finished rows go into its row buffer. Returns the buffer."""
        ape, norm = params
        ratio = state.ratio
        n_emit = compressor.emitted(p0, t, ratio)
        pooled = compressor.compress_chunk(
            proj[f"{prefix}_kv"],
            proj[f"{prefix}_gate"],
            ape,
            state.frontier_kv,
            state.frontier_gate,
            pos,
            n_emit,
            ratio,
        )
        if n_emit:
            # row w sits at its window's first position, w * ratio
            row_pos = (pos.long() // ratio + torch.arange(n_emit, device=self.device)) * ratio
            inv = self._inv_freq[(layer.rope_theta, layer.yarn)]
            norm_rope(
                pooled, weight=norm, eps=self.args.norm_eps, angles=ops.rope_angles(row_pos, inv),
                rope_dim=self.args.rope_dim, qat=rounding if self.qat else QAT_NONE,
                out=state.rows.data, out_row=(pos, ratio),
            )  # fmt: skip
        return state.rows.data

    def _moe(self, lw: LayerWeights, f: torch.Tensor, tok: torch.Tensor, precision: Precision) -> torch.Tensor:
        a, t = self.args, f.shape[0]
        k = a.n_activated_experts
        ids, weights = moe_route.route(f, lw.router, lw.router_bias, lw.tid2eid, tok, k, a.route_scale)
        rows = 64 if precision.fast else 32  # fp32 operands take twice the registers and shared memory
        tiles = moe_sort.sort_by_expert(
            ids, a.n_routed_experts, moe_sort.tile_rows_for(t * k, a.n_routed_experts, rows)
        )
        parts = torch.empty(t, k + 1, a.dim, device=self.device)
        moe_experts.expert_ffn(
            f, lw.gate_exps, lw.up_exps, lw.down_exps, tiles, weights.view(-1), parts, 0, a.swiglu_limit, precision
        )
        shared = moe_sort.single_expert_tiles(t, self.device, moe_sort.tile_rows_for(t, 1, rows))
        moe_experts.expert_ffn(
            f, lw.gate_shared, lw.up_shared, lw.down_shared, shared, None, parts, k, a.swiglu_limit, precision
        )
        return parts
