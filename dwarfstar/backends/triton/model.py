"""DeepSeek V4's operations on the Triton kernels: `TritonOps`, driven by the shared forward pass.

The order of the operations is `dwarfstar.model.forward.Transformer`'s; this module only says how
each runs on the device. The states are slots of the KV cache (`model.state.KVCache`) on the device:
the raw-window rings, the rows and the compressor frontiers are read and updated in place. The
matrices, the mHC and the MoE run on all rows of a batch at once (each weight is read once per
step); attention, the compressors and the indexer run per sequence in a prefill, and in one launch
for every sequence of a cache block in a decode step (`decode_batch`).

Everything that depends on the position is read on the device from a sequence's `pos` (an int32
scalar): row visibility, compressed-row indices, frontier slots, RoPE angles. What the host decides
from the position is only the launch shape (how many compressor rows a chunk emits, whether the raw
window is full), which is what lets `graphs.DecodeGraphs` capture a decode step once per shape and
replay it at every later position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dwarfstar.backends.triton.kernels import (
    attention,
    compressor,
    decode_rows,
    hc_head,
    hc_post,
    hc_pre,
    indexer_scores,
    moe_experts,
    moe_route,
    quant_blocks,
    topk,
)
from dwarfstar.backends.triton.kernels.expert_int8 import Q8Rows
from dwarfstar.backends.triton.kernels.qmatmul import GEMV_MAX_ROWS, qmatmul
from dwarfstar.backends.triton.kernels.qmatmul import project as gemv_project
from dwarfstar.backends.triton.kernels.rms_norm_rope import (
    NORM_NONE,
    NORM_PLAIN,
    QAT_FP4,
    QAT_FP8,
    QAT_NONE,
    query_rows,
)
from dwarfstar.backends.triton.kernels.rms_norm_rope import rms_norm_rope as norm_rope
from dwarfstar.backends.triton.moe import experts_ffn, host_ffn
from dwarfstar.backends.triton.runtime import EXACT, TICKET_SLOTS, PagedRows, Precision, next_pow2
from dwarfstar.backends.triton.step import DecodeInputs, PendingRows, TritonStep
from dwarfstar.backends.triton.weights import FusedLinear, ModelWeights
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.forward import Batch, ExpertSource, ResidentExperts, Rows, Segment, Site, Transformer
from dwarfstar.model.image_spans import ImageSpan, check_router_biases, image_mask, window_reach
from dwarfstar.model.numerics import rope_angles
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import ROW_STEP, KVCache, SequenceState, TorchStorage, check_batch, index_copy_rows
from dwarfstar.model.tensors import ProjectionGroup

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts


def row_bound(cache: KVCache, ratio: int, end: int) -> int:
    """The rows of `ratio` visible before position `end`, rounded up to a power of two (at least
    ROW_STEP, at most a slot's capacity)."""
    return min(cache.capacity(ratio), max(ROW_STEP, next_pow2(end // ratio)))


def paged_index(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Where `rows` (int64 row numbers) lie in a pool's flattened rows, on the device: the page one
    sequence's table [n] names for each, times PAGE_ROWS, plus the row in the page."""
    return table[rows // PAGE_ROWS].long() * PAGE_ROWS + rows % PAGE_ROWS


def decode_batch(batch: Batch[TritonStep]) -> bool:
    """Sequences, one token each, in one block of the KV cache: one launch can serve them. One alone
    takes the same kernels (as a graph's bucket of 1 does), so a sequence's decode step has the same
    bits alone and beside others (issue 37)."""
    seqs = batch.seqs
    return all(s.length == 1 and s.state.block == seqs[0].state.block for s in seqs)


class TritonOps:
    def __init__(
        self, weights: ModelWeights, qat: bool = True, precision: Precision = EXACT, host: HostExperts | None = None
    ) -> None:
        """`host`: the layers whose routed experts the CPU kernels compute (`--cpu-moe`)."""
        self.w, self.args, self.qat, self.precision = weights, weights.args, qat, precision
        self.device, self.layer_range, self.host = weights.device, weights.layer_range, host
        # weights uploaded without their routed experts stream them: `experts.attach` sets the source
        on_device = [il for il in self.layer_range if host is None or il not in host]
        streamed = bool(on_device) and weights.layers[on_device[0]].gate_exps is None
        routed = {il: (lw.gate_exps, lw.up_exps, lw.down_exps) for il, lw in weights.layers.items()}
        self.experts: ExpertSource | None = None if streamed else ResidentExperts(routed)
        self._inv_freq: dict[tuple[float, bool], torch.Tensor] = {}
        self.image_biases: dict[int, torch.Tensor] = {}  # layer -> its router's image bias (`bias_vl`)
        for layer in self.args.layers:
            key = (layer.rope_theta, layer.yarn)
            if key not in self._inv_freq:
                freq = yarn_inv_freq(self.args, layer)
                self._inv_freq[key] = torch.tensor(freq, dtype=torch.float64, device=self.device)

    def kv_storage(self) -> TorchStorage:
        # compact rows where QAT rounds them, so bf16 holds their rounded dims exactly
        return TorchStorage(self.device, compact=self.qat)

    @staticmethod
    def paged_rows(il: int, kind: str, state: SequenceState, slots: bool = False) -> PagedRows:
        """A layer's rows of the state's block: the pool, and the state's page table (the block's
        tables, one row per slot, with `slots`)."""
        table = state.row_pages(state.compressor(il, kind).ratio).table
        return PagedRows(state.parts(il)[f"{kind}_rows"], table if slots else table[state.index])

    @staticmethod
    def rows_in_reach(il: int, kind: str, state: SequenceState, end: int) -> int:
        """The rows a launch may read up to position `end`: the visible count rounded up to a power
        of two (at least ROW_STEP). The kernels count the visible rows on the device; this bound sizes
        their grids to the sequence rather than to the whole context, and it changes only when a
        sequence crosses a power of two (a captured decode step is captured once per bound)."""
        return row_bound(state.cache, state.compressor(il, kind).ratio, end)

    @staticmethod
    def _bound(batch: Batch[TritonStep], decode: DecodeInputs, ratio: int) -> int:
        """The row bound of a batched step: the widest of its sequences' (`row_bound`)."""
        if decode.row_bound is not None:  # a captured step fixes it for every replay
            return decode.row_bound[ratio]
        return max(row_bound(s.state.cache, ratio, s.start + 1) for s in batch.seqs)

    def attach_image_biases(self, biases: Mapping[int, torch.Tensor]) -> None:
        self.image_biases = {il: bias.to(self.device) for il, bias in biases.items()}

    def check_images(self) -> None:
        check_router_biases(self.image_biases.get(il) for il in self.layer_range)

    # -- per call ----------------------------------------------------------------------------------------
    def prepare(self, batch: Batch[TritonStep]) -> TritonStep:
        """Tokens and positions on the device. A decode step of several sequences in one KV-cache block
        runs batch-native (`decode_batch`, `DecodeInputs`); any other call per sequence, each with its
        first position (int32 [1]) and RoPE tables at every row. A call with image spans prefills."""
        tokens = torch.cat([s.tokens for s in batch.seqs])
        if any(s.images for s in batch.seqs):
            return self._prepare_images(batch, tokens)
        # a fill launches a kernel; a copy of a pageable host tensor would wait for the stream to drain
        if tokens.numel() == 1:
            tok = torch.full((1,), int(tokens[0]), dtype=torch.int32, device=self.device)
        else:
            tok = tokens.to(device=self.device, dtype=torch.int32)
        decode = None
        if decode_batch(batch):
            host = torch.tensor([[s.start for s in batch.seqs], [s.state.index for s in batch.seqs]])
            decode = DecodeInputs(*host.to(self.device, torch.int32).unbind(0))  # contiguous rows
        return self.record(batch, tok, decode)

    def _prepare_images(self, batch: Batch[TritonStep], tokens: torch.Tensor) -> TritonStep:
        """`prepare` of a call with image spans: per sequence, as a prefill (a span query's window
        reaches past its own row), the image rows' ids 0."""
        image = torch.cat([image_mask(s.images, s.length) for s in batch.seqs])
        tok = tokens.masked_fill(image, 0).to(device=self.device, dtype=torch.int32)
        reach = {i: window_reach(s.images, s.start, s.length, self.args.window) for i, s in enumerate(batch.seqs)}
        return replace(
            self.record(batch, tok, None),
            image=image.nonzero().flatten().to(self.device),
            reach={i: r.to(device=self.device, dtype=torch.int32) for i, r in reach.items() if r is not None},
        )

    def record(self, batch: Batch[TritonStep], tok: torch.Tensor, decode: DecodeInputs | None) -> TritonStep:
        """The call's record over device inputs already made: `prepare`'s, or a captured step's buffers."""
        n = batch.n_rows
        starts, angles = [], {}
        if decode is None:
            starts = [torch.full((1,), s.start, dtype=torch.int32, device=self.device) for s in batch.seqs]
            pairs = zip(starts, batch.seqs, strict=True)
            positions = torch.cat([p.long() + torch.arange(s.length, device=self.device) for p, s in pairs])
            angles = {key: rope_angles(positions, inv) for key, inv in self._inv_freq.items()}
        return TritonStep(
            tok=tok,
            precision=self.precision if n > GEMV_MAX_ROWS else EXACT,
            fused=n <= TICKET_SLOTS and all(s.length == 1 for s in batch.seqs),
            decode=decode,
            starts=starts,
            angles=angles,
        )

    def embed(self, batch: Batch[TritonStep]) -> torch.Tensor | None:
        a, step = self.args, batch.step
        w = self.w.embed
        if w is None:  # a later pipeline stage: its streams arrive from the previous one
            return None
        h = quant_blocks.gather_rows(w.data, w.ggml_type, a.dim, step.tok, copies=a.hc_mult)
        if step.image is not None:  # the spans' rows in place of the image positions' (row 0) lookups
            for seq in batch.seqs:
                for span in seq.images:
                    at = seq.rows.start + span.offset
                    h[at : at + span.length] = span.rows.to(self.device)[:, None, :]
        return h

    # -- streams -----------------------------------------------------------------------------------------
    def _pre_mix(self, il: int, site: Site) -> tuple:
        """The sublayer's mix (fn, scale, base) and norm, then the constants of `hc_pre.hc_pre`."""
        a, lw = self.args, self.w.layers[il]
        mix, norm = (lw.hc_attn, lw.attn_norm) if site == "attn" else (lw.hc_ffn, lw.ffn_norm)
        return *mix, norm, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps

    def hc_pre(self, il: int, site: Site, h: torch.Tensor, batch: Batch[TritonStep]) -> tuple[torch.Tensor, tuple]:
        x, post, comb = hc_pre.hc_pre(h, *self._pre_mix(il, site), fused=batch.step.fused)
        return x, (post, comb)

    def kept(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone()  # hc_post and hc_post_pre update the streams in place

    def hc_post(self, h: torch.Tensor, out: torch.Tensor, mix: tuple, batch: Batch[TritonStep]) -> torch.Tensor:
        return hc_post.hc_post(h, out, *mix)  # in place

    def hc_post_pre(
        self, il: int, site: Site, h: torch.Tensor, out: torch.Tensor, mix: tuple, batch: Batch[TritonStep]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """One launch in a decode step (`hc_pre.hc_post_pre`); h is updated in place."""
        if batch.step.fused:
            x, post, comb = hc_pre.hc_post_pre(h, out, *mix, *self._pre_mix(il, site))
        else:
            hc_post.hc_post(h, out, *mix)
            x, post, comb = hc_pre.hc_pre(h, *self._pre_mix(il, site))
        return h, x, (post, comb)

    def _head(self) -> tuple:
        a, w = self.args, self.w
        return *w.head_hc, w.out_norm, a.hc_eps, a.norm_eps

    def hc_head(self, h: torch.Tensor, rows: list[int] | None, batch: Batch[TritonStep]) -> torch.Tensor:
        return hc_head.hc_head(h if rows is None else h[rows], *self._head(), fused=batch.step.fused)

    def hc_collapse(self, h: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        a = self.args
        return hc_head.hc_head(h, *self.w.head_hc, None, a.hc_eps, a.norm_eps)

    def output_norm(self, y: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        return norm_rope(y, weight=self.w.out_norm, eps=self.args.norm_eps)

    def hc_post_head(
        self, h: torch.Tensor, out: torch.Tensor, mix: tuple, rows: list[int] | None, batch: Batch[TritonStep]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch in a decode step, where the head takes every row (`hc_head.hc_post_head`)."""
        if batch.step.fused and (rows is None or rows == list(range(h.shape[0]))):
            return h, hc_head.hc_post_head(h, out, *mix, *self._head())
        hc_post.hc_post(h, out, *mix)
        return h, self.hc_head(h, rows, batch)

    def logits(self, y: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        return qmatmul(y, self.w.output, use_dot=False if self._gemv(y, batch.step) else None)

    # -- attention ---------------------------------------------------------------------------------------
    def project(
        self, il: int, group: ProjectionGroup, x: torch.Tensor, batch: Batch[TritonStep]
    ) -> dict[str, torch.Tensor]:
        linear: FusedLinear = self.w.layers[il].projections[group.name]
        if self._gemv(x, batch.step):  # decode: the parts' block types in one GEMV launch, side by side
            products = [gemv_project(x, [weight for weight, _ in linear.parts])]
            named = [[n for _, names in linear.parts for n in names]]
        else:
            products = [qmatmul(x, weight, precision=batch.step.precision) for weight, _ in linear.parts]
            named = [names for _, names in linear.parts]
        out: dict[str, torch.Tensor] = {}
        for y, names in zip(products, named, strict=True):  # outputs are column slices of the products
            col = 0
            for name, rows in names:
                out[name] = y[:, col : col + rows]
                col += rows
        return out

    def _gemv(self, x: torch.Tensor, step: TritonStep) -> bool:
        """Whether the matrices take x's rows through the GEMV: up to GEMV_MAX_ROWS, and in an exact
        decode step any number, so that a row's product has the bits of its one-row plan whatever its
        company (issue 37; the GEMV reads the weights once per GEMV_MAX_ROWS rows)."""
        return x.shape[0] <= GEMV_MAX_ROWS or (step.fused and not self.precision.fast)

    def _inv(self, il: int) -> torch.Tensor:
        """The layer's RoPE inverse frequencies, float64 [rope_dim / 2] on the device."""
        layer = self.args.layer(il)
        return self._inv_freq[(layer.rope_theta, layer.yarn)]

    def norm_rope(self, il: int, kind: Rows, x: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        a, lw, step = self.args, self.w.layers[il], batch.step
        if step.decode is not None:
            return self._decode_rows(il, kind, x, batch, step.decode)
        if kind is Rows.Q_LORA:
            return norm_rope(x, weight=lw.q_norm, eps=a.norm_eps)
        layer = self.args.layer(il)
        ang = step.angles[(layer.rope_theta, layer.yarn)]
        if kind is Rows.QUERY:
            q = x.unflatten(1, (a.n_heads, a.head_dim))
            return norm_rope(q, norm=NORM_PLAIN, eps=a.norm_eps, angles=ang, rope_dim=a.rope_dim)
        if kind is Rows.KV:
            return self._finish_kv(il, x, ang)
        q = x.unflatten(1, (a.index_n_heads, a.index_head_dim))
        return norm_rope(q, norm=NORM_NONE, angles=ang, rope_dim=a.rope_dim, qat=QAT_FP4 if self.qat else QAT_NONE)

    def _finish_kv(self, il: int, kv: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Raw KV rows as projected -> normed, rotated at `angles` and rounded (FP8 nope dims with QAT)."""
        a, qat = self.args, QAT_FP8 if self.qat else QAT_NONE
        return norm_rope(
            kv, weight=self.w.layers[il].kv_norm, eps=a.norm_eps, angles=angles, rope_dim=a.rope_dim, qat=qat
        )

    def _decode_rows(
        self, il: int, kind: Rows, x: torch.Tensor, batch: Batch[TritonStep], decode: DecodeInputs
    ) -> torch.Tensor:
        """A batch-native decode step's rows in two launches per layer. The raw KV row (returned as
        projected: `write_window` keeps it) and the compressors' inputs wait in `TritonStep.pending`
        until the low-rank query's launch (`decode_rows`) finishes them with it; in ratio-4 layers the
        query heads (returned unfilled) wait for the indexer query's launch (`query_rows`), which fills
        both. `Transformer.attention` calls them in that order; `sparse_attention` checks nothing waits."""
        a, lw, layer = self.args, self.w.layers[il], self.args.layer(il)
        pending = batch.step.pending.setdefault(il, PendingRows())
        if kind is Rows.KV:
            return x
        heads, index_heads = (a.n_heads, a.head_dim), (a.index_n_heads, a.index_head_dim)
        if kind is Rows.QUERY and layer.has_indexer:
            pending.query = x, torch.empty(x.shape[0], *heads, device=self.device)
            return pending.query[1]
        if kind is not Rows.Q_LORA:
            q, out, index_q = (x, None, None) if kind is Rows.QUERY else (*self._waiting_query(il, pending), x)
            pos, inv = decode.pos, self._inv(il)
            done = query_rows(q, index_q, pos, inv, heads, index_heads, a.rope_dim, a.norm_eps, self.qat, out)
            return done[0] if kind is Rows.QUERY else done[1]
        kinds = {"attn"} if layer.compress_ratio else set()
        kinds |= {"indexer"} if layer.has_indexer else set()
        kv, compressing = pending.kv, pending.compressing
        if kv is None or set(compressing) != kinds:
            needs = ["kv", *sorted(kinds)]
            raise DwarfStarError(f"layer {il}: the low-rank query's rows come after {needs} (Transformer.attention)")
        pending.kv, pending.compressing = None, {}
        rings = batch.seqs[0].state.parts(il)["raw"]
        return decode_rows.decode_rows(
            decode.pos, decode.slots, self._inv(il), x, lw.q_norm, kv, lw.kv_norm, rings, layer.compress_ratio,
            a.rope_dim, a.norm_eps, self.qat, compressing.get("attn"), compressing.get("indexer"),
        )  # fmt: skip

    @staticmethod
    def _waiting_query(il: int, pending: PendingRows) -> tuple[torch.Tensor, torch.Tensor]:
        query, pending.query = pending.query, None
        if query is None:
            raise DwarfStarError(f"layer {il}: the indexer query's rows come after the query's (Transformer.attention)")
        return query

    def write_window(self, il: int, kv: torch.Tensor, batch: Batch[TritonStep]) -> None:
        """Each sequence's window rows [n_prev + T], oldest first, for its attention kernel: the ring's
        rows before the chunk, gathered by device-computed index (a captured step replays at any
        position), then the chunk's. The ring keeps the chunk's rows once attention has read them."""
        step = batch.step
        if step.decode is not None:  # one token each: its row replaces one its query no longer sees
            step.pending.setdefault(il, PendingRows()).kv = kv  # finished into the ring by the low-rank query's launch
            return
        pairs = zip(batch.seqs, step.starts, strict=True)
        step.window[il] = [self._window_rows(il, seq, pos, kv) for seq, pos in pairs]

    def _window_rows(self, il: int, seq: Segment, pos: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """The sequence's window rows [n_prev + T], oldest first: the ring's rows before its chunk,
        gathered by device-computed index from `pos` (its first position), then its rows of kv."""
        window = self.args.window
        n_prev = min(seq.start, window)
        rows = torch.empty(n_prev + seq.length, self.args.head_dim, device=self.device)
        if n_prev:
            ring = seq.state.part(il, "raw")
            older = (pos.long() - n_prev + torch.arange(n_prev, device=self.device)) % window
            torch.index_select(ring, 0, older, out=rows[:n_prev])
        rows[n_prev:] = kv[seq.rows]
        return rows

    def extend_window(self, il: int, kv: torch.Tensor, batch: Batch[TritonStep]) -> None:
        """Each sequence's rows into its ring (its last `window` kept). One row a sequence is prepared as
        a decode step, whose `norm_rope` leaves the KV row as projected for the low-rank query's launch
        (`_decode_rows`), which a DSpark context pass has not: it is finished here as a chunk's row is."""
        step = batch.step
        if step.decode is not None:
            kv = self._finish_kv(il, kv, rope_angles(step.decode.pos.long(), self._inv(il)))
        for seq in batch.seqs:
            seq.state.store_window(il, kv[seq.rows], seq.start + seq.length)

    def block_attention(self, il: int, q: torch.Tensor, kv: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        """Per sequence, its queries over its window rows (`_window_rows`) both ways, in one launch
        (`attention.block_attention`); the ring is left as it was."""
        a, lw, step = self.args, self.w.layers[il], batch.step
        if step.decode is not None:
            raise DwarfStarError("block attention takes blocks of several rows, not a decode step's one")
        out, inv = [], self._inv(il)
        for seq, pos in zip(batch.seqs, step.starts, strict=True):
            rows = self._window_rows(il, seq, pos, kv)
            out.append(attention.block_attention(q[seq.rows], rows, lw.sinks, inv, a.rope_dim, pos, step.precision))
        return out[0] if len(out) == 1 else torch.cat(out)

    def compress(self, il: int, kind: str, proj: dict[str, torch.Tensor], batch: Batch[TritonStep]) -> None:
        a, lw = self.args, self.w.layers[il]
        ape, norm = lw.compressor if kind == "attn" else lw.indexer
        rounding = (QAT_FP8 if kind == "attn" else QAT_FP4) if self.qat else QAT_NONE
        inv, step = self._inv(il), batch.step
        if step.decode is not None:  # advanced by the low-rank query's launch
            state = batch.seqs[0].state
            parts = state.parts(il)
            step.pending.setdefault(il, PendingRows()).compressing[kind] = decode_rows.Compressing(
                proj[f"{kind}_kv"], proj[f"{kind}_gate"], ape, norm, parts[f"{kind}_kv"], parts[f"{kind}_gate"],
                self.paged_rows(il, kind, state, slots=True),
            )  # fmt: skip
            return
        for seq, pos in zip(batch.seqs, step.starts, strict=True):
            state, ratio = seq.state, seq.state.compressor(il, kind).ratio
            n_emit = compressor.emitted(seq.start, seq.length, ratio)
            kv, gate = proj[f"{kind}_kv"][seq.rows], proj[f"{kind}_gate"][seq.rows]
            front_kv, front_gate = state.part(il, f"{kind}_kv"), state.part(il, f"{kind}_gate")
            pooled = compressor.compress_chunk(kv, gate, ape, front_kv, front_gate, pos, n_emit, ratio)
            if n_emit:
                # row w sits at its window's first position, w * ratio, in the page its table names
                index = pos.long() // ratio + torch.arange(n_emit, device=self.device)
                angles, rows = rope_angles(index * ratio, inv), self.paged_rows(il, kind, state)
                normed = norm_rope(
                    pooled, weight=norm, eps=a.norm_eps, angles=angles, rope_dim=a.rope_dim, qat=rounding
                )
                index_copy_rows(rows.pool, paged_index(rows.table, index), normed)

    def index_topk(
        self, il: int, q: torch.Tensor, weights: torch.Tensor, batch: Batch[TritonStep]
    ) -> list[torch.Tensor]:
        """Per sequence, the selected row indices int32 [T, k] (the kernel pads with -1 where fewer)."""
        ratio, chosen, decode = self.args.layer(il).compress_ratio, [], batch.step.decode
        if decode is not None:
            rows = self.paged_rows(il, "indexer", batch.seqs[0].state, slots=True)
            bound = self._bound(batch, decode, ratio)
            return indexer_scores.indexer_topk_batch(
                q, weights, rows, decode.pos, decode.slots, bound, ratio, self.args.index_topk
            )
        for seq, pos in zip(batch.seqs, batch.step.starts, strict=True):
            rows = self.paged_rows(il, "indexer", seq.state)
            bound = self.rows_in_reach(il, "indexer", seq.state, seq.start + seq.length)
            # scores stay fp32 even in fast mode: the top-k boundary is where small errors change the model
            scores, valid = indexer_scores.indexer_scores(q[seq.rows], weights[seq.rows], rows, bound, pos, ratio)
            chosen.append(topk.topk_indices(scores, valid, self.args.index_topk))
        return chosen

    def sparse_attention(self, il: int, q: torch.Tensor, batch: Batch[TritonStep], selected) -> torch.Tensor:
        a, lw, layer = self.args, self.w.layers[il], self.args.layer(il)
        inv, step = self._inv(il), batch.step
        if step.decode is not None:
            left = step.pending.pop(il, None)
            if left is not None and left.waiting:
                raise DwarfStarError(f"layer {il}: decode rows left unfinished (Transformer.attention's order)")
            state, ratio, decode = batch.seqs[0].state, layer.compress_ratio, step.decode
            return attention.attention_batch(
                q, state.parts(il)["raw"], lw.sinks, inv, a.rope_dim, decode.pos, decode.slots,
                comp_rows=self.paged_rows(il, "attn", state, slots=True) if ratio else None,
                comp_bound=self._bound(batch, decode, ratio) if ratio else 0,
                ratio=ratio, selected=selected, precision=step.precision,
            )  # fmt: skip
        out = []
        windows = step.window.pop(il)
        for i, (seq, pos, rows) in enumerate(zip(batch.seqs, step.starts, windows, strict=True)):
            state = seq.state
            n_prev = rows.shape[0] - seq.length
            end = seq.start + seq.length
            comp, bound = None, None
            if layer.compress_ratio:
                comp, bound = self.paged_rows(il, "attn", state), self.rows_in_reach(il, "attn", state, end)
            o = attention.attention(
                q[seq.rows], rows, n_prev, a.window, lw.sinks, inv, a.rope_dim, pos,
                comp_rows=comp, ratio=layer.compress_ratio, selected=None if selected is None else selected[i],
                split=None, precision=step.precision, comp_bound=bound, reach=step.reach.get(i),
            )  # fmt: skip
            keep = min(seq.length, a.window)  # the chunk's newest rows replace the oldest in the ring
            newest = (pos.long() + seq.length - keep + torch.arange(keep, device=self.device)) % a.window
            state.part(il, "raw").index_copy_(0, newest, rows[-keep:])
            out.append(o)
        return out[0] if len(out) == 1 else torch.cat(out)

    def attn_output(self, il: int, o: torch.Tensor, batch: Batch[TritonStep]) -> torch.Tensor:
        lw, precision = self.w.layers[il], batch.step.precision
        dot = False if self._gemv(o, batch.step) else None
        grouped = qmatmul(o.view(o.shape[0], -1), lw.wo_a, self.args.o_groups, precision=precision, use_dot=dot)
        return qmatmul(grouped, lw.wo_b, precision=precision, use_dot=dot)

    # -- mixture of experts --------------------------------------------------------------------------------
    def route(self, il: int, x: torch.Tensor, batch: Batch[TritonStep]) -> tuple[torch.Tensor, torch.Tensor]:
        a, lw = self.args, self.w.layers[il]
        k, scale, step = a.n_activated_experts, a.route_scale, batch.step
        # a decode step's int8 experts read x as int8 rows, which the routing launch stores as it reads x
        int8 = step.fused and x.shape[0] <= moe_experts.DECODE_TOKENS and lw.gate_exps is not None
        int8 = int8 and moe_experts.int8_form(lw.gate_exps, lw.down_exps, self.precision)
        xq = Q8Rows.empty(*x.shape, self.device) if int8 else None
        if xq is not None:
            step.routed[il] = (x, xq)
        ids, weights = moe_route.route(x, lw.router, lw.router_bias, lw.tid2eid, step.tok, k, scale, step.fused, q8=xq)
        if step.image is not None:  # image rows select by the image bias, in hash-routed layers too
            rows = step.image
            ids[rows], weights[rows] = moe_route.route(
                x[rows], lw.router, self.image_biases[il], None, step.tok[rows], k, scale
            )
        return ids, weights

    def moe(
        self,
        il: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertSource,
        batch: Batch[TritonStep],
    ) -> torch.Tensor:
        a, lw, t = self.args, self.w.layers[il], x.shape[0]
        precision = batch.step.precision
        shared = (lw.gate_shared, lw.up_shared, lw.down_shared)
        routed_x = batch.step.routed.pop(il, None)
        if self.host is not None and il in self.host:
            return host_ffn(self.host, il, x, ids, weights, shared, a.swiglu_limit, precision)
        routed, slots = experts.experts(il, ids)
        # two launches a DECODE_TOKENS rows, routed and shared
        decode = self.precision if t <= moe_experts.DECODE_TOKENS or self._gemv(x, batch.step) else None
        # the routing launch's int8 rows of x, if it wrote them (a step of at most DECODE_TOKENS rows)
        xq = routed_x[1] if routed_x is not None and routed_x[0] is x else None
        return experts_ffn(x, slots, weights, routed, shared, a.swiglu_limit, precision, decode, xq)


class TritonModel(Transformer[torch.Tensor, TritonStep]):
    """The shared forward pass over `TritonOps`."""

    ops: TritonOps

    def __init__(
        self,
        weights: ModelWeights,
        qat: bool = True,
        precision: Precision = EXACT,
        max_seq_len: int | None = None,
        kv_slots: int = 4,
        host: HostExperts | None = None,
    ) -> None:
        """`kv_slots`: sequences per KV-cache block; a decode step batches the sequences of a block.
        `host`: the layers whose routed experts the CPU kernels compute (`--cpu-moe`)."""
        self.w, self.qat, self.precision = weights, qat, precision
        self.device = weights.device
        super().__init__(TritonOps(weights, qat, precision, host), max_seq_len, kv_slots)

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits=False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """A decode step of sequences in several KV-cache blocks runs block by block, each block's
        sequences batch-native (`decode_batch`): a sequence's step has the kernels, and the bits, it has
        alone whatever blocks its company holds (issue 37). Checked whole before any block runs."""
        blocks: dict[tuple[KVCache, int], list[int]] = {}
        if all(torch.as_tensor(t).numel() == 1 for t in token_lists):
            for i, state in enumerate(states):
                blocks.setdefault(state.block, []).append(i)
        if len(blocks) <= 1 or (images is not None and any(images)):
            return super().forward_batch(token_lists, states, all_logits, images)
        check_batch(token_lists, states, self.args.vocab_size, self.max_seq_len)
        out: list[torch.Tensor] = [torch.empty(0)] * len(states)
        for rows in blocks.values():
            block = super().forward_batch([token_lists[i] for i in rows], [states[i] for i in rows], all_logits)
            for i, logits in zip(rows, block, strict=True):
                out[i] = logits
        return out
