"""The whole DeepSeek V4 forward pass in MLX: the MLX backend behind the session layer.

Same contract as `dwarfstar.backends.reference.model.ReferenceModel`: `forward(tokens, state)`
runs any chunk of consecutive tokens against a sequence state (so one pass, chunked prefill and
decode share a code path), and `forward_batch` advances several sequences in one pass. Logits come
back as torch tensors, as the session layer and the samplers expect. The graph of a whole call is
built lazily and evaluated once, together with the state it updated.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.backends.mlx import metal_available, ops
from dwarfstar.backends.mlx import state as mlx_state
from dwarfstar.backends.mlx.attention import Attention
from dwarfstar.backends.mlx.moe import MoE
from dwarfstar.backends.mlx.weights import LayerWeights, Weights
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import LayerState, SequenceState, check_batch

Group = tuple[slice, np.ndarray, LayerState]  # a sequence's rows in the batch, its positions, its layer state


class Block:
    def __init__(self, args: ModelArgs, il: int, weights: Weights, qat: bool, fused: ops.Fused) -> None:
        self.args, self.fused = args, fused
        w = LayerWeights(weights, il)
        self.hc_attn = tuple(w.dense(f"hc_attn_{k}.weight") for k in ("fn", "scale", "base"))
        self.hc_ffn = tuple(w.dense(f"hc_ffn_{k}.weight") for k in ("fn", "scale", "base"))
        self.attn_norm = w.dense("attn_norm.weight")
        self.ffn_norm = w.dense("ffn_norm.weight")
        self.attn = Attention(args, args.layer(il), w, qat, fused)
        self.moe = MoE(args, args.layer(il), w, fused)

    def __call__(self, h: mx.array, tokens: mx.array, groups: list[Group]) -> mx.array:
        """Attention runs per sequence (each has its own KV); everything else on all rows at once."""
        eps, fused = self.args.norm_eps, self.fused
        x, post, comb = fused.hc_pre(h, *self.hc_attn)
        x = ops.rms_norm(x, self.attn_norm, eps)
        attn = mx.concatenate([self.attn(x[rows], positions, layer) for rows, positions, layer in groups])
        h = fused.hc_post(attn, h, post, comb)
        x, post, comb = fused.hc_pre(h, *self.hc_ffn)
        return fused.hc_post(self.moe(ops.rms_norm(x, self.ffn_norm, eps), tokens), h, post, comb)


class MLXModel:
    def __init__(
        self,
        model: ModelFile,
        qat: bool = True,
        packing: str = "exact",
        max_seq_len: int | None = None,
        fuse: bool | None = None,
    ) -> None:
        """`fuse` compiles the op-heavy primitives (`ops.Fused`); by default only where Metal runs them."""
        args = model.args
        self.args, self.qat, self.packing = args, qat, packing
        self.fused = ops.Fused(args, metal_available() if fuse is None else fuse)
        self.max_seq_len = min(max_seq_len or args.max_seq_len, args.max_seq_len)
        weights = Weights(model.gguf, packing)
        self.embed = weights.dense("token_embd.weight")
        self.blocks = [Block(args, il, weights, qat, self.fused) for il in range(args.n_layers)]
        self.head_hc = tuple(weights.dense(f"output_hc_{k}.weight") for k in ("fn", "scale", "base"))
        self.out_norm = weights.dense("output_norm.weight")
        self.output = weights.matrix("output.weight")

    def new_state(self) -> SequenceState:
        return mlx_state.new_state(self.args)

    def forward(
        self, tokens: Sequence[int] | torch.Tensor, state: SequenceState, all_logits: bool = True
    ) -> torch.Tensor:
        """Logits after the T tokens, which continue `state` (updated in place, `state.logits` included).

        Returns [T, vocab] with `all_logits`, else [1, vocab] for the last token only.
        """
        return self.forward_batch([tokens], [state], all_logits)[0]

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """Advance several independent sequences in one pass; all are validated before any state changes."""
        a = self.args
        chunks = [np.asarray(t) for t in check_batch(token_lists, states, a.vocab_size, self.max_seq_len)]
        live = [(c, s) for c, s in zip(chunks, states, strict=True) if c.size]
        if not live:
            return [torch.empty(0, a.vocab_size) for _ in chunks]
        tokens = mx.array(np.concatenate([c for c, _ in live]).astype(np.int32))
        bounds, start = [], 0
        for chunk, state in live:
            bounds.append((slice(start, start + chunk.size), np.arange(state.pos, state.pos + chunk.size)))
            start += chunk.size
        layers = [mlx_state.adopt(state) for _, state in live]
        h = mx.broadcast_to(self.embed[tokens][:, None, :], (tokens.shape[0], a.hc_mult, a.dim))
        for il, block in enumerate(self.blocks):
            h = block(h, tokens, [(rows, pos, seq[il]) for (rows, pos), seq in zip(bounds, layers, strict=True)])
        if not all_logits:
            h = h[mx.array([rows.stop - 1 for rows, _ in bounds])]
        y = ops.rms_norm(self.fused.hc_head(h, *self.head_hc), self.out_norm, a.norm_eps)
        logits = self.output.matmul(y)
        mx.eval(logits, *(arr for _, state in live for arr in mlx_state.lazy_arrays(state)))
        # numpy copies, not torch ops: torch's thread hand-offs cost more than a copy on busy cores
        logits = np.array(logits)
        out, row = {}, 0
        for chunk, state in live:
            n = chunk.size if all_logits else 1
            out[id(state)] = torch.from_numpy(logits[row : row + n])
            state.logits = torch.from_numpy(logits[row + n - 1].copy())
            row += n
            state.pos += chunk.size
            state.tokens.extend(chunk.tolist())
        return [out.get(id(s), torch.empty(0, a.vocab_size)) for s in states]
