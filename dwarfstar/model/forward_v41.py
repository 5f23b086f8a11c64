"""DeepSeek V4.1 Flash's forward pass (issue 33; V4.1 note §1-§3): the order of the steps, over the
typed `Ops41` a backend implements (the torch reference: `backends/reference/v41/model.py`).

One call runs the tokens `state.pos ..` of one sequence (a whole prompt, a chunk of it, or one decode
token) and returns the last position's next-token logits:

    H = [e, e, ..., e] (hc_mult copies of the embedding);  pre = (1, 0, ..., 0)
    per layer i:
        Engram layers: H = engram(H)                            before the block's mixes
        (a_pre, a_post, a_comb) = mix_attn(H)
        H = post(H, attention(norm_attn(collapse(H, pre))), a_post, a_comb)
        (f_pre, f_post, f_comb) = mix_ffn(H)
        H = post(H, moe(norm_ffn(collapse(H, a_pre))), f_post, f_comb);  pre = f_pre
    logits = head(norm_out(collapse(H, pre)))                   no learned head collapse

Attention of layer i (mode from `ModelArgs41.layer`): the query (no per-head norm) and this call's
window rows; a kv source (`full`) compresses its tokens into its rows and index keys; an index source
(`full`, `reindex`) scores the latest kv source's rows and takes its top-k (the candidate source also
publishes each query's candidate blocks, which a later reindex layer picks inside); a `reuse` layer
takes the latest index source's top-k. Then one softmax with the head's sink over the query's window
(positions p - window + 1 .. p) and its selected compressed rows. The call's shared slots (top-k,
candidates) hold what the latest source wrote; layers run in order, so each reader finds its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dwarfstar.model.config_v41 import LayerMode, LayerSpec41, ModelArgs41
from dwarfstar.model.state_v41 import SequenceState41
from dwarfstar.model.tensors import SITES

ATTN, FFN = SITES


class Ops41(Protocol):
    """V4.1's steps on float32 [T, ...] tensors of one sequence's call."""

    args: ModelArgs41

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc_mult, dim] of token ids [T]."""
        ...

    def engram(self, il: int, h: torch.Tensor, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Streams [T, n, dim] enriched by layer il's Engram rows for positions start.. of `tokens`
        (the whole sequence so far)."""
        ...

    def mix(self, il: int, site: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, n], post [T, n], comb [T, n, n]) of a sublayer's input streams."""
        ...

    def sublayer_input(self, il: int, site: str, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The sublayer's normed input [T, dim]: streams collapsed with `pre`, then its RMSNorm."""
        ...

    def hc_post(self, h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor: ...

    def query(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, n_heads, head_dim] rotated, the normed low-rank query [T, q_lora_rank])."""
        ...

    def window_rows(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window rows [T, head_dim] of the tokens' attention inputs."""
        ...

    def compress(
        self, il: int, x: torch.Tensor, frontier: tuple[torch.Tensor, torch.Tensor] | None, start: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A kv source's finished groups: (rows [G, head_dim], index keys [G, index_head_dim], the
        frontier after them; None at ratio 1). `frontier` None starts an empty one."""
        ...

    def index_scores(
        self, il: int, qr: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Scores [T, rows] of an index source's queries over index keys [rows, index_head_dim]."""
        ...

    def candidates(self, scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
        """The candidate source's per-query candidate rows [T, rows] bool."""
        ...

    def top_k(
        self, scores: torch.Tensor, positions: torch.Tensor, ratio: int, end: int, candidates: torch.Tensor | None
    ) -> torch.Tensor:
        """Selected rows [T, K] ascending, -1 where a pick is masked."""
        ...

    def attend(
        self, il: int, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
    ) -> torch.Tensor:
        """Attention output [T, dim]: sink attention of q over each query's keys (parts of keys
        [T, n, head_dim] with masks [T, n]), the query's RoPE removed, then wo_a and wo_b."""
        ...

    def moe(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """The routed and shared experts' output [T, dim] of the FFN input [T, dim]."""
        ...

    def head(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab]: streams [T, n, dim] collapsed with `pre`, output norm, output projection."""
        ...


@dataclass
class _Shared:
    """The slots the latest index source and the candidate source wrote in this call."""

    top_k: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


class Transformer41:
    def __init__(self, ops: Ops41) -> None:
        self.ops, self.args = ops, ops.args
        self.layers = ops.args.layers

    def forward(self, tokens: Sequence[int], state: SequenceState41) -> torch.Tensor:
        """Run `tokens` (the next ones of the sequence) and return the last one's logits [vocab];
        `state` advances past them."""
        if not tokens:
            raise ValueError("a forward call needs at least one token")
        ops, start = self.ops, state.pos
        state.tokens.extend(tokens)
        positions = torch.arange(start, state.pos)
        h = ops.embed(torch.tensor(list(tokens)))
        pre = torch.zeros(h.shape[0], h.shape[1])
        pre[:, 0] = 1.0
        shared = _Shared()
        for layer in self.layers:
            il = layer.index
            if layer.engram:
                h = ops.engram(il, h, state.tokens, start)
            a_pre, a_post, a_comb = ops.mix(il, ATTN, h)
            out = self._attention(layer, ops.sublayer_input(il, ATTN, h, pre), positions, state, shared)
            h = ops.hc_post(h, out, a_post, a_comb)
            f_pre, f_post, f_comb = ops.mix(il, FFN, h)
            h = ops.hc_post(h, ops.moe(il, ops.sublayer_input(il, FFN, h, a_pre)), f_post, f_comb)
            pre = f_pre
        return ops.head(h[-1:], pre[-1:])[0]

    def _attention(
        self, layer: LayerSpec41, x: torch.Tensor, positions: torch.Tensor, state: SequenceState41, shared: _Shared
    ) -> torch.Tensor:
        ops, il = self.ops, layer.index
        q, qr = ops.query(il, x, positions)
        parts = [self._window(il, ops.window_rows(il, x, positions), positions, state)]
        if layer.compress_ratio:
            ratio, src = layer.compress_ratio, layer.kv_source
            if layer.mode == LayerMode.FULL:
                rows, keys, frontier = ops.compress(il, x, state.frontiers.get(il), int(positions[0]))
                state.rows[il] = torch.cat((state.rows[il], rows))
                state.index_keys[il] = torch.cat((state.index_keys[il], keys))
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
            picks = shared.top_k
            parts.append((state.rows[src][picks.clamp(min=0)], picks >= 0))
        return ops.attend(il, q, parts, positions)

    def _window(
        self, il: int, new: torch.Tensor, positions: torch.Tensor, state: SequenceState41
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's window keys [T, window, head_dim] (positions p - window + 1 .. p, oldest first)
        and their mask (positions before the sequence's start are masked); keeps the last window - 1
        rows in the state."""
        rows = torch.cat((state.windows[il], new))
        first = int(positions[0]) - state.windows[il].shape[0]  # the position of rows[0]
        at = positions[:, None] - state.window + 1 + torch.arange(state.window)[None, :]
        state.windows[il] = rows[rows.shape[0] - min(rows.shape[0], state.window - 1) :]
        return rows[(at - first).clamp(min=0)], at >= 0
