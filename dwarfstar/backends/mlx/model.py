"""The MLX backend: DeepSeek V4's operations in MLX (`MLXOps`) under the one forward pass.

`MLXModel` is `dwarfstar.model.forward.Transformer` over `MLXOps`, so the order of the operations,
batching, layer ranges and hooks are the forward pass's; this module only says how each step is
computed. Every step only records MLX's lazy graph: the graph of a whole call is evaluated once, in
`logits`, together with the state arrays it updated, and the logits come back as torch tensors
(with `--cpu-moe`, each host layer's MoE also evaluates its input, which the CPU kernels then read).
Positions stay on the host as numpy integers (rope angles in float64 there), so the device graph
has no data-dependent shapes. Attention and the compressors run per sequence (each has its own
KV); everything else on all rows of a batch at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.backends.mlx import attention, metal_available, ops
from dwarfstar.backends.mlx.storage import MLXStorage, lazy_arrays
from dwarfstar.backends.mlx.weights import LayerWeights, Matrix, Weights
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import ModelArgs, yarn_inv_freq
from dwarfstar.model.forward import Batch, ExpertSource, ResidentExperts, Rows, Segment, Site, StreamSteps, Transformer
from dwarfstar.model.image_spans import check_router_biases, image_mask, window_reach
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.tensors import ProjectionGroup
from dwarfstar.sampling import sample_batch

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts

Swiglu = Callable[[mx.array, mx.array], mx.array]  # the clamped SwiGLU (`ops.Fused.swiglu`)


@dataclass
class ExpertStack:
    """A layer's routed experts, each projection stacked [n_expert, out, in] for gathered products."""

    gate: Matrix
    up: Matrix
    down: Matrix


def routed_experts(x: mx.array, stack: ExpertStack, slot_ids: mx.array, weights: mx.array, swiglu: Swiglu) -> mx.array:
    """The routed experts' output [T, dim] of rows x [T, dim], their slots [T, k] in `stack` weighted
    [T, k]: the router weight scales the SwiGLU output before the down projection, as ds4 does."""
    rows = x[:, None, None, :]
    hidden = swiglu(stack.gate.gather(rows, slot_ids), stack.up.gather(rows, slot_ids))
    return stack.down.gather(hidden * weights[..., None, None], slot_ids).sum(axis=(1, 2))


def shared_expert(x: mx.array, shared: tuple[Matrix, Matrix, Matrix], swiglu: Swiglu) -> mx.array:
    gate, up, down = shared
    return down.matmul(swiglu(gate.matmul(x), up.matmul(x)))


def resident_experts(weights: Weights, layers: Iterable[int], host: HostExperts | None) -> ResidentExperts:
    """The routed experts of `layers` packed as stacks, but for `host`'s layers (`--cpu-moe`: never packed)."""
    on_device = [il for il in layers if host is None or il not in host]
    return ResidentExperts(
        {il: ExpertStack(*(LayerWeights(weights, il).experts(n) for n in tt.EXPERTS)) for il in on_device}
    )


def host_moe(
    host: HostExperts, il: int, x: mx.array, ids: mx.array, weights: mx.array, shared: tuple[Matrix, Matrix, Matrix],
    swiglu: Swiglu,
) -> mx.array:  # fmt: skip
    """Layer il's MoE output [T, dim] with its routed experts on the host's CPU kernels (`--cpu-moe`) and
    the shared expert on MLX's stream."""
    # the crossing: x, ids and weights are evaluated here (the layer so far), seen by numpy
    # without a copy (MLX's buffers are host memory, on Apple shared with the GPU) and sent
    mx.eval(x, ids, weights)
    slots = torch.from_numpy(np.asarray(ids).astype(np.int64))
    sent = host.send(torch.from_numpy(np.asarray(x)), slots, torch.from_numpy(np.asarray(weights)))
    # the shared expert starts on MLX's stream (the GPU with Metal, else MLX's CPU worker) and
    # runs while this thread computes the routed experts on the CPU kernels in `receive`
    out = shared_expert(x, shared, swiglu)
    mx.async_eval(out)
    return out + mx.array(host.receive(il, sent).numpy())


