"""The reference backend: DeepSeek V4's operations in plain torch float32, the numerical oracle.

`ReferenceOps` implements `dwarfstar.model.forward.Ops` as directly as the official code reads
(spec §2, §3, §9); the order of the operations is `Transformer`'s. A prefill chunk's attention and
compressors run per sequence (each has its own KV), a decode step's for all sequences at once, and
everything else on all rows of a batch at once, so batched decode reads each weight once per step.

Batch-invariant (issue 37): a token's logits and KV rows are the same bits whatever else shares the
call, however its prompt was cut into chunks, and whether a chunk or a decode step ran it: every
product goes through `ops.linear`, attention through `ops.attention_rows` with the decode step's key
layout on both paths, the indexer's top-k breaks ties by row (`ops.top_k_visible`). Rounding-level
differences would otherwise not stay small: a value near a rounding midpoint of the FP8 KV or FP4
indexer QAT moves by a whole grid step, and an exact tie in the indexer's scores went either way.

`qat=False` skips the FP8 KV and Hadamard/FP4 indexer rounding, for comparison with implementations
that do not apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.weights import FLOAT32, GGUFWeights, Products, WeightSource
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import LayerSpec, ModelArgs, yarn_inv_freq
from dwarfstar.model.forward import Batch, ExpertSource, ResidentExperts, Rows, Segment, Site, StreamSteps, Transformer
from dwarfstar.model.image_spans import check_router_biases, image_mask
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.numerics import rope_angles, route
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import SequenceState, TorchStorage
from dwarfstar.model.tensors import ProjectionGroup
from dwarfstar.sampling import sample_batch

SMALL_MODEL_DIM = 1024
ATTENTION_BYTES = 1 << 26  # a prefill chunk's attention runs its queries in blocks of about this many key bytes

# observer(layer, attention mass on the compressed rows [T, H, N], indexer scores [T, N], -inf where a
# row is not visible): lets training fit the indexer to the attention (tools/train_nano.py)
IndexerObserver = Callable[[int, torch.Tensor, torch.Tensor], None]
# observer(layer, chosen expert ids [T, k]): training balances the learned routers' load with it
RouteObserver = Callable[[int, torch.Tensor], None]
# observer(layer, expert tensor name, expert id, the rows that expert matrix multiplies): imatrix collection
ExpertObserver = Callable[[int, str, int, torch.Tensor], None]
# a layer's routed experts as the reference reads them: expert id -> (gate, up, down) float32 matrices
ExpertGetter = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class Layer:
    """One block's weights, named by the tensor table's roles."""

    spec: LayerSpec
    hc: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    norm: dict[str, torch.Tensor]
    proj: dict[str, torch.Tensor]  # every `ProjectionGroup` part of the layer, by key
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    sinks: torch.Tensor
    wo_a: torch.Tensor  # [o_groups * o_lora_rank, heads_per_group * head_dim]: group g from row g * o_lora_rank
    wo_b: torch.Tensor
    compressors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # kind -> (ape, norm)
    inv_freq: torch.Tensor
    router: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    bias_vl: torch.Tensor | None = None  # the router's bias for image positions (`attach_image_biases`)


@dataclass(frozen=True, slots=True)
class ReferenceStep:
    """One call as `ReferenceOps` runs it (`prepare`), and what its steps of a layer hand on."""

    # int64 [N]: every row's id for the tables looked up by id (the embedding, hash-routed layers' experts);
    # 0 at image-span positions, whose ids are past the tables
    tokens: torch.Tensor
    positions: torch.Tensor  # int64 [N]: every row's position
    # bool [N]: the rows at image-span positions (their ids are image ids, past the vocabulary), or None
    # in a call without spans: `embed` and `route` read it
    image: torch.Tensor | None
    # a decode step: one token per sequence, attention and the compressors for all at once (`_decode_step`)
    decode: bool
    # a decode step's sequences' slots when all are in one cache block (gathered in one op), else None
    slots: torch.Tensor | None
    # cos/sin at `positions` per RoPE base (rope_theta, yarn): `norm_rope` fills it at the first layer
    # of a base, `norm_rope` and `sparse_attention` read it in every layer of that base
    angles: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer -> the call's finished KV rows [N, head_dim]: `write_window` leaves them, `sparse_attention`
    # takes them (a chunk's attention reads them before the ring keeps them)
    window: dict[int, torch.Tensor] = field(default_factory=dict)
    # (layer, compressor kind) -> per sequence in batch order, its compressed rows with the ones the call
    # finished: `compress` leaves them in a prefill chunk; `index_topk` takes the indexer's,
    # `sparse_attention` the attention's (autograd, when training, runs through these, not the cache)
    compressed: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)
    # layer -> per sequence, the indexer's scores [T, rows] with -inf where a row is not visible:
    # `index_topk` leaves them while an indexer observer is set, `sparse_attention` takes them for it
    index_scores: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def expert_reader(weights: WeightSource, il: int, products: Products = FLOAT32) -> ExpertGetter:
    """Layer il's routed experts by id, read from the source as the router picks them (dequantized
    per use for files too large to expand, or as `products` hold them)."""
    names = [tt.layer_tensor(il, name) for name in tt.EXPERTS]
    return lambda e: tuple(products.expert(weights, name, e) for name in names)


class ReferenceOps(StreamSteps):
    def __init__(
        self,
        args: ModelArgs,
        weights: WeightSource,
        qat: bool,
        progress: Callable[[int, int], None] | None,
        layer_range: range | None = None,
        products: Products = FLOAT32,
    ) -> None:
        """`layer_range`: the layers to load (a pipeline stage's), with the embedding when it starts at
        0 and the head when it ends at the last layer; `layers` is keyed by the global index.
        `products`: how the weight products are held and computed (float32 here; the CPU kernels')."""
        report = progress or (lambda done, total: None)
        self.args, self.qat, self.products = args, qat, products
        self.layer_range = range(args.n_layers) if layer_range is None else layer_range
        self.experts = ResidentExperts({il: expert_reader(weights, il, products) for il in self.layer_range})
        self.indexer_observer: IndexerObserver | None = None
        self.route_observer: RouteObserver | None = None
        self.expert_observer: ExpertObserver | None = None
        total = len(self.layer_range) + 2
        self.embedding = products.table(weights, tt.EMBED) if self.layer_range.start == 0 else None
        report(1, total)
        self.layers: dict[int, Layer] = {}
        for done, il in enumerate(self.layer_range, start=2):
            self.layers[il] = self._load_layer(weights, il)
            report(done, total)
        self.head_hc = self.out_norm = self.output = None
        if self.layer_range.stop == args.n_layers:
            self.head_hc = tuple(weights.dense(name) for name in tt.HEAD_HC)
            self.out_norm = weights.dense(tt.OUTPUT_NORM)
            self.output = products.matrix(weights, tt.OUTPUT)
        report(total, total)

    def _load_layer(self, weights: WeightSource, il: int) -> Layer:
        a, spec = self.args, self.args.layer(il)

        def w(name: str) -> torch.Tensor:
            return weights.dense(tt.layer_tensor(il, name))

        def m(name: str):  # a product weight, as `self.products` hold it
            return self.products.matrix(weights, tt.layer_tensor(il, name))

        return Layer(
            spec=spec,
            hc={site: tuple(w(n) for n in tt.hc_mix(site)) for site in tt.SITES},
            norm={site: w(tt.sublayer_norm(site)) for site in tt.SITES},
            proj={p.key: m(p.tensor) for g in tt.PROJECTION_GROUPS for p in g.present(spec)},
            q_norm=w(tt.Q_NORM),
            kv_norm=w(tt.KV_NORM),
            sinks=w(tt.SINKS),
            wo_a=m(tt.OUT_A),
            wo_b=m(tt.OUT_B),
            compressors={
                kind: tuple(w(n) for n in tt.compressor(kind))
                for kind in tt.COMPRESSORS
                if (kind == "attn" and spec.compress_ratio) or (kind == "indexer" and spec.has_indexer)
            },
            inv_freq=torch.tensor(yarn_inv_freq(a, spec), dtype=torch.float64),
            router=w(tt.ROUTER),
            bias=None if spec.hash_routed else w(tt.ROUTER_BIAS),
            tid2eid=w(tt.HASH_TABLE).long() if spec.hash_routed else None,
            shared=tuple(m(n) for n in tt.SHARED_EXPERT),
        )

    def kv_storage(self) -> TorchStorage:
        return TorchStorage("cpu")  # the oracle keeps every part in float32

    def attach_image_biases(self, biases: Mapping[int, torch.Tensor]) -> None:
        for il, bias in biases.items():
            self.layers[il].bias_vl = bias

    def check_images(self) -> None:
        check_router_biases(self.layers[il].bias_vl for il in self.layer_range)

    # -- per call ----------------------------------------------------------------------------------------
    def prepare(self, batch: Batch[ReferenceStep]) -> ReferenceStep:
        """The call's ids and positions, and whether it is a decode step: one token for each sequence.
        A step gathers each sequence's keys into one padded [B, ...] array and runs attention once for
        all of them (per-sequence attention made a batched step cost nearly as much as its sequences
        stepped alone). Prefill chunks, and the training observer, which reads per-sequence scores,
        take the per-sequence path."""
        seqs = batch.seqs
        images = any(s.images for s in seqs)
        # a call with image spans prefills: its spans' window attention is the chunk path's
        decode = all(s.length == 1 for s in seqs) and self.indexer_observer is None and not images
        # sequences of one cache block are gathered by slot index in one op, others one by one
        one_block = len({s.state.block for s in seqs}) == 1
        image = torch.cat([image_mask(s.images, s.length) for s in seqs]) if images else None
        tokens = torch.cat([s.tokens for s in seqs])
        return ReferenceStep(
            tokens=tokens if image is None else tokens.masked_fill(image, 0),
            positions=torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]),
            image=image,
            decode=decode,
            slots=torch.tensor([s.state.index for s in seqs]) if decode and one_block else None,
        )

    # -- streams -----------------------------------------------------------------------------------------
    def embed(self, batch: Batch[ReferenceStep]) -> torch.Tensor | None:
        if self.embedding is None:
            return None
        step = batch.step
        x = self.embedding[step.tokens]
        if step.image is not None:  # the spans' rows in place of the image positions' (row 0) lookups
            for seq in batch.seqs:
                for span in seq.images:
                    at = seq.rows.start + span.offset
                    x[at : at + span.length] = span.rows.to(x.dtype)
        return x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()

    def hc_pre(self, il: int, site: Site, h: torch.Tensor, batch: Batch[ReferenceStep]) -> tuple[torch.Tensor, tuple]:
        a, layer = self.args, self.layers[il]
        x, post, comb = ops.hc_pre(h, *layer.hc[site], a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        return ops.rms_norm(x, layer.norm[site], a.norm_eps), (post, comb)

    def hc_post(self, h: torch.Tensor, out: torch.Tensor, mix: tuple, batch: Batch[ReferenceStep]) -> torch.Tensor:
        return ops.hc_post(out, h, *mix)

    def hc_head(self, h: torch.Tensor, rows: list[int] | None, batch: Batch[ReferenceStep]) -> torch.Tensor:
        a = self.args
        h = h if rows is None else h[rows]
        return ops.rms_norm(ops.hc_head(h, *self.head_hc, a.hc_eps, a.norm_eps), self.out_norm, a.norm_eps)

    def hc_collapse(self, h: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        return ops.hc_head(h, *self.head_hc, self.args.hc_eps, self.args.norm_eps)

    def output_norm(self, y: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        return ops.rms_norm(y, self.out_norm, self.args.norm_eps)

    def logits(self, y: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        return self.products.linear(y, self.output)

    # -- attention ---------------------------------------------------------------------------------------
    def project(
        self, il: int, group: ProjectionGroup, x: torch.Tensor, batch: Batch[ReferenceStep]
    ) -> dict[str, torch.Tensor]:
        layer, x = self.layers[il], self.products.input(x)
        return {p.key: self.products.linear(x, layer.proj[p.key]) for p in group.present(layer.spec)}

    def _angles(self, il: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.layers[il].inv_freq)

    def _batch_angles(self, il: int, step: ReferenceStep) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at every row's position, once per call for each RoPE base (layers share a few)."""
        spec = self.layers[il].spec
        key = (spec.rope_theta, spec.yarn)
        if key not in step.angles:
            step.angles[key] = self._angles(il, step.positions)
        return step.angles[key]

    def norm_rope(self, il: int, kind: Rows, x: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        a, layer = self.args, self.layers[il]
        if kind is Rows.Q_LORA:
            return ops.rms_norm(x, layer.q_norm, a.norm_eps)
        angles = self._batch_angles(il, batch.step)
        if kind is Rows.QUERY:
            return ops.apply_rope(ops.rms_norm(x.view(x.shape[0], a.n_heads, a.head_dim), None, a.norm_eps), *angles)
        if kind is Rows.KV:
            kv = ops.apply_rope(ops.rms_norm(x, layer.kv_norm, a.norm_eps), *angles)
            return ops.fp8_round_nope(kv, a.rope_dim) if self.qat else kv
        q = ops.apply_rope(x.view(x.shape[0], a.index_n_heads, a.index_head_dim), *angles)
        return ops.indexer_round(q) if self.qat else q

    def write_window(self, il: int, kv: torch.Tensor, batch: Batch[ReferenceStep]) -> None:
        """The chunk's rows join the window for attention; the ring keeps them once attention has read
        the rows they replace."""
        batch.step.window[il] = kv

    def compress(self, il: int, kind: str, proj: dict[str, torch.Tensor], batch: Batch[ReferenceStep]) -> None:
        """Pool each sequence's finished windows; the call reads its new rows from `step.compressed`, and
        the state keeps detached copies (autograd, when training, runs through a call, not through the cache)."""
        step = batch.step
        if step.decode:
            return self._decode_compress(il, kind, proj, batch)
        a, (ape, norm) = self.args, self.layers[il].compressors[kind]
        compressed = step.compressed[(il, kind)] = []
        for seq in batch.seqs:
            state, spec = seq.state, seq.state.compressor(il, kind)
            kv, gate = proj[f"{kind}_kv"][seq.rows], proj[f"{kind}_gate"][seq.rows]
            front = state.part(il, f"{kind}_kv"), state.part(il, f"{kind}_gate")
            rows, *front = ops.compress(spec, *front, kv, gate, ape, norm, seq.start, a.norm_eps)
            state.write(il, f"{kind}_kv", front[0].detach())
            state.write(il, f"{kind}_gate", front[1].detach())
            first = seq.start // spec.ratio
            if rows.shape[0]:
                rows = self._finish_rows(il, kind, rows, (first + torch.arange(rows.shape[0])) * spec.ratio)
                state.write(il, f"{kind}_rows", rows.detach(), first)
            compressed.append(torch.cat((state.rows(il, kind), rows)))

    def _finish_rows(self, il: int, kind: str, rows: torch.Tensor, window_starts: torch.Tensor) -> torch.Tensor:
        """Pooled rows rotated at their window's first token, then QAT-rounded as they are stored."""
        rows = ops.apply_rope(rows, *self._angles(il, window_starts))
        if not self.qat:
            return rows
        return ops.fp8_round_nope(rows, self.args.rope_dim) if kind == "attn" else ops.indexer_round(rows)

    def _visible(self, il: int, seq: Segment, n_rows: int) -> torch.Tensor:
        """[T, n_rows]: row w is complete, hence visible, once token ratio * (w + 1) - 1 has been seen."""
        positions = torch.arange(seq.start, seq.start + seq.length)
        ratio = self.layers[il].spec.compress_ratio
        return torch.arange(n_rows)[None, :] < ((positions + 1) // ratio)[:, None]

    def index_topk(
        self, il: int, q: torch.Tensor, weights: torch.Tensor, batch: Batch[ReferenceStep]
    ) -> list[torch.Tensor]:
        """Per sequence, the mask [T, rows] of the compressed rows each query attends to (for a
        decode step, one [B, rows] mask over the rows `_slot_rows` gathers). A query scores its rows
        alike on both paths (`ops.index_scores`, `ops.top_k_visible`)."""
        a = self.args
        weights = weights * (a.index_head_dim**-0.5 * a.index_n_heads**-0.5)
        step = batch.step
        if step.decode:
            keys, visible = self._slot_rows(il, "indexer", batch)
            return ops.top_k_visible(ops.index_scores(q, weights, keys), visible, a.index_topk)
        chosen, observed = [], []
        for seq, keys in zip(batch.seqs, step.compressed.pop((il, "indexer")), strict=True):
            visible = self._visible(il, seq, keys.shape[0])
            scores = ops.index_scores(q[seq.rows], weights[seq.rows], keys.expand(seq.length, -1, -1))
            if self.indexer_observer is not None:  # training fits the indexer to the attention with them
                observed.append(scores.masked_fill(~visible, float("-inf")))
            chosen.append(ops.top_k_visible(scores, visible, a.index_topk))
        if observed:
            step.index_scores[il] = observed
        return chosen

    def sparse_attention(self, il: int, q: torch.Tensor, batch: Batch[ReferenceStep], selected) -> torch.Tensor:
        step = batch.step
        cos, sin = self._batch_angles(il, step)
        chunk = step.window.pop(il)
        if step.decode:
            o = self._decode_attention(il, q, chunk, batch, selected)
        else:
            n = len(batch.seqs)
            picks = [None] * n if selected is None else selected
            rows = step.compressed.pop((il, "attn"), [None] * n)
            scores = step.index_scores.pop(il, [None] * n)
            o = torch.cat(
                [
                    self._chunk_attention(il, q[seq.rows], chunk[seq.rows], seq, *parts)
                    for seq, *parts in zip(batch.seqs, picks, rows, scores, strict=True)
                ]
            )
        return ops.apply_rope(o, cos, sin, inverse=True)

    def _chunk_attention(
        self,
        il: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        seq: Segment,
        selected: torch.Tensor | None,
        rows: torch.Tensor | None,
        scores: torch.Tensor | None,
    ) -> torch.Tensor:
        """A prefill chunk's attention [T, H, D] for one sequence, each query over its keys laid out as a
        decode step lays them (`ops.attention_rows`): the window as the ring holds it at the query's
        position (position p in slot p mod window), then the compressed rows visible to it. So a token
        gets the same bits in a chunk of any length as in a decode step of any batch. `rows`: the
        sequence's compressed rows (`compress`), `scores`: its indexer scores for the observer.

        A query inside an image span's START..END reads a part more between the two: the span's raw rows
        its window lacks (`_span_keys`); the others' view of that part is all masked, which adds exact
        zeros, so text queries keep their bits."""
        a, layer, state = self.args, self.layers[il], seq.state
        end = seq.start + seq.length
        span = self._span_keys(seq, kv)
        raw = torch.cat((state.raw_window(il), kv))  # positions end - len(raw) .. end - 1
        state.store_window(il, raw.detach(), end)
        positions = torch.arange(seq.start, end)[:, None]
        held = positions - (positions - torch.arange(a.window)) % a.window  # [T, window]: each slot's position
        at = (held - (end - raw.shape[0])).clamp(min=0)  # where in `raw`
        if rows is not None:
            visible = self._visible(il, seq, rows.shape[0]) if selected is None else selected
            pad = -rows.shape[0] % ops.KEY_BLOCK  # to whole key blocks once, not in each query's view
            rows, visible = F.pad(rows, (0, 0, 0, pad)), F.pad(visible, (0, pad))
        out, mass = [], []
        keys = a.window + (0 if rows is None else rows.shape[0]) + (0 if span is None else span[0].shape[0])
        step = max(1, ATTENTION_BYTES // (keys * a.head_dim * 4))
        for lo in range(0, seq.length, step):
            block = slice(lo, lo + step)
            parts = [(raw[at[block]], held[block] >= 0)]
            if span is not None:
                parts.append((span[0].expand(q[block].shape[0], -1, -1), span[1][block]))
            if rows is not None:
                parts.append((rows.expand(q[block].shape[0], -1, -1), visible[block]))
            o, weights = ops.attention_rows(q[block], parts, layer.sinks)
            out.append(o)
            mass.append(weights[-1])
        if self.indexer_observer is not None and scores is not None:
            self.indexer_observer(il, torch.cat(mass)[..., : scores.shape[1]], scores)
        return torch.cat(out)

    def _span_keys(self, seq: Segment, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The raw rows of a chunk's bidirectional image spans (their START..END, all in the call) [n, D],
        and which of them each of its queries reads beyond its causal window [T, n] (the range
        `ImageSpan.window_bounds` gives, less the window's own positions); None without such spans."""
        spans = [span for span in seq.images if span.attend is not None]
        if not spans:
            return None
        window, keys, masks = self.args.window, [], []
        for span in spans:
            at, lo, hi = span.window_bounds(seq.start, window)  # the span's positions and their key ranges
            keys.append(kv[at - seq.start])
            key, query = at[None, :], at[:, None]
            beyond = (key >= lo[:, None]) & (key <= hi[:, None]) & ((key <= query - window) | (key > query))
            mask = torch.zeros(seq.length, at.numel(), dtype=torch.bool)
            mask[at - seq.start] = beyond
            masks.append(mask)
        return torch.cat(keys), torch.cat(masks, 1)

    # -- decode steps: attention over every sequence at once -------------------------------------------------
    def _gather(self, il: int, name: str, batch: Batch[ReferenceStep], n: int | None = None) -> torch.Tensor:
        """A decode step's sequences' arrays of a part, [B, ...] (the first n rows of each)."""
        rows, slots = slice(n), batch.step.slots
        if slots is not None:
            return batch.seqs[0].state.parts(il)[name][slots, rows]
        return torch.stack([s.state.part(il, name)[rows] for s in batch.seqs])

    def _scatter(
        self,
        il: int,
        name: str,
        batch: Batch[ReferenceStep],
        value: torch.Tensor,
        at: torch.Tensor | None = None,
        which: torch.Tensor | None = None,
    ) -> None:
        """Write value[i] into a part of the i-th decode-step sequence (of those `which` picks): the
        whole array, or its row at[i]."""
        slots = batch.step.slots
        if slots is not None and not name.endswith("_rows"):  # rows go through their pages, one by one
            part, index = batch.seqs[0].state.parts(il)[name], slots if which is None else slots[which]
            part[(index,) if at is None else (index, at)] = value
            return
        seqs = batch.seqs if which is None else [s for s, w in zip(batch.seqs, which.tolist(), strict=True) if w]
        for i, seq in enumerate(seqs):
            if at is None:
                seq.state.write(il, name, value[i])
            else:
                seq.state.write(il, name, value[i : i + 1], int(at[i]))

    def _decode_compress(self, il: int, kind: str, proj: dict[str, torch.Tensor], batch: Batch[ReferenceStep]) -> None:
        """`compress` for a decode step, all sequences at once (`ops.compress_step`)."""
        spec, (ape, norm) = batch.seqs[0].state.compressor(il, kind), self.layers[il].compressors[kind]
        positions = batch.step.positions
        front = self._gather(il, f"{kind}_kv", batch), self._gather(il, f"{kind}_gate", batch)
        kv, gate = proj[f"{kind}_kv"], proj[f"{kind}_gate"]
        rows, done, *front = ops.compress_step(spec, *front, kv, gate, ape, norm, positions, self.args.norm_eps)
        self._scatter(il, f"{kind}_kv", batch, front[0].detach())
        self._scatter(il, f"{kind}_gate", batch, front[1].detach())
        if rows.shape[0]:
            window = positions[done] // spec.ratio
            rows = self._finish_rows(il, kind, rows, window * spec.ratio)
            self._scatter(il, f"{kind}_rows", batch, rows.detach(), at=window, which=done)

    def _slot_rows(self, il: int, kind: str, batch: Batch[ReferenceStep]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's compressed rows [B, n, dim], n the most any sequence has, and which are its
        own [B, n]: those its windows completed, the row its token just finished included."""
        ratio = self.layers[il].spec.compress_ratio
        counts = (batch.step.positions + 1) // ratio
        n = int(counts.max())
        at, slots = torch.arange(n), batch.step.slots
        if slots is not None:  # one index op: page (by each slot's table) and row in the page
            state = batch.seqs[0].state
            pages = state.row_pages(ratio).table[slots][:, at // PAGE_ROWS].long()
            rows = state.parts(il)[f"{kind}_rows"][pages, at % PAGE_ROWS]
        else:
            rows = torch.stack([self._table_rows(il, kind, s.state, at) for s in batch.seqs])
        return rows, at[None, :] < counts[:, None]

    @staticmethod
    def _table_rows(il: int, kind: str, state: SequenceState, at: torch.Tensor) -> torch.Tensor:
        """Rows `at` of the state's pages; where it has none, whatever its table's entry points at."""
        pages = state.row_pages(state.compressor(il, kind).ratio).table[state.index, at // PAGE_ROWS].long()
        return state.parts(il)[f"{kind}_rows"][pages, at % PAGE_ROWS]

    def _decode_attention(
        self, il: int, q: torch.Tensor, kv: torch.Tensor, batch: Batch[ReferenceStep], selected
    ) -> torch.Tensor:
        """Sink attention of a decode step, [B, H, D] before the inverse RoPE: each token's row goes
        into its ring first (over the row that has left the window), then the query reads the ring's
        filled rows and its visible compressed rows (`selected` by the indexer for ratio 4)."""
        a, layer, positions = self.args, self.layers[il], batch.step.positions
        self._scatter(il, "raw", batch, kv.detach(), at=positions % a.window)
        filled = torch.arange(a.window)[None, :] < (positions + 1).clamp(max=a.window)[:, None]
        parts = [(self._gather(il, "raw", batch), filled)]
        if layer.spec.compress_ratio:
            rows, visible = self._slot_rows(il, "attn", batch)
            parts.append((rows, visible if selected is None else selected))
        return ops.attention_rows(q, parts, layer.sinks)[0]

    def extend_window(self, il: int, kv: torch.Tensor, batch: Batch[ReferenceStep]) -> None:
        """Unlike the rows attention stores, these keep their autograd history: a DSpark drafter's
        training runs its context rows and the blocks that read them in one graph
        (`dwarfstar.train.dspark`); `block_attention` reads a copy of the ring, which later rows overwrite."""
        for seq in batch.seqs:
            raw = torch.cat((seq.state.raw_window(il), kv[seq.rows]))
            seq.state.store_window(il, raw, seq.start + seq.length)

    def block_attention(self, il: int, q: torch.Tensor, kv: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        out = []
        for seq in batch.seqs:
            n = seq.length
            keys = (seq.state.raw_window(il).clone(), kv[seq.rows])
            parts = [(rows.expand(n, -1, -1), torch.ones(n, rows.shape[0], dtype=torch.bool)) for rows in keys]
            out.append(ops.attention_rows(q[seq.rows], parts, self.layers[il].sinks)[0])
        return ops.apply_rope(torch.cat(out), *self._batch_angles(il, batch.step), inverse=True)

    def attn_output(self, il: int, o: torch.Tensor, batch: Batch[ReferenceStep]) -> torch.Tensor:
        layer, a, linear = self.layers[il], self.args, self.products.linear
        heads, rank = o.reshape(o.shape[0], a.o_groups, -1), a.o_lora_rank
        grouped = torch.cat([linear(heads[:, g], layer.wo_a[g * rank : (g + 1) * rank]) for g in range(a.o_groups)], 1)
        return linear(grouped, layer.wo_b)

    # -- mixture of experts --------------------------------------------------------------------------------
    def route(self, il: int, x: torch.Tensor, batch: Batch[ReferenceStep]) -> tuple[torch.Tensor, torch.Tensor]:
        a, layer, step = self.args, self.layers[il], batch.step
        fixed = None if layer.tid2eid is None else layer.tid2eid[step.tokens]  # an image row's: bias_vl decides
        logits = ops.linear(x, layer.router)
        k, scale = a.n_activated_experts, a.route_scale
        ids, weights = route(logits, k, scale, layer.bias, fixed, step.image, layer.bias_vl)
        if self.route_observer is not None:
            self.route_observer(il, ids)
        return ids, weights

    def moe(
        self,
        il: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertSource,
        batch: Batch[ReferenceStep],
    ) -> torch.Tensor:
        limit, linear = self.args.swiglu_limit, self.products.linear
        expert, slot_ids = experts.experts(il, ids)
        observer = self.expert_observer

        def observe(e: int, seen: tuple[torch.Tensor, ...]) -> None:
            for name, rows in zip(tt.EXPERTS, seen, strict=True):
                observer(il, name, e, rows)

        out = ops.routed_ffn(x, ids, slot_ids, weights, expert, self.products, limit, observe if observer else None)
        gate, up, down = self.layers[il].shared
        x = self.products.input(x)
        return out + linear(ops.swiglu_clamped(linear(x, gate), linear(x, up), limit), down)


class ReferenceModel(Transformer[torch.Tensor, ReferenceStep]):
    """The forward pass over `ReferenceOps`: what the session layer drives."""

    def __init__(
        self,
        model: ModelFile,
        qat: bool = True,
        max_seq_len: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        kv_slots: int = 1,
        products: Products = FLOAT32,
    ) -> None:
        """`kv_slots`: sequences per KV-cache block (a server's sessions decode in one block); `products`:
        how the weight products run (the CPU backend's kernels, else float32)."""
        weights = GGUFWeights(model.gguf)
        self._setup(model.args, weights, qat, max_seq_len, progress, model.layer_range, kv_slots, products)

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: WeightSource, qat: bool = True) -> ReferenceModel:
        """A model over any weight source, e.g. trainable parameters (tools/train_nano.py)."""
        model = cls.__new__(cls)
        model._setup(args, weights, qat, None, None, None, 1, FLOAT32)
        return model

    def _setup(self, args, weights, qat, max_seq_len, progress, layer_range, kv_slots, products) -> None:
        if args.dim < SMALL_MODEL_DIM:
            # Tiny models run hundreds of microsecond-sized ops per token; OpenMP hand-offs between
            # threads cost more than the math (30x slower decode on 2 busy cores), so use one thread.
            torch.set_num_threads(1)
        self.qat = qat
        ops = ReferenceOps(args, weights, qat, progress, layer_range, products)
        super().__init__(ops, max_seq_len, kv_slots)

    # the sampling rules run on the logits' device (here the CPU), one host sync per step
    sample_batch = staticmethod(sample_batch)
