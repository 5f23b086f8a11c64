"""The torch reference's V4.1 steps (`forward_v41.Ops41`) over a ds4 `deepseek41` file, float32.

The new numerics come from this package's modules (window, csa2, select, mhc, engram); the rest is V4's
reference math, which V4.1's reference (shared/spec/RELEASES_2026.md) shows is unchanged: RMSNorm, RoPE with YaRN, sink
attention over gathered rows (`ops.attention_rows`), grouped wo_a / wo_b, sqrt-softplus routing and
the clamped-SwiGLU experts. The Engram rows are read from the file through an `EngramStore`.

The weight products run as `products` hold them, as in V4's reference (`weights.Products`): float32
tensors by default, the CPU kernels' file blocks on the cpu backend (`backends/cpu/products.py`). The
product weights are those V4's reference multiplies through them (the embedding, the projections,
wo_a / wo_b, the compressors, the indexer, the experts and the head) with V4.1's W_k and Engram W_kv;
the norms, the mHC mixes and the router stay float32. V4.1's FP8 / FP4 roundings are on the
activations and rows, before or after a product, so they are the same whichever products run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.model import expert_reader
from dwarfstar.backends.reference.v41 import csa2, engram, mhc, select, window
from dwarfstar.backends.reference.weights import FLOAT32, GGUFWeights, Products, WeightSource
from dwarfstar.engram.hashing import EngramHash
from dwarfstar.engram.store import EngramStore
from dwarfstar.model import tensors as tt
from dwarfstar.model import tensors_v41 as tt41
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.forward import ExpertSource, ResidentExperts
from dwarfstar.model.forward_v41 import LaggedSteps41
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.numerics import FP4_BLOCK, rope_angles, route


class ReferenceOps41(LaggedSteps41):
    def __init__(
        self,
        args: ModelArgs41,
        weights: WeightSource,
        engram_hash: EngramHash,
        store: EngramStore,
        products: Products = FLOAT32,
        held: range | None = None,
    ) -> None:
        """`products`: how the weight products are held and computed (float32 here; the CPU kernels');
        `held`: a stage's layers (None: all of them), whose weights alone are read: the embedding only
        where it starts at 0, the head only where it ends last."""
        self.args, self.weights, self.hash, self.store, self.products = args, weights, engram_hash, store, products
        self._dense: dict[str, torch.Tensor] = {}  # the layers' float32 weights, read once
        self._matrices: dict[str, Any] = {}  # the layers' product weights, as `products` hold them
        self.hc = mhc.HcConfig(args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)
        held = range(args.n_layers) if held is None else held
        self.embedding = products.table(weights, tt.EMBED) if held.start == 0 else None
        self.out_norm = self.output = None
        if held.stop == args.n_layers:
            self.out_norm, self.output = weights.dense(tt.OUTPUT_NORM), products.matrix(weights, tt.OUTPUT)
        # read from the file as the router picks them; `--ssd-streaming` puts a cache in their place
        self.experts: ExpertSource = ResidentExperts(
            [expert_reader(weights, il, products) for il in range(args.n_layers)]
        )
        self.inv_freq = {
            il: torch.tensor(yarn_inv_freq(args, args.layer(il)), dtype=torch.float64)  # type: ignore[arg-type]
            for il in range(args.n_layers)
        }

    @classmethod
    def from_file(cls, model: ModelFile41, engram_cache_bytes: int = 0, products: Products = FLOAT32) -> ReferenceOps41:
        store = EngramStore(model.engram, engram_cache_bytes)
        return cls(model.args, GGUFWeights(model.gguf), model.engram_hash, store, products, model.layer_range)

    def w(self, il: int, name: str) -> torch.Tensor:
        """Layer il's float32 weight `name` (a norm, a mix, the router), read once."""
        full = tt.layer_tensor(il, name)
        if full not in self._dense:
            self._dense[full] = self.weights.dense(full)
        return self._dense[full]

    def m(self, il: int, name: str) -> Any:
        """Layer il's product weight `name`, as `products` hold it, read once."""
        full = tt.layer_tensor(il, name)
        if full not in self._matrices:
            self._matrices[full] = self.products.matrix(self.weights, full)
        return self._matrices[full]

    def _linear(self, x: Any, il: int, name: str) -> torch.Tensor:
        """x @ W.T for layer il's product weight `name` (x a tensor or a `products.input`)."""
        return self.products.linear(x, self.m(il, name))

    def _angles(self, il: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.inv_freq[il])

    # -- streams ---------------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, images: Sequence[ImageSpan]) -> torch.Tensor:
        x = self.embedding[tokens.clamp(max=self.args.vocab_size - 1)]  # image ids: their span's rows, below
        for span in images:
            x[span.offset : span.stop] = span.rows
        return x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()

    def engram_rows(self, tokens: Sequence[int], start: int) -> dict[int, np.ndarray]:
        return self.store.call_rows(self.hash, tokens, start)

    def engram(self, il: int, h: torch.Tensor, rows: np.ndarray, image: torch.Tensor | None) -> torch.Tensor:
        values = torch.from_numpy(self.store.rows(il, rows))
        shut = torch.zeros(h.shape[0], dtype=torch.bool) if image is None else image
        norms = (self.w(il, name) for name in (tt41.ENGRAM_Q_NORM, tt41.ENGRAM_K_NORM))
        return engram.engram(h, values, self.m(il, tt41.ENGRAM_KV), *norms, shut, self.args.norm_eps, self.products)

    def mix(self, il: int, site: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc.mix(h, mhc.HcWeights(*(self.w(il, name) for name in tt.hc_mix(site))), self.hc)

    def sublayer_input(self, il: int, site: str, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(mhc.collapse(h, pre), self.w(il, tt.sublayer_norm(site)), self.args.norm_eps)

    def hc_post(self, h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return ops.hc_post(out, h, post, comb)

    def first_pre(self, tokens: int) -> torch.Tensor:
        return mhc.first_pre(tokens, self.args.hc_mult)

    def window(
        self, kept: torch.Tensor, new: torch.Tensor, positions: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return window.window_keys(kept, new, positions, self.args.window)

    def append(self, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat((rows, new))

    def pick(self, rows: torch.Tensor, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows[picks.clamp(min=0)], picks >= 0

    def head(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self.products.linear(ops.rms_norm(mhc.collapse(h, pre), self.out_norm, self.args.norm_eps), self.output)

    # -- attention -------------------------------------------------------------------------------------
    def query(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        qr = ops.rms_norm(self._linear(x, il, "attn_q_a.weight"), self.w(il, tt.Q_NORM), a.norm_eps)
        q = self._linear(qr, il, "attn_q_b.weight").view(x.shape[0], a.n_heads, a.head_dim)
        return ops.apply_rope(q, *self._angles(il, positions)), qr

    def window_rows(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv = self._linear(x, il, "attn_kv.weight")
        return window.window_rows(kv, self.w(il, tt.KV_NORM), positions, self.inv_freq[il], self.args.norm_eps)

    def compress(
        self, il: int, x: torch.Tensor, frontier: tuple[torch.Tensor, torch.Tensor] | None, start: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        spec = self.args.layer(il)
        x = self.products.input(x)  # quantized once for both products on the kernels
        kv = self._linear(x, il, tt41.COMPRESSOR_KV)
        score = self._linear(x, il, tt41.COMPRESSOR_GATE) if spec.has_gate else None
        if score is not None and frontier is None:
            frontier = csa2.new_frontier(kv.shape[1])
        done = csa2.compress(
            kv,
            score,
            None if frontier is None else csa2.Frontier(*frontier),
            self.w(il, tt41.COMPRESSOR_NORM),
            self.m(il, tt41.INDEX_K),
            self.w(il, tt41.INDEX_K_NORM),
            self.inv_freq[il],
            start,
            self.args.norm_eps,
            self.products,
        )
        return done.rows, done.index_keys, done.frontier

    def index_scores(
        self, il: int, qr: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        a, t = self.args, x.shape[0]
        iq = self._linear(qr, il, tt41.INDEX_Q).view(t, a.index_n_heads, a.index_head_dim)
        iq = ops.fp4_round(ops.apply_rope(iq, *self._angles(il, positions)), FP4_BLOCK)
        weights = self._linear(x, il, tt41.INDEX_PROJ)
        return select.index_scores(iq, weights, keys, positions, a.compress_ratios[il])

    def candidates(self, scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
        a = self.args
        return select.candidate_mask(scores, positions, ratio, a.candidate_block_size, a.candidate_topk_blocks)

    def top_k(
        self, scores: torch.Tensor, positions: torch.Tensor, ratio: int, end: int, candidates: torch.Tensor | None
    ) -> torch.Tensor:
        return select.top_k(scores, positions, ratio, end, self.args.index_topk, candidates)

    def attend(
        self, il: int, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
    ) -> torch.Tensor:
        a = self.args
        out, _ = ops.attention_rows(q, parts, self.w(il, tt.SINKS))
        o = ops.apply_rope(out, *self._angles(il, positions), inverse=True)
        heads, rank, wo_a = o.reshape(o.shape[0], a.o_groups, -1), a.o_lora_rank, self.m(il, tt.OUT_A)
        linear = self.products.linear
        grouped = torch.cat([linear(heads[:, g], wo_a[g * rank : (g + 1) * rank]) for g in range(a.o_groups)], 1)
        return self._linear(grouped, il, tt.OUT_B)

    # -- mixture of experts ----------------------------------------------------------------------------
    def moe(self, il: int, x: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        a = self.args
        logits = ops.linear(x, self.w(il, tt.ROUTER))
        bias, image_bias = self.w(il, tt.ROUTER_BIAS), self.w(il, tt41.ROUTER_BIAS_VL)
        ids, weights = route(logits, a.n_activated_experts, a.route_scale, bias, None, image, image_bias)
        expert, slots = self.experts.experts(il, ids)
        out = ops.routed_ffn(x, ids, slots, weights, expert, self.products, a.swiglu_limit)
        gate, up, down = (self.m(il, name) for name in tt.SHARED_EXPERT)
        x, linear = self.products.input(x), self.products.linear
        return out + linear(ops.swiglu_clamped(linear(x, gate), linear(x, up), a.swiglu_limit), down)
