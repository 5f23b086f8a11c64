"""DeepSeek V4.1 Flash's forward pass (issue 33; sources: shared/spec/RELEASES_2026.md): the order of the
steps, over the typed `Ops41` a backend implements (the torch reference: `backends/reference/v41/model.py`).

One call runs the tokens `state.pos ..` of one sequence (a whole prompt, a chunk of it, or one decode
token) and returns the last position's next-token logits:

    H = [e, e, ..., e] (hc_mult copies of the embedding, or of an image span's row);  pre = (1, 0, ..., 0)
    per layer i:
        Engram layers: H = engram(H)                            before the block's mixes; shut on images
        (a_pre, a_post, a_comb) = mix_attn(H)
        H = post(H, attention(norm_attn(collapse(H, pre))), a_post, a_comb)
        (f_pre, f_post, f_comb) = mix_ffn(H)
        H = post(H, moe(norm_ffn(collapse(H, a_pre))), f_post, f_comb);  pre = f_pre   images route by bias_vl
    logits = head(norm_out(collapse(H, pre)))                   no learned head collapse

Each sublayer's post goes with the next sublayer's mix and collapse (`Ops41.post_mix_input`, which a
backend may run as one step: `LaggedSteps41` composes them); an Engram layer, a recorded layer and the
end of the held layers take the pending post alone.

Attention of layer i (mode from `ModelArgs41.layer`): the query (no per-head norm) and this call's
window rows; a kv source (`full`) compresses its tokens into its rows and index keys; an index source
(`full`, `reindex`) scores the latest kv source's rows and takes its top-k (the candidate source also
publishes each query's candidate blocks, which a later reindex layer picks inside); a `reuse` layer
takes the latest index source's top-k. Then one softmax with the head's sink over the query's window
(positions p - window + 1 .. p) and its selected compressed rows. The call's shared slots (top-k,
candidates) hold what the latest source wrote; layers run in order, so each reader finds its own.

A route runs the layers in stages (`Transformer41(ops, held)`: `begin`, `enter` on the first stage, `run`
over the held layers, `logits` on the last): what crosses a boundary is `Streams41`, the streams and the
lagged mix the next layer collapses them with; every stage computes the call's positions and Engram rows
from its token ids. A stage must hold every kv and index source its layers read (`slice_problem`), so no
compressed row or top-k crosses. The `attn_out` and `ffn_out` hooks (`hooks`) see each sublayer's output
[T, dim] before the streams take it (steering).

A call can record the inputs of some layers (`Capture41`: each one's streams after its Engram, before its
block), which DSpark's drafter reads (V4.1's reference `Transformer.forward`'s `main_hiddens`, averaged over
the hc copies where the drafter reads them: `model.dspark.DSparkHeads.main_x`); a call without one records
nothing.

The arrays are the backend's (`A`: torch tensors in the reference, MLX arrays in MLX): the state
holds them and only the backend's `Ops41` computes on them (the window, appending compressed rows,
gathering the picked ones), so each backend keeps its own; token ids and positions stay host torch
tensors, and the logits come back as torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.config_v41 import LayerMode, LayerSpec41, ModelArgs41
from dwarfstar.model.file_v41 import FAMILY41
from dwarfstar.model.forward import ExpertSource, HookPoint
from dwarfstar.model.image_spans import ImageSpan, image_mask
from dwarfstar.model.tensors import SITES

ATTN, FFN = SITES
A = TypeVar("A")  # the backend's array type (torch.Tensor, mx.array)


class State41(Protocol[A]):
    """What the forward reads and writes of a sequence between calls (`state_v41.SequenceState41` is
    the reference's): its tokens and, per layer, the backend's arrays."""

    tokens: list[int]
    windows: dict[int, A]  # layer -> the window rows of the last window - 1 positions
    rows: dict[int, A]  # kv source -> compressed rows [G, head_dim]
    index_keys: dict[int, A]  # kv source -> index keys [G, index_head_dim]
    frontiers: dict[int, tuple[A, A]]  # ratio-2 kv source -> its compressor frontier

    @property
    def pos(self) -> int: ...


class Ops41(Protocol[A]):
    """V4.1's steps on float32 [T, ...] arrays of one sequence's call."""

    args: ModelArgs41
    # where `moe` reads each layer's routed experts: the resident ones (`forward.ResidentExperts`), or a
    # cache streaming them from the file (`--ssd-streaming`: `experts.source`), as V4's `Ops.experts`
    experts: ExpertSource

    def embed(self, tokens: torch.Tensor, images: Sequence[ImageSpan]) -> A:
        """Streams [T, hc_mult, dim] of token ids [T]: each image span's rows at its positions (whose
        ids are image ids, past the vocabulary), the embedding's elsewhere."""
        ...

    def engram_rows(self, tokens: Sequence[int], start: int) -> dict[int, np.ndarray]:
        """Each Engram layer's table rows (int64 [T, 24]) for positions start.. of `tokens` (the whole
        sequence so far; image ids stop the n-gram look-back), hashed once per call; a call of several
        tokens also starts reading them from the table, so layer 0 runs while they arrive."""
        ...

    def engram(self, il: int, h: A, rows: np.ndarray, image: torch.Tensor | None) -> A:
        """Streams [T, n, dim] enriched by layer il's Engram rows `rows` ([T, 24], `engram_rows`); the
        gate is shut at image positions (`image`: bool [T], None for a call without images)."""
        ...

    def mix(self, il: int, site: str, h: A) -> tuple[A, A, A]:
        """(pre [T, n], post [T, n], comb [T, n, n]) of a sublayer's input streams."""
        ...

    def sublayer_input(self, il: int, site: str, h: A, pre: A) -> A:
        """The sublayer's normed input [T, dim]: streams collapsed with `pre`, then its RMSNorm."""
        ...

    def hc_post(self, h: A, out: A, post: A, comb: A) -> A: ...

    def kept(self, h: A) -> A:
        """The streams h as they are now, safe from the updates this backend makes to them in place later
        in the pass (a copy where it updates streams in place): what a capture records."""
        ...

    def post_mix_input(
        self, il: int, site: str, h: A, after: tuple[A, A, A] | None, pre: A
    ) -> tuple[A, tuple[A, A, A], A]:
        """A sublayer's mHC steps: the post of the sublayer before (`after`: its output [T, dim], post and
        comb; None where the streams took it already), the mix of the new streams and the sublayer's
        input collapsed with `pre`: (streams, (pre, post, comb), normed input [T, dim]). `LaggedSteps41`
        composes the three; a backend may fuse them."""
        ...

    def query(self, il: int, x: A, positions: torch.Tensor) -> tuple[A, A]:
        """(q [T, n_heads, head_dim] rotated, the normed low-rank query [T, q_lora_rank]); a backend whose
        `attend` rotates the query itself (Triton's) hands it on unrotated."""
        ...

    def window_rows(self, il: int, x: A, positions: torch.Tensor) -> A:
        """Window rows [T, head_dim] of the tokens' attention inputs."""
        ...

    def compress(self, il: int, x: A, frontier: tuple[A, A] | None, start: int) -> tuple[A, A, tuple[A, A] | None]:
        """A kv source's finished groups: (rows [G, head_dim], index keys [G, index_head_dim], the
        frontier after them; None at ratio 1). `frontier` None starts an empty one."""
        ...

    def index_scores(self, il: int, qr: A, x: A, keys: A, positions: torch.Tensor) -> A:
        """Scores [T, rows] of an index source's queries over index keys [rows, index_head_dim]."""
        ...

    def candidates(self, scores: A, positions: torch.Tensor, ratio: int) -> A:
        """The candidate source's per-query candidate rows [T, rows] bool."""
        ...

    def top_k(self, scores: A, positions: torch.Tensor, ratio: int, end: int, candidates: A | None) -> A:
        """Selected rows [T, K] ascending, -1 where a pick is masked."""
        ...

    def attend(self, il: int, q: A, parts: list[tuple[A, A]], positions: torch.Tensor) -> A:
        """Attention output [T, dim]: sink attention of q over each query's keys (parts of keys
        [T, n, head_dim] with masks [T, n]), the query's RoPE removed, then wo_a and wo_b."""
        ...

    def moe(self, il: int, x: A, image: torch.Tensor | None) -> A:
        """The routed and shared experts' output [T, dim] of the FFN input [T, dim]; image positions
        (`image`: bool [T], None for a call without images) select their experts with the layer's image
        bias (`exp_probs_b_vl`)."""
        ...

    # the arrays' mechanics: the forward holds the backend's arrays, only the backend computes on them
    def first_pre(self, tokens: int) -> A:
        """The pre [T, n] the first sublayer collapses with: (1, 0, ..., 0) for each token."""
        ...

    def window(self, kept: A, new: A, positions: torch.Tensor) -> tuple[tuple[A, A], A]:
        """Each query's window keys [T, window, head_dim] (positions p - window + 1 .. p, oldest first)
        and their mask [T, window] (positions before the sequence's start masked), from the rows kept
        before the call (the last window - 1 positions') and the call's rows [T, head_dim]; and the
        rows to keep after it."""
        ...

    def append(self, rows: A, new: A) -> A:
        """Rows [n, d] followed by new [m, d]."""
        ...

    def pick(self, rows: A, picks: A) -> tuple[A, A]:
        """The picked rows [T, K, d] of rows [n, d] by picks [T, K] (-1: none) and their mask [T, K]."""
        ...

    def head(self, h: A, pre: A) -> torch.Tensor:
        """Logits [T, vocab]: streams [T, n, dim] collapsed with `pre`, output norm, output projection."""
        ...


