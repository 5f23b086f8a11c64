"""The DeepSeek V4 forward pass, once, over the operations a backend provides (spec §2, §3).

`Transformer` owns the order of everything: per block, mHC pre -> attention -> mHC post ->
mHC pre -> MoE -> mHC post; inside attention the raw KV rows join the window first, then the
compressors pool finished windows (a row completed by token p is visible to p), then the indexer
picks the ratio-4 rows, then sink attention reads the window and the visible compressed rows. A
backend implements `Ops` (coarse, fusable steps over its own array type) and never restates this
order; it gets batching, chunked prefill and decode from this one code path. What a backend
derives once per call, and what one of its steps leaves for a later one of the same layer, lives in
its own typed record of the call (`Ops.prepare`, `Batch.step`), which the forward pass never reads.

Across sublayers the forward pass hands each sublayer's output to `Ops.hc_post_pre`: the post of
that sublayer and the pre of the next in one step, so a backend can fuse them (one pass over the
streams); the last post goes with the output head (`Ops.hc_post_head`) where the head follows.

Entry points for the features built on top: `embed`, `run_layers(h, batch, first, last)` and `head`
(or both at once, `run_to_head`) run apart (a pipeline stage runs a layer range: its `Ops` may hold
only those layers' weights, `layer_range`, with the embedding on the first stage and the head on the
last; layer indices stay the model's, so routing tables and compress ratios are the global layer's),
`hooks` are called with each layer's attention and FFN outputs before their post (steering,
activation capture), `taps` with each layer's output streams (a DSpark drafter's target layers),
and the MoE takes its weights from an `ExpertSource` (resident by default; a cache of streamed
experts can stand behind it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.image_spans import ImageSpan, router_biases
from dwarfstar.model.state import KVCache, SequenceState, Storage, check_batch
from dwarfstar.model.tensors import ATTN_INPUT, QUERY_INPUT, ProjectionGroup

A = TypeVar("A")  # the backend's array type (torch.Tensor, mx.array)
W = TypeVar("W")  # the backend's view of one layer's routed experts
S = TypeVar("S")  # the backend's record of one call (`Ops.prepare`)

Site = Literal["attn", "ffn"]
HookPoint = Literal["attn_out", "ffn_out"]
# hook(layer index, the sublayer's [N, dim] output, the batch) -> a replacement output, or None to keep it
Hook = Callable[[int, Any, "Batch[Any]"], Any]
# tap(layer index, the [N, n, dim] streams after that layer, the batch): reads them, changes nothing
Tap = Callable[[int, Any, "Batch[Any]"], None]


class Rows(Enum):
    """The four kinds of rows `Ops.norm_rope` finishes; each is RMS norm, RoPE and QAT rounding in some mix."""

    Q_LORA = "q_lora"  # low-rank query: RMS norm with attn_q_a_norm, no rotation
    QUERY = "query"  # per head: weightless RMS norm, RoPE on the last rope_dim dims
    KV = "kv"  # the shared K=V row: RMS norm with attn_kv_a_norm, RoPE, FP8 rounding of the nope dims
    INDEX_QUERY = "index_query"  # indexer query per head: RoPE, Hadamard rotation, FP4 rounding


@dataclass
class Segment:
    """One sequence's part of a batched call: its rows in the batch and the positions they take."""

    state: SequenceState
    tokens: torch.Tensor  # host int64 [length]
    start: int  # position of its first token
    rows: slice  # its rows in the batch's [N, ...] arrays
    # its image blocks, each wholly inside the call (offsets index `tokens`), in order: `Ops.embed` puts
    # their rows in place, `Ops.route` routes their positions by the image bias, and the window branch of
    # `Ops.sparse_attention` is bidirectional inside a block's START..END (`ImageSpan`)
    images: tuple[ImageSpan, ...] = ()

    @property
    def length(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class Batch(Generic[S]):
    """The rows of one forward call: several sequences, each continuing its own state.

    `prepared` is the backend's record of the call, of its own type (`Ops.prepare`, which
    `Transformer.embed` calls): what it derives once per call and reuses in every layer (the ids and
    positions on its device, RoPE tables), and the values one op of a layer leaves for a later one.
    """

    seqs: list[Segment]
    prepared: S | None = None

    @property
    def step(self) -> S:
        """The backend's record of the call, once `Transformer.embed` has prepared it."""
        if self.prepared is None:
            raise DwarfStarError("the call is not prepared: Transformer.embed prepares it before the layers run")
        return self.prepared

    @property
    def n_rows(self) -> int:
        return self.seqs[-1].rows.stop if self.seqs else 0

    @property
    def last_rows(self) -> list[int]:
        return [s.rows.stop - 1 for s in self.seqs]


class ExpertSource(Protocol[W, A]):
    """Where the MoE reads a layer's routed experts from."""

    def experts(self, layer: int, ids: A) -> tuple[W, A]:
        """Weights holding at least the experts in `ids` [N, k], and `ids` as indices into them.

        A resident source returns the layer's whole stack and the ids unchanged; a cache returns
        the slots it loaded them into.
        """
        ...


class ResidentExperts(Generic[W]):
    """Every held layer's routed experts: a layer's whole set, the ids unchanged."""

    def __init__(self, layers: Sequence[W] | Mapping[int, W]) -> None:
        """`layers`: by global layer index (a sequence: from layer 0)."""
        self.layers = dict(layers) if isinstance(layers, Mapping) else dict(enumerate(layers))

    def experts(self, layer: int, ids: A) -> tuple[W, A]:
        return self.layers[layer], ids


class Ops(Protocol[A, S]):
    """What a backend computes. Each step names the official semantics; the reference implements
    them plainly in torch float32 (`backends/reference/ops.py`), the others fuse as they like.

    `S` is the backend's record of a call (`prepare`): every step after `prepare` takes the batch and
    reads the call's inputs from `batch.step` (never from state the ops object keeps between calls),
    and the steps of one layer that hand a value on (the window rows `write_window` leaves for
    `sparse_attention`, the compressed rows `compress` leaves for `index_topk`...) do it through its
    fields, each typed and documented with the step that writes it and those that read it.
    """

    args: ModelArgs
    experts: ExpertSource  # the resident routed experts
    # the blocks whose weights it holds (a pipeline stage's slice; every layer on one process); it
    # holds the embedding when the range starts at 0 and the output head when it ends at the last
    layer_range: range

    def kv_storage(self) -> Storage:
        """The arrays the backend keeps its KV cache in (its device, its dtype)."""
        ...

    def prepare(self, batch: Batch[S]) -> S:
        """The call's record: what the backend derives once per call (ids and positions on its device,
        RoPE tables), and room for what its steps hand on within a layer. Every stage of a pipeline
        prepares its calls, the ones without the embedding too."""
        ...

    def attach_image_biases(self, biases: Mapping[int, torch.Tensor]) -> None:
        """Hold the routers' biases for image positions (`bias_vl`): every held layer's, float32
        [n_routed_experts] on the CPU, already checked (`Transformer.attach_image_biases`)."""
        ...

    def check_images(self) -> None:
        """Raise a `DwarfStarError` saying why, unless this backend can run a call with image spans now
        (`Transformer.batch` asks before any state changes, only for such a call): it holds every held
        layer's image router bias (`image_spans.check_router_biases`)."""
        ...

    def embed(self, batch: Batch[S]) -> A | None:
        """The embedding rows copied into the hc_mult streams [N, n, dim] (None when it holds no
        embedding: a later pipeline stage, whose streams arrive from the previous one). The rows of a
        segment's image spans take their positions' places before the copy (their ids, image ids,
        are past the embedding table)."""
        ...

    def hc_pre(self, il: int, site: Site, h: A, batch: Batch[S]) -> tuple[A, Any]:
        """mHC pre-mix of the streams h [N, n, dim], then the sublayer's RMS norm: (x [N, dim], mix).

        `mix` (post weights and the Sinkhorn combination) is opaque to the forward pass.
        """
        ...

    def hc_post(self, h: A, out: A, mix: Any, batch: Batch[S]) -> A:
        """New streams: post_k * out + sum_j comb[j, k] * h_j."""
        ...

    def project(self, il: int, group: ProjectionGroup, x: A, batch: Batch[S]) -> dict[str, A]:
        """x times every matrix of the group present in layer il, keyed by `Part.key`."""
        ...

    def norm_rope(self, il: int, kind: Rows, x: A, batch: Batch[S]) -> A:
        """Finish rows of one kind at the batch's positions (`Rows` says what that involves)."""
        ...

    def write_window(self, il: int, kv: A, batch: Batch[S]) -> None:
        """Append each sequence's raw KV rows to its window (until attention, older rows stay too)."""
        ...

    def compress(self, il: int, kind: str, proj: dict[str, A], batch: Batch[S]) -> None:
        """Advance compressor `kind` ("attn" or "indexer") over the batch's tokens.

        Each finished window of `ratio` tokens is pooled (softmax gate over its slots, plus the
        first half of the previous window for ratio 4), RMS-normed, rotated at the window's first
        position and rounded (FP8 for KV rows, Hadamard + FP4 for indexer rows) into a new row;
        the unfinished window stays in the frontier.
        """
        ...

    def index_topk(self, il: int, q: A, weights: A, batch: Batch[S]) -> Any:
        """The lightning indexer: per query, the top-k compressed rows visible to it by score
        sum_h w_h * relu(q_h . k) (at most index_topk; all visible rows when fewer)."""
        ...

    def sparse_attention(self, il: int, q: A, batch: Batch[S], selected: Any) -> A:
        """Sink attention [N, H, head_dim] over the raw rows of the last `window` positions and the
        compressed rows visible to each query (the selected ones in ratio-4 layers), with K = V and
        the RoPE removed from the output. The window then keeps only its last `window` rows.

        A query inside an image span's START..END also reads the raw rows `ImageSpan.window_bounds`
        gives it beyond its window (the span's rows on both sides, all in the call); the compressed
        rows and `index_topk` stay causal for it."""
        ...

    def extend_window(self, il: int, kv: A, batch: Batch[S]) -> None:
        """Rows that join each sequence's raw window with no query reading them: a DSpark stage's
        context rows (`dwarfstar.model.dspark`)."""
        ...

    def block_attention(self, il: int, q: A, kv: A, batch: Batch[S]) -> A:
        """Sink attention [N, H, head_dim] of each query over its sequence's raw window as the state
        holds it (the positions before the call) and every row of `kv` its sequence has in the call,
        whatever their order (a DSpark block attends within itself both ways), the RoPE removed from
        the output; the window is left as it was."""
        ...

    def attn_output(self, il: int, o: A, batch: Batch[S]) -> A:
        """Grouped low-rank output projection: per group, its heads through wo_a, then wo_b."""
        ...

    def route(self, il: int, x: A, batch: Batch[S]) -> tuple[A, A]:
        """(expert ids [N, k], weights [N, k]): sqrt-softplus scores, top-k by score + bias (or the
        token's hash-table ids), weights the chosen unbiased scores renormalised times route_scale.

        A row at an image span's position selects top-k by score + the layer's image bias (`bias_vl`),
        in hash-routed layers too (instead of the table, which never sees its image id); its
        weights are a text row's: the chosen unbiased scores renormalised times route_scale."""
        ...

    def moe(self, il: int, x: A, ids: A, weights: A, experts: ExpertSource, batch: Batch[S]) -> A:
        """Routed experts (SwiGLU with clamp, scaled by the route weight before the down projection)
        plus the shared expert."""
        ...

    def hc_head(self, h: A, rows: list[int] | None, batch: Batch[S]) -> A:
        """Collapse the streams of `rows` (all when None) with sigmoid weights, then the output norm."""
        ...

    def hc_collapse(self, h: A, batch: Batch[S]) -> A:
        """`hc_head`'s collapse of every row, before the output norm (a DSpark confidence reads it)."""
        ...

    def output_norm(self, y: A, batch: Batch[S]) -> A:
        """`hc_head`'s output norm."""
        ...

    def kept(self, h: A) -> A:
        """The streams h as they are now, safe from the updates this backend makes to them in place later
        in the pass (a copy where it updates streams in place): what a tap keeps. `StreamSteps`: h."""
        ...

    def hc_post_pre(self, il: int, site: Site, h: A, out: A, mix: Any, batch: Batch[S]) -> tuple[A, A, Any]:
        """`hc_post` of the sublayer whose output is `out` (`mix`: its pre-mix), then `hc_pre` of
        sublayer (il, site) over the new streams: (streams, x, mix). `StreamSteps` composes the two."""
        ...

    def hc_post_head(self, h: A, out: A, mix: Any, rows: list[int] | None, batch: Batch[S]) -> tuple[A, A]:
        """`hc_post` of the last sublayer, then `hc_head` of `rows`: (streams, output rows)."""
        ...

    def logits(self, y: A, batch: Batch[S]) -> torch.Tensor:
        """The output head: [N, vocab] float32 torch logits, on the backend's device.

        The batch's work is complete after it (a lazy backend evaluates the states with the logits).
        """
        ...


class StreamSteps:
    """`Ops.hc_post_pre` and `Ops.hc_post_head` as their two steps, for a backend that does not fuse them
    (and so never updates streams in place: `kept` is h itself)."""

    def kept(self, h: Any) -> Any:
        return h

    def hc_post_pre(self, il: int, site: Site, h: Any, out: Any, mix: Any, batch: Batch) -> tuple[Any, Any, Any]:
        h = self.hc_post(h, out, mix, batch)
        return (h, *self.hc_pre(il, site, h, batch))

    def hc_post_head(self, h: Any, out: Any, mix: Any, rows: list[int] | None, batch: Batch) -> tuple[Any, Any]:
        h = self.hc_post(h, out, mix, batch)
        return h, self.hc_head(h, rows, batch)


class Transformer(Generic[A, S]):
    """DeepSeek V4 over a backend's `Ops`: what the session layer drives as a backend."""

    def __init__(self, ops: Ops[A, S], max_seq_len: int | None = None, kv_slots: int = 1) -> None:
        """`kv_slots`: sequences per preallocated block of the KV cache (a server sizes it to its sessions)."""
        self.ops, self.args = ops, ops.args
        self.max_seq_len = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        self.layer_range = ops.layer_range
        self.cache = KVCache(self.args, self.max_seq_len, ops.kv_storage(), kv_slots, self.layer_range)
        self.experts: ExpertSource = ops.experts
        self.hooks: dict[HookPoint, list[Hook]] = {"attn_out": [], "ffn_out": []}
        self.taps: list[Tap] = []

    def new_state(self) -> SequenceState:
        return self.cache.new_state()

    def attach_image_biases(self, biases: Mapping[int, torch.Tensor]) -> None:
        """The routers' biases for image positions, layer -> [n_routed_experts] (`bias_vl`, from the
        vision encoder file), which image spans route by: every held layer needs one, others are
        ignored. A call with image spans is refused without them."""
        self.ops.attach_image_biases(router_biases(biases, self.layer_range, self.args.n_routed_experts))

    # -- entry points ------------------------------------------------------------------------------------
    def batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> Batch[S]:
        """Validate a call (context, vocabulary, repeated states, image spans and whether the backend
        runs them) before any state changes, then give each state row pages of its own where the call
        writes (`SequenceState.reserve`). `images`: each sequence's image spans (`ImageSpan`), or None."""
        spans = [()] * len(token_lists) if images is None else [tuple(s) for s in images]
        chunks = check_batch(token_lists, states, self.args.vocab_size, self.max_seq_len, spans)
        if any(spans):
            for span in (span for seq in spans for span in seq):
                span.check_width(self.args.dim)
            self.ops.check_images()
        seqs, row = [], 0
        for tokens, state, mine in zip(chunks, states, spans, strict=True):
            if tokens.numel():
                state.reserve(state.pos, state.pos + tokens.numel())
                seqs.append(Segment(state, tokens, state.pos, slice(row, row + tokens.numel()), mine))
                row += tokens.numel()
        return Batch(seqs)

    @property
    def holds_head(self) -> bool:
        return self.layer_range.stop == self.args.n_layers

    def embed(self, batch: Batch[S]) -> A | None:
        """The call prepared (`Ops.prepare`, unless its record was preset: a captured decode step's),
        then the first layer's input streams (None without the embedding)."""
        if batch.prepared is None:
            batch.prepared = self.ops.prepare(batch)
        return self.ops.embed(batch)

    def run_layers(self, h: A, batch: Batch[S], first: int = 0, last: int | None = None) -> A:
        """Blocks first..last-1 over the streams h [N, n, dim]."""
        last = self._held(first, last)
        if first == last:
            return h
        h = self.ops.hc_post(*self._blocks(h, batch, first, last), batch)
        self._tap(last - 1, h, batch)
        return h

    def head(self, h: A, batch: Batch[S], all_positions: bool) -> tuple[A, list[int] | None]:
        """Output-normalised final rows: of every position, or each sequence's last only."""
        rows = self._head_rows(batch, all_positions)
        return self.ops.hc_head(h, rows, batch), rows

    def run_to_head(self, h: A, batch: Batch[S], all_positions: bool, first: int = 0) -> tuple[A, A, list[int] | None]:
        """`run_layers` from `first` to the last layer, then `head`, the last post fused with it:
        (the final streams, the output-normalised rows, which rows)."""
        last = self._held(first, None)  # the layers first: a stage short of them is told so
        rows = self._head_rows(batch, all_positions)
        if first == last:
            return h, self.ops.hc_head(h, rows, batch), rows
        h, y = self.ops.hc_post_head(*self._blocks(h, batch, first, last), rows, batch)
        self._tap(last - 1, h, batch)
        return h, y, rows

    def _held(self, first: int, last: int | None) -> int:
        """`last` (the model's end when None), once layers first..last-1 are known to be held here."""
        last = self.args.n_layers if last is None else last
        held = self.layer_range
        if not held.start <= first <= last <= held.stop:
            raise DwarfStarError(
                f"layers {first}..{last - 1} are not all loaded here: "
                f"this model holds layers {held.start}..{held.stop - 1}"
            )
        return last

    def _head_rows(self, batch: Batch[S], all_positions: bool) -> list[int] | None:
        if not self.holds_head:
            raise DwarfStarError(f"the output head is not loaded here: this model holds layers {self.layer_range}")
        return None if all_positions else batch.last_rows

    def compute(self, batch: Batch[S], all_positions: bool) -> tuple[torch.Tensor, list[int] | None]:
        """The device work of a call, without the host bookkeeping (`advance`): a decode step can
        be captured as a graph from it and replayed."""
        _, y, rows = self.run_to_head(self.embed(batch), batch, all_positions)
        return self.ops.logits(y, batch), rows

    def advance(self, batch: Batch[S]) -> None:
        """Every state now includes its tokens."""
        for seq in batch.seqs:
            seq.state.pos += seq.length
            seq.state.tokens.extend(seq.tokens.tolist())

    # -- the model -----------------------------------------------------------------------------------------
    def _blocks(self, h: A, batch: Batch[S], first: int, last: int) -> tuple[A, A, Any]:
        """Blocks first..last-1 (at least one), each sublayer's post fused with the next one's pre; the
        last post is the caller's: (streams, the last FFN output, its pre-mix)."""
        x, mix = self.ops.hc_pre(first, "attn", h, batch)
        h, out, mix = self.block(first, h, x, mix, batch)
        for il in range(first + 1, last):
            h, x, mix = self.ops.hc_post_pre(il, "attn", h, out, mix, batch)
            self._tap(il - 1, h, batch)
            h, out, mix = self.block(il, h, x, mix, batch)
        return h, out, mix

    def _tap(self, il: int, h: A, batch: Batch[S]) -> None:
        if self.taps:
            h = self.ops.kept(h)  # a fused backend's later posts update h in place
        for tap in self.taps:
            tap(il, h, batch)

    def block(self, il: int, h: A, x: A, mix: Any, batch: Batch[S]) -> tuple[A, A, Any]:
        """Layer il from its attention input x (`mix`: that sublayer's pre-mix of the streams h) to its
        FFN output, whose post goes with the next pre or the head: (streams, FFN output, its pre-mix)."""
        ops = self.ops
        out = self._hook("attn_out", il, self.attention(il, x, batch), batch)
        h, x, mix = ops.hc_post_pre(il, "ffn", h, out, mix, batch)
        ids, weights = ops.route(il, x, batch)
        return h, self._hook("ffn_out", il, ops.moe(il, x, ids, weights, self.experts, batch), batch), mix

    def attention(self, il: int, x: A, batch: Batch[S]) -> A:
        # the rows of the ATTN_INPUT projections, the low-rank query's last, then those of QUERY_INPUT,
        # the query heads before the indexer's: a backend may finish each group in one launch there
        ops, layer = self.ops, self.args.layer(il)
        proj = ops.project(il, ATTN_INPUT, x, batch)
        ops.write_window(il, ops.norm_rope(il, Rows.KV, proj["kv"], batch), batch)
        if layer.compress_ratio:
            ops.compress(il, "attn", proj, batch)
        if layer.has_indexer:
            ops.compress(il, "indexer", proj, batch)
        qr = ops.norm_rope(il, Rows.Q_LORA, proj["q_a"], batch)
        query = ops.project(il, QUERY_INPUT, qr, batch)
        q = ops.norm_rope(il, Rows.QUERY, query["q"], batch)
        selected = None
        if layer.has_indexer:
            q_index = ops.norm_rope(il, Rows.INDEX_QUERY, query["index_q"], batch)
            selected = ops.index_topk(il, q_index, proj["index_weights"], batch)
        return ops.attn_output(il, ops.sparse_attention(il, q, batch, selected), batch)

    def _hook(self, point: HookPoint, il: int, out: A, batch: Batch[S]) -> A:
        for hook in self.hooks[point]:
            replaced = hook(il, out, batch)
            out = out if replaced is None else replaced
        return out

    # -- what the session layer calls --------------------------------------------------------------------
    def hidden_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_positions: bool = True,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[A | None]:
        """Each sequence's output-normalised final rows (None for a sequence given no tokens).

        Runs with autograd on a backend that has it when called outside inference mode, so
        training can put its own head on top; the states advance as in `forward_batch`.
        `images`: each sequence's image spans, as `batch` takes them.
        """
        batch = self.batch(token_lists, states, images)
        out: dict[int, A] = {}
        if batch.seqs:
            _, y, rows = self.run_to_head(self.embed(batch), batch, all_positions)
            self.advance(batch)
            for i, seq in enumerate(batch.seqs):
                out[id(seq.state)] = y[seq.rows] if rows is None else y[i : i + 1]
        return [out.get(id(s)) for s in states]

    @torch.inference_mode()
    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits: bool = False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Advance several sequences in one pass (continuous batching); each may add any number of
        tokens. Returns each one's logits, [T, vocab] with `all_logits`, else [1, vocab]; a state's
        `logits` holds its next-token logits afterwards. `images`: each sequence's image spans
        (`ImageSpan`, each wholly inside its call), as `batch` takes them."""
        batch = self.batch(token_lists, states, images)
        out: dict[int, torch.Tensor] = {}
        if batch.seqs:
            logits, rows = self.compute(batch, all_logits)
            self.advance(batch)
            for i, seq in enumerate(batch.seqs):
                mine = logits[seq.rows] if rows is None else logits[i : i + 1]
                # a view of the [B, vocab] last rows is already small; of all positions, keep a copy
                seq.state.logits = mine[-1].clone() if rows is None else mine[-1]
                out[id(seq.state)] = mine
        empty = torch.empty(0, self.args.vocab_size)
        return [out.get(id(s), empty) for s in states]

    @torch.inference_mode()
    def forward_streams(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState,
        inputs: Callable[[A], A] | None = None,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> tuple[torch.Tensor, A]:
        """Logits after the T tokens ([T, vocab], else [1, vocab]) and the final streams [T, n, dim]
        before the head: what a draft model continues from (speculative decoding, `dwarfstar.speculative`).

        `inputs(embedded)` replaces the first layer's input (the embedding copied into the streams):
        the MTP block mixes the trunk's streams into it. `images`: the call's image spans, as `forward`."""
        batch = self.batch([tokens], [state], None if images is None else [images])
        h = self.embed(batch)
        h, y, _ = self.run_to_head(h if inputs is None else inputs(h), batch, all_logits)
        logits = self.ops.logits(y, batch)
        self.advance(batch)
        state.logits = logits[-1].clone()
        return logits, h

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        """Logits after the T tokens, which continue `state`: [T, vocab] with `all_logits`, else
        [1, vocab] (prefill skips the output head for every other position). `images`: the call's
        image spans (offsets into `tokens`), or None."""
        return self.forward_batch([tokens], [state], all_logits, None if images is None else [images])[0]

    def decode_sample(self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence) -> list[int]:
        """A decode step (one token per state), then each state's next token drawn by its sampler."""
        return forward_then_sample(self, tokens, states, samplers)


def forward_then_sample(
    backend: Any, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence
) -> list[int]:
    """`decode_sample` as one batched pass and then the backend's `sample_batch` (one host sync):
    what a backend does that cannot draw inside its step."""
    backend.forward_batch([[t] for t in tokens], states, all_logits=False)
    # from the states' next-token logits, which a wrapper of the backend may have replaced
    return backend.sample_batch(torch.stack([s.logits.reshape(-1) for s in states]), samplers)
