"""DeepSeek V4.1's steps (`forward_v41.Ops41`) on the Triton kernels, float32 [T, ...] tensors on the device.

The order is `forward_v41.Transformer41`'s; this module only says how each step runs. What V4 and
V4.1 share runs on V4's kernels: every projection (`qmatmul`, weights in their file blocks), the
embedding lookup (`quant_blocks.gather_rows`), the norms, RoPE and the QAT roundings
(`rms_norm_rope`, with V4.1's roundings added), the mHC post (`hc_post`), the ratio-2 pooling
(`compressor`, no position bias), the indexer scores (`indexer_scores`) and the MoE (`moe_route`,
then `moe.experts_ffn`). V4.1's own steps have kernels of their own: the lagged mHC's mix and collapse
(`hc_mix`, `hc_collapse`; in a decode step one launch per sublayer with the post before it,
`hc_mix.hc_post_mix`), the Engram gate (`engram_gate`) and sink attention over each query's
gathered rows (`row_attention`). The candidate blocks and the top-k selection are the reference's
rules (`backends.reference.v41.select`) with the k-best step on V4's radix top-k kernel (`topk`, no
sort of the rows) and the kept picks ordered in one launch (`topk.valid_first`); the Engram rows come
from the host (`EngramStore`'s positional reads, rounded to bf16 there) and are uploaded per call.

The routed experts come from `experts` (V4's sources: the uploaded stacks, or `streaming`'s device pool
with `--ssd-streaming`); a `--cpu-moe` layer's run on the host's CPU kernels (`moe.host_ffn`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from dwarfstar.backends.reference.v41 import csa2, mhc, select, window
from dwarfstar.backends.triton.kernels import compressor, engram_gate, hc_collapse, hc_mix, hc_post, moe_route
from dwarfstar.backends.triton.kernels.indexer_scores import indexer_scores
from dwarfstar.backends.triton.kernels.moe_experts import DECODE_TOKENS
from dwarfstar.backends.triton.kernels.qmatmul import qmatmul
from dwarfstar.backends.triton.kernels.quant_blocks import gather_rows
from dwarfstar.backends.triton.kernels.rms_norm_rope import NORM_NONE, QAT_FP4_E4M3, QAT_FP4_ROW, QAT_FP8_ROW
from dwarfstar.backends.triton.kernels.rms_norm_rope import rms_norm_rope as norm_rope
from dwarfstar.backends.triton.kernels.row_attention import row_attention
from dwarfstar.backends.triton.kernels.topk import topk_indices, valid_first
from dwarfstar.backends.triton.moe import experts_ffn, host_ffn
from dwarfstar.backends.triton.runtime import EXACT, PagedRows
from dwarfstar.backends.triton.v41.weights import COMPRESSOR_KV_GATE, ENGRAM_GATE, Weights41
from dwarfstar.engram.hashing import EngramHash
from dwarfstar.engram.store import EngramStore
from dwarfstar.model import tensors as tt
from dwarfstar.model import tensors_v41 as tt41
from dwarfstar.model.config import yarn_inv_freq
from dwarfstar.model.forward import ExpertSource, ResidentExperts
from dwarfstar.model.forward_v41 import LaggedSteps41
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.numerics import rope_angles
from dwarfstar.model.pages import PAGE_ROWS

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts


def best_rows(scores: torch.Tensor, k: int, every: torch.Tensor | None = None) -> torch.Tensor:
    """`select.Best` on the device: each row's k best columns of all of its n >= k (the radix top-k
    kernel; indices ascending, ties to the lower column). `every`: int32 [rows] of n, where the caller has it."""
    rows, n = scores.shape
    if every is None:
        every = torch.full((rows,), n, dtype=torch.int32, device=scores.device)
    return topk_indices(scores.float(), every, k)


class TritonOps41(LaggedSteps41):
    def __init__(
        self, weights: Weights41, engram_hash: EngramHash, store: EngramStore, host: HostExperts | None = None
    ) -> None:
        """`host`: the layers whose routed experts the CPU kernels compute (`--cpu-moe`)."""
        self.w, self.args, self.device = weights, weights.args, weights.device
        self.hash, self.store, self.host = engram_hash, store, host
        self.experts: ExpertSource = ResidentExperts(weights.routed())  # streamed: the entry attaches a cache
        a = self.args
        freqs: dict[tuple[float, ...], torch.Tensor] = {}  # layers of the same RoPE share one tensor
        self.inv_freq = {
            il: freqs.setdefault(tuple(f := yarn_inv_freq(a, a.layer(il))),  # type: ignore[arg-type]
                                 torch.tensor(f, dtype=torch.float64, device=self.device))
            for il in range(a.n_layers)
        }  # fmt: skip
        self.no_bias = torch.zeros(csa2.POOLED_RATIO, a.head_dim, device=self.device)  # V4.1 pools without one
        # per call (its host positions, which the forward hands every layer): what depends only on them
        self._calls: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._small: dict[tuple, torch.Tensor] = {}  # constants of a decode step's size, by (what, tokens)
        self._picked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a decode step's top-k -> (rows, picked)

    def _tables(self, positions: torch.Tensor) -> dict:
        """What this backend keeps for one forward call (`positions`: the call's host tensor); gone with it."""
        tables = self._calls.get(positions)
        if tables is None:
            tables = self._calls[positions] = {}
        return tables

    def _per_call(self, positions: torch.Tensor, key, make):
        """`make()` once per forward call and `key`."""
        tables = self._tables(positions)
        if key not in tables:
            tables[key] = make()
        return tables[key]

    def _pos(self, positions: torch.Tensor) -> torch.Tensor:
        """The call's positions on the device: uploaded once per call."""
        return self._per_call(positions, "positions", lambda: positions.to(self.device))

    def _angles(self, il: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos/sin at the call's positions, once per call for each of the layers' frequencies."""
        inv = self.inv_freq[il]
        return self._per_call(positions, ("angles", id(inv)), lambda: rope_angles(self._pos(positions), inv))

    def _constant(self, what: str, tokens: int, make) -> torch.Tensor:
        """A constant of a call of `tokens` tokens (kept on the device for a decode step's sizes)."""
        if tokens > DECODE_TOKENS:
            return make()
        key = (what, tokens)
        if key not in self._small:
            self._small[key] = make()
        return self._small[key]

    # -- streams ---------------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, images: Sequence[ImageSpan]) -> torch.Tensor:
        w = self.w.matrix(None, tt.EMBED)
        ids = tokens.clamp(max=self.args.vocab_size - 1).to(device=self.device, dtype=torch.int32)
        h = gather_rows(w.data, w.ggml_type, self.args.dim, ids, copies=self.args.hc_mult)
        for span in images:  # the spans' rows in place of their image ids' (clamped) lookups
            h[span.offset : span.stop] = span.rows.to(self.device)[:, None, :]
        return h

    def engram_rows(self, tokens: Sequence[int], start: int) -> dict[int, np.ndarray]:
        return self.store.call_rows(self.hash, tokens, start)

    def engram(self, il: int, h: torch.Tensor, rows: np.ndarray, image: torch.Tensor | None) -> torch.Tensor:
        values = torch.from_numpy(self.store.rows(il, rows))
        # the rows' bf16 rounding on the host halves the upload; their FP8 rounding on the device
        e = values.to(torch.bfloat16).to(self.device).float().reshape(values.shape[0], -1)
        kv = qmatmul(norm_rope(e, norm=NORM_NONE, qat=QAT_FP8_ROW), self.w.matrix(il, tt41.ENGRAM_KV))
        out = engram_gate.engram_gate(h, kv, self.w.vector(il, ENGRAM_GATE), self.args.norm_eps)
        if image is None:
            return out
        return torch.where(image.to(self.device)[:, None, None], h, out)  # the gate is shut at image positions

    def mix(self, il: int, site: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn, scale, base = tt.hc_mix(site)
        a = self.args
        return hc_mix.hc_mix(
            h, self.w.matrix(il, fn), self.w.vector(il, scale), self.w.vector(il, base),
            a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps,
        )  # fmt: skip

    def sublayer_input(self, il: int, site: str, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        norm = self.w.vector(il, tt.sublayer_norm(site))
        return hc_collapse.hc_collapse(h, pre.to(self.device), norm, self.args.norm_eps)

    def kept(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone()  # the posts update the streams in place

    def hc_post(self, h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return hc_post.hc_post(h, out, post, comb)  # in place: the forward pass reads only the new streams

    def post_mix_input(
        self,
        il: int,
        site: str,
        h: torch.Tensor,
        after: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        pre: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """One launch in a decode step (one token: `hc_mix.hc_post_mix`, h updated in place); a call of
        several tokens runs the three steps (their mixes summed in the GEMV's order, as a prompt's)."""
        if h.shape[0] != 1:
            return super().post_mix_input(il, site, h, after, pre)
        a, names = self.args, tt.hc_mix(site)
        mix = (self.w.matrix(il, names[0]), self.w.vector(il, names[1]), self.w.vector(il, names[2]))
        norm = self.w.vector(il, tt.sublayer_norm(site))
        mixes, x = hc_mix.hc_post_mix(h, after, *mix, pre.to(self.device), norm, a.hc_sinkhorn_iters, a.hc_eps,
                                      a.norm_eps)  # fmt: skip
        return h, mixes, x

    def first_pre(self, tokens: int) -> torch.Tensor:
        return self._constant("first_pre", tokens, lambda: mhc.first_pre(tokens, self.args.hc_mult).to(self.device))

    def window(
        self, kept: torch.Tensor, new: torch.Tensor, positions: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        first, size = int(positions[0]) - kept.shape[0], self.args.window  # the host's positions: no device read
        index = functools.partial(window.window_index, self._pos(positions), first, size)
        at = self._per_call(positions, ("window", first), index)
        return window.window_keys(kept, new, positions, size, at)

    def append(self, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat((rows, new))

    def pick(self, rows: torch.Tensor, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers that read one top-k of one kv source's rows share the gather, in a decode step."""
        held = self._picked.get(picks)
        if held is not None and held[0] is rows:
            return held[1]
        picked = rows[picks.clamp(min=0)], picks >= 0
        if picks.shape[0] <= DECODE_TOKENS:  # a prefill chunk's gather is too large to keep
            self._picked[picks] = (rows, picked)
        return picked

    def head(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        norm = self.w.vector(None, tt.OUTPUT_NORM)
        y = hc_collapse.hc_collapse(h.contiguous(), pre.to(self.device), norm, self.args.norm_eps)
        return qmatmul(y, self.w.matrix(None, tt.OUTPUT))

    # -- attention -------------------------------------------------------------------------------------
    def query(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q unrotated: `attend`'s kernel applies its RoPE (`row_attention`'s `rotate_q`)."""
        a = self.args
        qr = norm_rope(qmatmul(x, self.w.matrix(il, "attn_q_a.weight")), weight=self.w.vector(il, tt.Q_NORM),
                       eps=a.norm_eps)  # fmt: skip
        return qmatmul(qr, self.w.matrix(il, "attn_q_b.weight")).view(x.shape[0], a.n_heads, a.head_dim), qr

    def window_rows(self, il: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = self.args
        kv = qmatmul(x, self.w.matrix(il, "attn_kv.weight"))
        return norm_rope(kv, weight=self.w.vector(il, tt.KV_NORM), eps=a.norm_eps, angles=self._angles(il, positions),
                         rope_dim=a.rope_dim, qat=QAT_FP8_ROW)  # fmt: skip

    def compress(
        self, il: int, x: torch.Tensor, frontier: tuple[torch.Tensor, torch.Tensor] | None, start: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The pooled groups' latents (the ratio-2 frontier advanced in place), then their main rows and
        index keys (`backends.reference.v41.csa2`'s steps)."""
        a, t = self.args, x.shape[0]
        if a.layer(il).has_gate:
            ratio, width = csa2.POOLED_RATIO, a.head_dim
            if frontier is None:
                frontier = tuple(part.to(self.device) for part in csa2.new_frontier(width))  # type: ignore[assignment]
            kv_gate = qmatmul(x, self.w.matrix(il, COMPRESSOR_KV_GATE))
            pos = torch.full((1,), start, dtype=torch.int32, device=self.device)
            n_emit = compressor.emitted(start, t, ratio)
            pooled = compressor.compress_chunk(kv_gate[:, :width], kv_gate[:, width:], self.no_bias, *frontier, pos,
                                               n_emit, ratio)  # fmt: skip
        else:
            ratio, pooled = 1, qmatmul(x, self.w.matrix(il, tt41.COMPRESSOR_KV))
        if not pooled.shape[0]:  # a call inside one group
            return pooled, x.new_zeros(0, a.index_head_dim), frontier
        latent = norm_rope(pooled, weight=self.w.vector(il, tt41.COMPRESSOR_NORM), eps=a.norm_eps)
        groups = start // ratio + torch.arange(latent.shape[0], device=self.device)
        angles = rope_angles(groups * ratio, self.inv_freq[il])
        rows = norm_rope(latent, norm=NORM_NONE, angles=angles, rope_dim=a.rope_dim, qat=QAT_FP4_E4M3)
        keys = norm_rope(qmatmul(latent, self.w.matrix(il, tt41.INDEX_K)), weight=self.w.vector(il, tt41.INDEX_K_NORM),
                         eps=a.norm_eps, angles=angles, rope_dim=a.rope_dim, qat=QAT_FP4_ROW)  # fmt: skip
        return rows, keys, frontier

    def index_scores(
        self, il: int, qr: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The indexer kernel over the keys laid out as one sequence's pages (an identity page table)."""
        a, t, n = self.args, x.shape[0], keys.shape[0]
        iq = qmatmul(qr, self.w.matrix(il, tt41.INDEX_Q)).view(t, a.index_n_heads, a.index_head_dim)
        iq = norm_rope(iq, norm=NORM_NONE, angles=self._angles(il, positions), rope_dim=a.rope_dim, qat=QAT_FP4_ROW)
        weights = qmatmul(x, self.w.matrix(il, tt41.INDEX_PROJ))
        # consecutive layers that score one kv source's keys in a call share their pages; one copy is kept
        # at a time (a long context's keys are large), and with it the keys, so their id stays theirs
        tables = self._tables(positions)
        held, pages = tables.get("pages", (None, None))
        if held is not keys:
            pages = self._pages(keys)
            tables["pages"] = (keys, pages)
        pos = self._per_call(positions, "first int32", lambda: self._pos(positions)[:1].to(torch.int32))
        scores, seen = indexer_scores(iq, weights, pages, pages.capacity, pos, a.compress_ratios[il])
        columns = self._per_call(positions, ("columns", n), lambda: torch.arange(n, device=self.device)[None, :])
        return scores[:, :n].masked_fill(columns >= seen[:, None], select.NEG_INF)

    def _pages(self, keys: torch.Tensor) -> PagedRows:
        n, pages = keys.shape[0], max(1, -(-keys.shape[0] // PAGE_ROWS))
        pool = keys.new_zeros(pages * PAGE_ROWS, keys.shape[1])
        pool[:n] = keys
        return PagedRows(pool, torch.arange(pages, dtype=torch.int32, device=self.device))

    def candidates(self, scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
        a = self.args
        return select.candidate_mask(scores, self._pos(positions), ratio, a.candidate_block_size,
                                     a.candidate_topk_blocks, self._best(positions))  # fmt: skip

    def top_k(
        self, scores: torch.Tensor, positions: torch.Tensor, ratio: int, end: int, candidates: torch.Tensor | None
    ) -> torch.Tensor:
        best, topk = self._best(positions), self.args.index_topk
        return select.top_k(scores, self._pos(positions), ratio, end, topk, candidates, best, valid_first)

    def _best(self, positions: torch.Tensor) -> select.Best:
        """`best_rows` with each row's column count filled once per call and shape."""

        def best(scores: torch.Tensor, k: int) -> torch.Tensor:
            rows, n = scores.shape
            every = self._per_call(positions, ("every", rows, n),
                                   lambda: torch.full((rows,), n, dtype=torch.int32, device=scores.device))  # fmt: skip
            return best_rows(scores, k, every)

        return best

    def attend(
        self, il: int, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
    ) -> torch.Tensor:
        a = self.args
        o = row_attention(q, parts, self.w.vector(il, tt.SINKS), self.inv_freq[il], a.rope_dim, self._pos(positions),
                          rotate_q=True)  # fmt: skip
        grouped = qmatmul(o.view(o.shape[0], -1), self.w.matrix(il, tt.OUT_A), a.o_groups)
        return qmatmul(grouped, self.w.matrix(il, tt.OUT_B))

    # -- mixture of experts ----------------------------------------------------------------------------
    def moe(self, il: int, x: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        a, t = self.args, x.shape[0]
        # V4.1 routes no layer by token hash
        unhashed = self._constant("unhashed", t, lambda: torch.zeros(t, dtype=torch.int32, device=self.device))
        router, k, scale = self.w.matrix(il, tt.ROUTER), a.n_activated_experts, a.route_scale
        ids, weights = moe_route.route(x, router, self.w.vector(il, tt.ROUTER_BIAS), None, unhashed, k, scale)
        if image is not None:  # image rows select by the image bias
            rows = image.nonzero().flatten().to(self.device)
            bias = self.w.vector(il, tt41.ROUTER_BIAS_VL)
            ids[rows], weights[rows] = moe_route.route(x[rows], router, bias, None, unhashed[rows], k, scale)
        shared = tuple(self.w.matrix(il, name) for name in tt.SHARED_EXPERT)
        if self.host is not None and il in self.host:
            return host_ffn(self.host, il, x, ids, weights, shared, a.swiglu_limit, EXACT)  # type: ignore[arg-type]
        routed, slots = self.experts.experts(il, ids)
        decode = EXACT if t <= DECODE_TOKENS else None
        return experts_ffn(x, slots, weights, routed, shared, a.swiglu_limit, EXACT, decode)  # type: ignore[arg-type]