class LaggedSteps41:
    """`Ops41.post_mix_input` as its three steps, for a backend that does not fuse them; `Ops41.kept` as
    h itself, for one that never updates streams in place."""

    def kept(self, h: Any) -> Any:
        return h

    def post_mix_input(self, il: int, site: str, h: Any, after: tuple[Any, Any, Any] | None, pre: Any) -> tuple:
        if after is not None:
            h = self.hc_post(h, *after)  # type: ignore[attr-defined]
        mixes = self.mix(il, site, h)  # type: ignore[attr-defined]
        return h, mixes, self.sublayer_input(il, site, h, pre)  # type: ignore[attr-defined]


@dataclass
class Capture41(Generic[A]):
    """The inputs of `layers` (ascending) that forward calls record: per call, each layer's streams
    [T, hc_mult, dim] after its Engram and before its block, in `layers` order."""

    layers: tuple[int, ...]
    calls: list[tuple[A, ...]] = field(default_factory=list)


@dataclass
class _Shared(Generic[A]):
    """The slots the latest index source and the candidate source wrote in this call."""

    top_k: A | None = None
    candidates: A | None = None


@dataclass
class Call41(Generic[A]):
    """What one forward call's layers share, computed alike by every stage of a route from the call's
    token ids: the positions, the image mask, the Engram rows (for the Engram layers the stage holds) and
    the shared slots."""

    positions: torch.Tensor
    image: torch.Tensor | None
    engram_rows: dict[int, np.ndarray]
    shared: _Shared[A] = field(default_factory=_Shared)


