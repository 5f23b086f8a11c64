"""The whole DeepSeek V4 forward pass in torch float32: the numerical oracle of DwarfStar.

`forward(tokens, state)` runs any chunk of consecutive tokens against a sequence state, so a full
pass, chunked prefill and token-by-token decode share one code path. `qat=False` skips the FP8 KV
and Hadamard/FP4 indexer rounding, for comparison with implementations that do not apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.attention import Attention
from dwarfstar.backends.reference.moe import MoE
from dwarfstar.backends.reference.weights import GGUFWeights, WeightSource
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import LayerState, SequenceState, check_batch

SMALL_MODEL_DIM = 1024


class Block:
    def __init__(self, args: ModelArgs, il: int, weights: GGUFWeights, qat: bool) -> None:
        self.args = args
        layer = args.layer(il)

        def w(name: str) -> torch.Tensor:
            return weights.dense(f"blk.{il}.{name}")

        def expert(name: str, e: int) -> torch.Tensor:
            return weights.expert(f"blk.{il}.{name}", e)

        self.hc_attn = (w("hc_attn_fn.weight"), w("hc_attn_scale.weight"), w("hc_attn_base.weight"))
        self.hc_ffn = (w("hc_ffn_fn.weight"), w("hc_ffn_scale.weight"), w("hc_ffn_base.weight"))
        self.attn_norm = w("attn_norm.weight")
        self.ffn_norm = w("ffn_norm.weight")
        self.attn = Attention(args, layer, w, qat)
        self.moe = MoE(args, layer, w, expert)

    def __call__(self, h: torch.Tensor, tokens: torch.Tensor, groups: list[tuple[slice, torch.Tensor, LayerState]]):
        """h holds the rows of several sequences; `groups` gives each one's rows, positions and state.

        Attention runs per sequence (each has its own KV); everything else runs on all rows at once,
        so batched decode reads each weight once per step instead of once per sequence.
        """
        a = self.args
        x, post, comb = ops.hc_pre(h, *self.hc_attn, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        x = ops.rms_norm(x, self.attn_norm, a.norm_eps)
        attn = torch.cat([self.attn(x[rows], positions, state) for rows, positions, state in groups])
        h = ops.hc_post(attn, h, post, comb)
        x, post, comb = ops.hc_pre(h, *self.hc_ffn, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)
        return ops.hc_post(self.moe(ops.rms_norm(x, self.ffn_norm, a.norm_eps), tokens), h, post, comb)


class ReferenceModel:
    def __init__(
        self,
        model: ModelFile,
        qat: bool = True,
        max_seq_len: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self._build(model.args, GGUFWeights(model.gguf), qat, max_seq_len, progress)

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: WeightSource, qat: bool = True) -> ReferenceModel:
        """A model over any weight source, e.g. trainable parameters (tools/train_nano.py)."""
        model = cls.__new__(cls)
        model._build(args, weights, qat, None)
        return model

    def _build(
        self,
        args: ModelArgs,
        weights: WeightSource,
        qat: bool,
        max_seq_len: int | None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Read every weight; `progress(done, total)` counts the embedding, each block and the head."""
        report = progress or (lambda done, total: None)
        self.args, self.qat = args, qat
        if args.dim < SMALL_MODEL_DIM:
            # Tiny models run hundreds of microsecond-sized ops per token; OpenMP hand-offs between
            # threads cost more than the math (30x slower decode on 2 busy cores), so use one thread.
            torch.set_num_threads(1)
        self.max_seq_len = min(max_seq_len or args.max_seq_len, args.max_seq_len)
        total = args.n_layers + 2
        self.embed = weights.dense("token_embd.weight")
        report(1, total)
        self.blocks = []
        for il in range(args.n_layers):
            self.blocks.append(Block(args, il, weights, qat))
            report(il + 2, total)
        self.head_hc = tuple(weights.dense(f"output_hc_{k}.weight") for k in ("fn", "scale", "base"))
        self.out_norm = weights.dense("output_norm.weight")
        self.output = weights.dense("output.weight")
        report(total, total)

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.args)

    def forward(
        self, tokens: Sequence[int] | torch.Tensor, state: SequenceState, all_logits: bool = True
    ) -> torch.Tensor:
        """Logits after the T tokens, which continue `state` (updated in place, `state.logits` included).

        Returns [T, vocab] with `all_logits`, else [1, vocab] for the last token only: prefill skips
        the output head for every other position.
        """
        return self.forward_batch([tokens], [state], all_logits)[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """Advance several independent sequences in one pass (continuous batching).

        Each sequence may add any number of tokens; all are validated before any state changes.
        Returns each sequence's logits, [T, vocab] with `all_logits`, else [1, vocab].
        """
        logits = [y @ self.output.T for y in self.hidden_batch(token_lists, states, all_positions=all_logits)]
        for state, out in zip(states, logits, strict=True):
            if out.numel():
                state.logits = out[-1].clone()
        return logits

    def hidden_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_positions: bool = True,
    ) -> list[torch.Tensor]:
        """The output-normalised final hidden rows of each sequence, before the output head.

        Runs with autograd when called outside inference mode, so training can put its own head
        (e.g. restricted to the corpus vocabulary) on top; updates the states like `forward_batch`.
        """
        a = self.args
        chunks = check_batch(token_lists, states, a.vocab_size, self.max_seq_len)
        live = [(c, s) for c, s in zip(chunks, states, strict=True) if c.numel()]
        if not live:
            return [torch.empty(0, a.dim) for _ in chunks]
        tokens = torch.cat([c for c, _ in live])
        bounds, start = [], 0
        for chunk, state in live:
            bounds.append((slice(start, start + chunk.numel()), torch.arange(state.pos, state.pos + chunk.numel())))
            start += chunk.numel()
        h = self.embed[tokens].unsqueeze(1).expand(-1, a.hc_mult, -1).contiguous()
        for il, block in enumerate(self.blocks):
            groups = [(rows, pos, state.layers[il]) for (rows, pos), (_, state) in zip(bounds, live, strict=True)]
            h = block(h, tokens, groups)
        if not all_positions:
            h = h[[rows.stop - 1 for rows, _ in bounds]]
        y = ops.rms_norm(ops.hc_head(h, *self.head_hc, a.hc_eps, a.norm_eps), self.out_norm, a.norm_eps)
        out, row = {}, 0
        for chunk, state in live:
            n = chunk.numel() if all_positions else 1
            out[id(state)] = y[row : row + n]
            row += n
            state.pos += chunk.numel()
            state.tokens.extend(chunk.tolist())
        return [out.get(id(s), torch.empty(0, a.dim)) for s in states]