def grouped_output(o: mx.array, wo_a: Matrix, wo_b: Matrix, group_ids: mx.array) -> mx.array:
    """The attention output [T, dim] of heads o [T, H, D]: wo_a is block-diagonal over the groups (a
    stack, `group_ids` [1, groups]; group g maps its heads' concat to o_lora_rank dims), then wo_b."""
    n, groups = o.shape[0], group_ids.shape[1]
    grouped = wo_a.gather(o.reshape(n, groups, 1, -1), mx.broadcast_to(group_ids, (n, groups)))
    return wo_b.matmul(grouped.reshape(n, -1))


@dataclass
class Product:
    """Consecutive parts of a projection group as one product: their matrices stacked row-wise."""

    matrix: Matrix
    keys: tuple[str, ...]
    splits: list[int]  # the output columns where each part after the first begins

    @classmethod
    def runs(cls, weights: LayerWeights, parts: tuple[tt.Part, ...]) -> list[Product]:
        runs = weights.stacked_rows([p.tensor for p in parts])
        keys, products = iter(p.key for p in parts), []
        for matrix, rows in runs:
            products.append(cls(matrix, tuple(next(keys) for _ in rows), np.cumsum(rows)[:-1].tolist()))
        return products

    def __call__(self, x: mx.array) -> dict[str, mx.array]:
        y = self.matrix.matmul(x)
        return dict(zip(self.keys, mx.split(y, self.splits, axis=-1) if self.splits else [y], strict=True))


@dataclass(frozen=True, slots=True)
class MLXStep:
    """One call as `MLXOps` runs it (`prepare`), and what its steps of a layer hand on."""

    # int32 [N]: every row's id for the tables looked up by id (the embedding, hash-routed layers'
    # experts); 0 at image-span positions, whose ids are past the tables
    tokens: mx.array
    positions: np.ndarray  # int64 [N]: every row's position, on the host
    # bool [N]: the rows at image-span positions (`embed` and `route` read it), or None in a call without spans
    image: mx.array | None = None
    # sequence's index in the batch -> its queries' raw rows [T, 2] (`image_spans.window_reach`), on the
    # host, for each sequence with a bidirectional image span (the others' windows are causal)
    reach: dict[int, np.ndarray] = field(default_factory=dict)
    # cos/sin at `positions` per set of rotary frequencies (their bytes): `norm_rope` fills it at the
    # first layer of a set, `norm_rope` and `sparse_attention` read it in every layer of that set
    rope: dict[bytes, tuple[mx.array, mx.array]] = field(default_factory=dict)
    # layer -> the call's finished KV rows [N, head_dim]: `write_window` leaves them, `sparse_attention`
    # takes them (attention reads them before the ring keeps them)
    window: dict[int, mx.array] = field(default_factory=dict)
    # (sequence's index in the batch, ratio, rows) -> its [T, rows] row visibility, the same in every
    # layer of a ratio: `index_topk` and `sparse_attention` fill and read it (`_visible`)
    visible: dict[tuple[int, int, int], mx.array] = field(default_factory=dict)
    # the raw window masks by query block, the same in every layer: `attention.sparse_attention` fills and reads it
    band: dict[tuple[int, int, int], mx.array | None] = field(default_factory=dict)


@dataclass
class Layer:
    """One block's weights, named by the tensor table's roles."""

    hc: dict[str, tuple[mx.array, mx.array, mx.array]]
    norm: dict[str, mx.array]
    proj: dict[str, list[Product]]  # each `ProjectionGroup` by name: one product per run of a packing
    q_norm: mx.array
    kv_norm: mx.array
    sinks: mx.array
    # wo_a is block-diagonal over groups: group g maps its heads' concat to o_lora_rank dims, so it
    # is loaded as a stack of o_groups matrices and applied with a gathered product
    wo_a: Matrix
    wo_b: Matrix
    compressors: dict[str, tuple[mx.array, mx.array]]  # kind -> (ape, norm)
    inv_freq: np.ndarray  # float64 rotary frequencies per pair
    router: Matrix
    bias: mx.array | None
    tid2eid: mx.array | None
    shared: tuple[Matrix, Matrix, Matrix]