@dataclass
class Streams41(Generic[A]):
    """What crosses a stage boundary: the streams [T, hc_mult, dim] and, since mHC is lagged, the mix
    [T, hc_mult] the next layer's attention collapses them with (the previous layer's FFN `pre`)."""

    h: A
    pre: A


Hook41 = Callable[[int, A], A | None]  # (layer, a sublayer's output [T, dim]) -> what the streams take (None: it)


def slice_problem(args: ModelArgs41, held: range) -> str | None:
    """Why the layers `held` cannot be one stage, or None: a layer whose kv or index source lies before
    the slice would read compressed rows, index keys or a top-k that only an earlier stage holds."""
    found = _source_before(args, held.start, held.stop)
    if found is None:
        return None
    il, what, src = found
    cuts = ", ".join(map(str, stage_cuts(args)))
    return (
        f"layer {il} reads the {what} of layer {src}, which a stage starting at layer {held.start} does not "
        f"hold: a stage boundary must not separate a layer from its kv or index source ({FAMILY41}'s stages "
        f"may start at layers {cuts})"
    )


def stage_cuts(args: ModelArgs41) -> tuple[int, ...]:
    """The layers past the first that a stage may start at (`slice_problem`)."""
    return tuple(c for c in range(1, args.n_layers) if _source_before(args, c, args.n_layers) is None)


def _source_before(args: ModelArgs41, first: int, stop: int) -> tuple[int, str, int] | None:
    """(layer, what it reads, source) of the first layer of first..stop-1 whose source precedes `first`."""
    for layer in args.layers[first:stop]:
        for what, src in (("compressed rows", layer.kv_source), ("top-k", layer.index_source)):
            if src is not None and src < first:
                return layer.index, what, src
    return None


