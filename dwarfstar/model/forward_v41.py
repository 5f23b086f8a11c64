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

Attention of layer i (mode from `ModelArgs41.layer`): the query (no per-head norm) and this call's
window rows; a kv source (`full`) compresses its tokens into its rows and index keys; an index source
(`full`, `reindex`) scores the latest kv source's rows and takes its top-k (the candidate source also
publishes each query's candidate blocks, which a later reindex layer picks inside); a `reuse` layer
takes the latest index source's top-k. Then one softmax with the head's sink over the query's window
(positions p - window + 1 .. p) and its selected compressed rows. The call's shared slots (top-k,
candidates) hold what the latest source wrote; layers run in order, so each reader finds its own.

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from dwarfstar.model.config_v41 import LayerMode, LayerSpec41, ModelArgs41
from dwarfstar.model.forward import ExpertSource
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

    def query(self, il: int, x: A, positions: torch.Tensor) -> tuple[A, A]:
        """(q [T, n_heads, head_dim] rotated, the normed low-rank query [T, q_lora_rank])."""
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


class Transformer41(Generic[A]):
    def __init__(self, ops: Ops41[A]) -> None:
        self.ops, self.args = ops, ops.args
        self.layers = ops.args.layers

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
        if not tokens:
            raise ValueError("a forward call needs at least one token")
        ops, start = self.ops, state.pos
        state.tokens.extend(tokens)
        positions = torch.arange(start, state.pos)
        image = image_mask(tuple(images), len(tokens)) if images else None
        h = ops.embed(torch.tensor(list(tokens)), images)
        engram_rows = ops.engram_rows(state.tokens, start) if self.args.engram_layers else {}
        pre = ops.first_pre(len(tokens))
        shared: _Shared[A] = _Shared()
        inputs: list[A] = []
        for layer in self.layers:
            il = layer.index
            if layer.engram:
                h = ops.engram(il, h, engram_rows[il], image)
            if capture is not None and il in capture.layers:
                inputs.append(h)
            a_pre, a_post, a_comb = ops.mix(il, ATTN, h)
            out = self._attention(layer, ops.sublayer_input(il, ATTN, h, pre), positions, state, shared)
            h = ops.hc_post(h, out, a_post, a_comb)
            f_pre, f_post, f_comb = ops.mix(il, FFN, h)
            h = ops.hc_post(h, ops.moe(il, ops.sublayer_input(il, FFN, h, a_pre), image), f_post, f_comb)
            pre = f_pre
        if capture is not None:
            capture.calls.append(tuple(inputs))
        return ops.head(h[-1:], pre[-1:])[0]

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