class MLXOps(StreamSteps):
    """`dwarfstar.model.forward.Ops` in MLX, over weights in one of `weights.PACKINGS`."""

    def __init__(
        self,
        args: ModelArgs,
        weights: Weights,
        qat: bool,
        fused: ops.Fused,
        routed_experts: bool,
        layer_range: range | None = None,
        host: HostExperts | None = None,
    ) -> None:
        """Without `routed_experts` none is packed: they stream from the file (`experts.attach` sets the source).
        `layer_range`: the layers packed (a pipeline stage's), with the embedding when it starts at 0
        and the head when it ends at the last layer; `layers` is keyed by the global index. `host`: the
        layers whose routed experts the CPU kernels compute from the file (`--cpu-moe`): never packed."""
        self.args, self.qat, self.fused, self.host = args, qat, fused, host
        self.layer_range = held = range(args.n_layers) if layer_range is None else layer_range
        self.embedding = weights.dense(tt.EMBED) if held.start == 0 else None
        self.layers = {il: self._load_layer(weights, il) for il in held}
        self.experts: ExpertSource | None = resident_experts(weights, held, host) if routed_experts else None
        self.head_hc = self.out_norm = self.output = None
        if held.stop == args.n_layers:
            self.head_hc = tuple(weights.dense(name) for name in tt.HEAD_HC)
            self.out_norm = weights.dense(tt.OUTPUT_NORM)
            self.output = weights.matrix(tt.OUTPUT)
        self.group_ids = mx.arange(args.o_groups)[None, :]
        self.image_biases: dict[int, mx.array] = {}  # layer -> its router's image bias (`bias_vl`)

    def _load_layer(self, weights: Weights, il: int) -> Layer:
        a, spec, w = self.args, self.args.layer(il), LayerWeights(weights, il)
        return Layer(
            hc={site: tuple(w.dense(n) for n in tt.hc_mix(site)) for site in tt.SITES},
            norm={site: w.dense(tt.sublayer_norm(site)) for site in tt.SITES},
            proj={g.name: Product.runs(w, g.present(spec)) for g in tt.PROJECTION_GROUPS},
            q_norm=w.dense(tt.Q_NORM),
            kv_norm=w.dense(tt.KV_NORM),
            sinks=w.dense(tt.SINKS),
            wo_a=w.matrix(tt.OUT_A, groups=a.o_groups),
            wo_b=w.matrix(tt.OUT_B),
            compressors={
                kind: tuple(w.dense(n) for n in tt.compressor(kind))
                for kind in tt.COMPRESSORS
                if (kind == "attn" and spec.compress_ratio) or (kind == "indexer" and spec.has_indexer)
            },
            inv_freq=np.array(yarn_inv_freq(a, spec), dtype=np.float64),
            router=w.matrix(tt.ROUTER),
            bias=None if spec.hash_routed else w.dense(tt.ROUTER_BIAS),
            tid2eid=w.dense(tt.HASH_TABLE) if spec.hash_routed else None,
            shared=tuple(w.matrix(n) for n in tt.SHARED_EXPERT),
        )

    def kv_storage(self) -> MLXStorage:
        return MLXStorage()

    def attach_image_biases(self, biases: Mapping[int, torch.Tensor]) -> None:
        self.image_biases = {il: mx.array(bias.numpy()) for il, bias in biases.items()}

    def check_images(self) -> None:
        check_router_biases(self.image_biases.get(il) for il in self.layer_range)

    # -- streams -----------------------------------------------------------------------------------------
    def prepare(self, batch: Batch[MLXStep]) -> MLXStep:
        tokens = np.concatenate([s.tokens.numpy() for s in batch.seqs])
        positions = np.concatenate([np.arange(s.start, s.start + s.length) for s in batch.seqs])
        if not any(s.images for s in batch.seqs):
            return MLXStep(mx.array(tokens.astype(np.int32)), positions)
        image = np.concatenate([image_mask(s.images, s.length).numpy() for s in batch.seqs])
        reach = {i: window_reach(s.images, s.start, s.length, self.args.window) for i, s in enumerate(batch.seqs)}
        return MLXStep(
            mx.array(np.where(image, 0, tokens).astype(np.int32)),
            positions,
            mx.array(image),
            {i: r.numpy() for i, r in reach.items() if r is not None},
        )

    def embed(self, batch: Batch[MLXStep]) -> mx.array | None:
        if self.embedding is None:  # a later pipeline stage: its streams arrive from the previous one
            return None
        a, step = self.args, batch.step
        x = self.embedding[step.tokens]
        if step.image is not None:  # the spans' rows in place of the image positions' (row 0) lookups
            for seq in batch.seqs:
                for span in seq.images:
                    at = seq.rows.start + span.offset
                    x[at : at + span.length] = mx.array(span.rows.numpy()).astype(x.dtype)
        return mx.broadcast_to(x[:, None, :], (step.tokens.size, a.hc_mult, a.dim))

    def hc_pre(self, il: int, site: Site, h: mx.array, batch: Batch[MLXStep]) -> tuple[mx.array, tuple]:
        layer = self.layers[il]
        x, post, comb = self.fused.hc_pre(h, *layer.hc[site])
        return ops.rms_norm(x, layer.norm[site], self.args.norm_eps), (post, comb)

    def hc_post(self, h: mx.array, out: mx.array, mix: tuple, batch: Batch[MLXStep]) -> mx.array:
        return self.fused.hc_post(out, h, *mix)

    def hc_head(self, h: mx.array, rows: list[int] | None, batch: Batch[MLXStep]) -> mx.array:
        h = h if rows is None else h[mx.array(rows)]
        return ops.rms_norm(self.fused.hc_head(h, *self.head_hc), self.out_norm, self.args.norm_eps)

    def hc_collapse(self, h: mx.array, batch: Batch[MLXStep]) -> mx.array:
        return self.fused.hc_head(h, *self.head_hc)

    def output_norm(self, y: mx.array, batch: Batch[MLXStep]) -> mx.array:
        return ops.rms_norm(y, self.out_norm, self.args.norm_eps)

    def logits(self, y: mx.array, batch: Batch[MLXStep]) -> torch.Tensor:
        logits = self.output.matmul(y)
        mx.eval(logits, *(arr for seq in batch.seqs for arr in lazy_arrays(seq.state)))
        # a numpy copy, not torch ops: torch's thread hand-offs cost more than a copy on busy cores
        return torch.from_numpy(np.array(logits))

    # -- attention ---------------------------------------------------------------------------------------
    def project(self, il: int, group: ProjectionGroup, x: mx.array, batch: Batch[MLXStep]) -> dict[str, mx.array]:
        return {key: y for product in self.layers[il].proj[group.name] for key, y in product(x).items()}

    def _rope_tables(self, il: int, step: MLXStep) -> tuple[mx.array, mx.array]:
        """cos/sin at the batch's positions for the layer's frequencies, built once per call: layers
        share a few frequency sets (compressed layers blend theirs)."""
        inv_freq = self.layers[il].inv_freq
        key = inv_freq.tobytes()
        if key not in step.rope:
            step.rope[key] = ops.rope_tables(step.positions, inv_freq)
        return step.rope[key]

    def norm_rope(self, il: int, kind: Rows, x: mx.array, batch: Batch[MLXStep]) -> mx.array:
        a, layer, fused = self.args, self.layers[il], self.fused
        if kind is Rows.Q_LORA:
            return ops.rms_norm(x, layer.q_norm, a.norm_eps)
        cos, sin = self._rope_tables(il, batch.step)
        if kind is Rows.QUERY:
            return fused.rope(ops.rms_norm(x.reshape(x.shape[0], a.n_heads, a.head_dim), None, a.norm_eps), cos, sin)
        if kind is Rows.KV:
            kv = fused.rope(ops.rms_norm(x, layer.kv_norm, a.norm_eps), cos, sin)
            return fused.fp8_round_nope(kv) if self.qat else kv
        q = fused.rope(x.reshape(x.shape[0], a.index_n_heads, a.index_head_dim), cos, sin)
        return fused.indexer_round(q) if self.qat else q

    def write_window(self, il: int, kv: mx.array, batch: Batch[MLXStep]) -> None:
        """The chunk's rows join the window for attention; the ring keeps them once attention has read
        the rows they replace."""
        batch.step.window[il] = kv

    def compress(self, il: int, kind: str, proj: dict[str, mx.array], batch: Batch[MLXStep]) -> None:
        a, layer_weights = self.args, self.layers[il]
        ape, norm = layer_weights.compressors[kind]
        for seq in batch.seqs:
            state, spec = seq.state, seq.state.compressor(il, kind)
            front = state.part(il, f"{kind}_kv"), state.part(il, f"{kind}_gate")
            kv, gate = proj[f"{kind}_kv"][seq.rows], proj[f"{kind}_gate"][seq.rows]
            pooled, *front = attention.pool(spec, *front, kv, gate, ape, seq.start)
            state.write(il, f"{kind}_kv", front[0])
            state.write(il, f"{kind}_gate", front[1])
            if pooled is None:
                continue
            first = seq.start // spec.ratio
            row_positions = (first + np.arange(pooled.shape[0])) * spec.ratio  # its window's first token
            cos, sin = ops.rope_tables(row_positions, layer_weights.inv_freq)
            rows = self.fused.rope(ops.rms_norm(pooled, norm, a.norm_eps), cos, sin)
            if self.qat:
                rows = self.fused.fp8_round_nope(rows) if kind == "attn" else self.fused.indexer_round(rows)
            state.write(il, f"{kind}_rows", rows, first)

    def _visible(self, il: int, i: int, seq: Segment, n_rows: int, step: MLXStep) -> mx.array | None:
        """The i-th sequence's [T, n_rows] row visibility, the same in every layer of a ratio, built once per call."""
        ratio = self.args.layer(il).compress_ratio
        key = (i, ratio, n_rows)
        if key not in step.visible:
            positions = mx.arange(seq.start, seq.start + seq.length)
            step.visible[key] = attention.visible_rows(positions, ratio, n_rows)
        return step.visible[key]

    def index_topk(self, il: int, q: mx.array, weights: mx.array, batch: Batch[MLXStep]) -> list[attention.Selection]:
        a, chosen = self.args, []
        weights = weights * (a.index_head_dim**-0.5 * a.index_n_heads**-0.5)
        for i, seq in enumerate(batch.seqs):
            index_rows = seq.state.rows(il, "indexer", seq.start + seq.length)
            visible = self._visible(il, i, seq, index_rows.shape[0], batch.step)
            scores = attention.index_scores(q[seq.rows], weights[seq.rows], index_rows, visible)
            chosen.append(attention.top_k(scores, visible, a.index_topk))
        return chosen

    def sparse_attention(
        self, il: int, q: mx.array, batch: Batch[MLXStep], selected: list[attention.Selection] | None
    ) -> mx.array:
        a, layer, out = self.args, self.layers[il], []
        step = batch.step
        cos, sin = self._rope_tables(il, step)
        chunk = step.window.pop(il)
        for i, seq in enumerate(batch.seqs):
            state, end = seq.state, seq.start + seq.length
            rows = state.rows(il, "attn", end) if state.compressor(il, "attn") else None
            selection = None if selected is None else selected[i]
            # the indexer's selection already holds visibility; ratio-128 queries read every visible row
            visible = None if rows is None or selection is not None else self._visible(il, i, seq, rows.shape[0], step)
            raw = mx.concatenate((state.raw_window(il), chunk[seq.rows]))
            out.append(attention.sparse_attention(
                q[seq.rows], raw, seq.length, a.window, layer.sinks, rows, visible, selection, step.band,
                reach=step.reach.get(i),
            ))  # fmt: skip
            state.store_window(il, raw, end)
        o = out[0] if len(out) == 1 else mx.concatenate(out)
        return self.fused.unrope(o, cos, sin)

    def extend_window(self, il: int, kv: mx.array, batch: Batch[MLXStep]) -> None:
        for seq in batch.seqs:
            raw = mx.concatenate((seq.state.raw_window(il), kv[seq.rows]))
            seq.state.store_window(il, raw, seq.start + seq.length)

    def block_attention(self, il: int, q: mx.array, kv: mx.array, batch: Batch[MLXStep]) -> mx.array:
        sinks, out = self.layers[il].sinks, []
        for seq in batch.seqs:
            keys = mx.concatenate((seq.state.raw_window(il), kv[seq.rows]))
            out.append(ops.sink_attention(q[seq.rows], keys, None, sinks))
        o = out[0] if len(out) == 1 else mx.concatenate(out)
        return self.fused.unrope(o, *self._rope_tables(il, batch.step))

    def attn_output(self, il: int, o: mx.array, batch: Batch[MLXStep]) -> mx.array:
        layer = self.layers[il]
        return grouped_output(o, layer.wo_a, layer.wo_b, self.group_ids)

    # -- mixture of experts --------------------------------------------------------------------------------
    def route(self, il: int, x: mx.array, batch: Batch[MLXStep]) -> tuple[mx.array, mx.array]:
        a, layer, image = self.args, self.layers[il], batch.step.image
        fixed = None if layer.tid2eid is None else layer.tid2eid[batch.step.tokens]  # an image row's: bias_vl decides
        image_bias = None if image is None else self.image_biases[il]
        return ops.route(
            layer.router.matmul(x), a.n_activated_experts, a.route_scale, layer.bias, fixed, image, image_bias
        )

    def moe(
        self, il: int, x: mx.array, ids: mx.array, weights: mx.array, experts: ExpertSource, batch: Batch[MLXStep]
    ) -> mx.array:
        shared_weights = self.layers[il].shared
        if self.host is not None and il in self.host:
            return host_moe(self.host, il, x, ids, weights, shared_weights, self.fused.swiglu)
        stack, slot_ids = experts.experts(il, ids)
        swiglu = self.fused.swiglu
        return routed_experts(x, stack, slot_ids, weights, swiglu) + shared_expert(x, shared_weights, swiglu)