class Transformer41(Generic[A]):
    def __init__(self, ops: Ops41[A], held: range | None = None) -> None:
        """`held`: the layers this process runs (a stage of a route; None: all of them), refused where a
        layer's source lies before them (`slice_problem`)."""
        self.ops, self.args = ops, ops.args
        self.held = range(self.args.n_layers) if held is None else held
        if not 0 <= self.held.start < self.held.stop <= self.args.n_layers:
            raise DwarfStarError(f"layers {self.held.start}:{self.held.stop} are not inside 0:{self.args.n_layers}")
        problem = slice_problem(self.args, self.held)
        if problem is not None:
            raise DwarfStarError(problem)
        self.layers = self.args.layers[self.held.start : self.held.stop]
        self.hooks: dict[HookPoint, list[Hook41[A]]] = {"attn_out": [], "ffn_out": []}

    @property
    def whole(self) -> bool:
        return self.held == range(self.args.n_layers)

    def forward(
        self,
        tokens: Sequence[int],
        state: State41[A],
        images: Sequence[ImageSpan] = (),
        capture: Capture41[A] | None = None,
    ) -> torch.Tensor:
        """Run `tokens` (the next ones of the sequence) and return the last one's logits [vocab];
        `state` advances past them. `images`: the call's image blocks (offsets into `tokens`, each
        wholly inside it, checked by the caller), whose positions hold image ids. `capture`: where the
        call records its capture layers' inputs."""
        if not self.whole:
            raise DwarfStarError(
                f"this model holds layers {self.held.start}:{self.held.stop} of {self.args.n_layers}: it runs as "
                "one stage of a route"
            )
        call = self.begin(tokens, state, images)
        return self.logits(self.run(call, state, self.enter(tokens, images), capture))

    def begin(self, tokens: Sequence[int], state: State41[A], images: Sequence[ImageSpan] = ()) -> Call41[A]:
        """The call's shared inputs; `state` takes the tokens (each stage's state holds them all: the
        Engram hash looks back at them)."""
        if not tokens:
            raise ValueError("a forward call needs at least one token")
        start = state.pos
        state.tokens.extend(tokens)
        image = image_mask(tuple(images), len(tokens)) if images else None
        engram = any(layer.engram for layer in self.layers)
        rows = self.ops.engram_rows(state.tokens, start) if engram else {}
        return Call41(torch.arange(start, state.pos), image, rows)

    def enter(self, tokens: Sequence[int], images: Sequence[ImageSpan] = ()) -> Streams41[A]:
        """The first layer's input: the embedding's hc_mult copies, collapsed first with (1, 0, ..., 0)."""
        return Streams41(self.ops.embed(torch.tensor(list(tokens)), images), self.ops.first_pre(len(tokens)))

    def run(
        self, call: Call41[A], state: State41[A], streams: Streams41[A], capture: Capture41[A] | None = None
    ) -> Streams41[A]:
        """The held layers over `streams` (the previous stage's, or `enter`'s)."""
        ops, h, pre = self.ops, streams.h, streams.pre
        inputs: list[A] = []
        after: tuple[A, A, A] | None = None  # the last FFN's output, post and comb, until the streams take it
        for layer in self.layers:
            il = layer.index
            captured = capture is not None and il in capture.layers
            if after is not None and (layer.engram or captured):
                h, after = ops.hc_post(h, *after), None
            if layer.engram:
                h = ops.engram(il, h, call.engram_rows[il], call.image)
            if captured:
                inputs.append(ops.kept(h))  # a fused backend's later posts update h in place
            h, (a_pre, a_post, a_comb), x = ops.post_mix_input(il, ATTN, h, after, pre)
            out = self._hook("attn_out", il, self._attention(layer, x, call.positions, state, call.shared))
            h, (pre, f_post, f_comb), x = ops.post_mix_input(il, FFN, h, (out, a_post, a_comb), a_pre)
            after = (self._hook("ffn_out", il, ops.moe(il, x, call.image)), f_post, f_comb)
        if after is not None:
            h = ops.hc_post(h, *after)
        if capture is not None:
            capture.calls.append(tuple(inputs))
        return Streams41(h, pre)

    def logits(self, streams: Streams41[A]) -> torch.Tensor:
        """The last position's next-token logits [vocab] (the last stage's)."""
        return self.ops.head(streams.h[-1:], streams.pre[-1:])[0]

    def _hook(self, point: HookPoint, il: int, out: A) -> A:
        for hook in self.hooks[point]:
            replaced = hook(il, out)
            out = out if replaced is None else replaced
        return out

    def _attention(self, layer: LayerSpec41, x: A, positions: torch.Tensor, state: State41[A], shared: _Shared[A]) -> A:
        ops, il = self.ops, layer.index
        q, qr = ops.query(il, x, positions)
        window, state.windows[il] = ops.window(state.windows[il], ops.window_rows(il, x, positions), positions)
        parts = [window]
        if layer.compress_ratio:
            ratio, src = layer.compress_ratio, layer.kv_source
            if layer.mode == LayerMode.FULL:
                rows, keys, frontier = ops.compress(il, x, state.frontiers.get(il), int(positions[0]))
                state.rows[il] = ops.append(state.rows[il], rows)
                state.index_keys[il] = ops.append(state.index_keys[il], keys)
                if frontier is not None:
                    state.frontiers[il] = frontier
            if layer.has_index_query:
                scores = ops.index_scores(il, qr, x, state.index_keys[src], positions)
                if layer.builds_candidates:
                    shared.candidates = ops.candidates(scores, positions, ratio)
                chosen = shared.candidates if layer.uses_candidates else None
                shared.top_k = ops.top_k(scores, positions, ratio, state.pos, chosen)
            if shared.top_k is None:
                raise RuntimeError(f"layer {il} reuses a top-k that no index source wrote")
            parts.append(ops.pick(state.rows[src], shared.top_k))
        return ops.attend(il, q, parts, positions)