class MLXModel(Transformer[mx.array, MLXStep]):
    """The forward pass over `MLXOps`: what the session layer drives."""

    def __init__(
        self,
        model: ModelFile,
        qat: bool = True,
        packing: str = "exact",
        max_seq_len: int | None = None,
        fuse: bool | None = None,
        routed_experts: bool = True,
        kv_slots: int = 1,
        cpu_moe: range = range(0),
        threads: int | None = None,
    ) -> None:
        """`fuse` compiles the op-heavy primitives (`ops.Fused`); by default only where Metal runs them.
        Without `routed_experts` the routed experts are not packed: they stream (`--ssd-streaming`).
        `kv_slots`: sequences to a KV-cache block. MLX evaluates a block's row pool whole at its first
        write, so one is the default; a server gives its sessions one block, where forks share rows.
        The routed experts of the `cpu_moe` layers stay in the file, computed by the CPU kernels on
        `threads` threads (default: every core) (`--cpu-moe`)."""
        self.qat, self.packing = qat, packing
        fused = ops.Fused(model.args, metal_available() if fuse is None else fuse)
        weights = Weights(model.gguf, packing)
        host = None
        if cpu_moe:
            from dwarfstar.backends.cpu.experts import HostExperts

            host = HostExperts(model.gguf, model.args, cpu_moe, threads)
        operations = MLXOps(model.args, weights, qat, fused, routed_experts, model.layer_range, host)
        super().__init__(operations, max_seq_len, kv_slots)

    # logits come back as torch tensors on the CPU; the sampling rules run on them there, one sync a step
    sample_batch = staticmethod(sample_batch)
