"""Model weights on the device, kept in their GGUF blocks.

Matrices become `QWeight`s: the block bytes of the file, one row of blocks per output row,
uploaded once from the memory map and decoded only inside kernels. The quant formats are
repacked on the way in (`repack`): GGUF blocks are 34 (Q8_0), 84 (Q2_K), 66 (IQ2_XXS) bytes, so
their quants sit at odd offsets and kernels could only read them byte by byte. In the aligned
layout each row holds first the quant payload of all its blocks (16-byte aligned runs that the
kernels read with 128-bit loads), then the remaining bytes of every block (the fp16 scales and
mins, and the packed sub-block scales), padded to a multiple of 16 bytes. It is a permutation of
the row's bytes, so it decodes to exactly the same values. Vectors (norms, sinks, biases,
mHC scales, position biases) and the hash-routing table are small and become float32 / int32
tensors.

Projections that read the same input are concatenated row-wise per block type at upload
(`FusedLinear`): attention's q_a, kv, both compressors and the indexer projections all read the
normalised input, so a decode step reads them in one or two launches instead of seven. Rows of a
GGUF matrix are independent runs of blocks, so concatenating them is exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import check_mxfp4, dequantize
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import LayerSpec, ModelArgs

# The bytes of a GGUF block that form its quant payload (IQ2_XXS: eight 8-byte groups of two u32s;
# MXFP4: the 16 nibble bytes after the exponent, so its 17-byte blocks become aligned 16-byte runs)
PAYLOAD = {
    GGMLType.Q8_0: range(2, 34),
    GGMLType.Q2_K: range(16, 80),
    GGMLType.Q4_K: range(16, 144),
    GGMLType.IQ2_XXS: range(2, 66),
    GGMLType.MXFP4: range(1, 17),
}
ROW_ALIGN = 16  # bytes: rows (and so each row's payload) start on 128-bit boundaries


def _block_order(ggml_type: GGMLType) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, side) byte indexes of a block; side is every other byte, in block order."""
    _, size = BLOCK_GEOMETRY[ggml_type]
    payload = PAYLOAD[ggml_type]
    side = [i for i in range(size) if i not in payload]
    return torch.tensor(payload), torch.tensor(side)


def aligned_row_bytes(ggml_type: GGMLType, cols: int) -> int:
    """Bytes per row in the aligned layout (the GGUF row for the float formats)."""
    block, size = BLOCK_GEOMETRY[ggml_type]
    row = cols // block * size
    return -(-row // ROW_ALIGN) * ROW_ALIGN if ggml_type in PAYLOAD else row


def repack(blocks: torch.Tensor, ggml_type: GGMLType, cols: int) -> torch.Tensor:
    """GGUF blocks uint8 [rows, blocks * size] -> the aligned layout [rows, aligned_row_bytes], same device."""
    if ggml_type not in PAYLOAD:
        return blocks
    block, size = BLOCK_GEOMETRY[ggml_type]
    if cols % block:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block} elements, got {cols}")
    rows, nb = blocks.shape[0], cols // block
    payload, side = (i.to(blocks.device) for i in _block_order(ggml_type))
    split = nb * len(payload)
    out = torch.zeros(rows, aligned_row_bytes(ggml_type, cols), dtype=torch.uint8, device=blocks.device)
    by_block = blocks.view(rows, nb, size)
    out[:, :split].view(rows, nb, -1).copy_(by_block.index_select(2, payload))
    out[:, split : nb * size].view(rows, nb, -1).copy_(by_block.index_select(2, side))
    return out


def unpack(data: torch.Tensor, ggml_type: GGMLType, cols: int) -> torch.Tensor:
    """The aligned layout back to GGUF blocks uint8 [rows, blocks * size] (the inverse of `repack`)."""
    if ggml_type not in PAYLOAD:
        return data
    block, size = BLOCK_GEOMETRY[ggml_type]
    rows, nb = data.shape[0], cols // block
    payload, side = (i.to(data.device) for i in _block_order(ggml_type))
    split = nb * len(payload)
    blocks = torch.empty(rows, nb, size, dtype=torch.uint8, device=data.device)
    blocks[:, :, payload] = data[:, :split].reshape(rows, nb, -1)
    blocks[:, :, side] = data[:, split : nb * size].reshape(rows, nb, -1)
    return blocks.view(rows, nb * size)


@dataclass
class QWeight:
    """A [rows, cols] matrix (or `experts` stacked [rows / experts, cols] matrices) as GGUF blocks,
    the quant formats in the aligned layout (`repack`)."""

    data: torch.Tensor  # uint8 [rows, row_bytes]
    ggml_type: GGMLType
    rows: int
    cols: int
    experts: int = 1

    @property
    def wtype(self) -> int:
        return int(self.ggml_type)

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def expert_rows(self) -> int:
        return self.rows // self.experts

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] through the torch dequantizer: the reference for kernel tests."""
        flat = dequantize(self.gguf_blocks().cpu().reshape(-1), self.ggml_type, self.rows * self.cols)
        return flat.view(self.rows, self.cols).to(self.data.device)

    def gguf_blocks(self) -> torch.Tensor:
        """uint8 [rows, blocks * size]: the rows as the file stores them."""
        return unpack(self.data, self.ggml_type, self.cols)

    @classmethod
    def from_bytes(cls, raw: np.ndarray | torch.Tensor, ggml_type: GGMLType, shape: tuple[int, ...], device) -> QWeight:
        ggml_type = GGMLType(ggml_type)
        block, size = BLOCK_GEOMETRY[ggml_type]
        cols = shape[-1]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        if isinstance(raw, np.ndarray):
            with warnings.catch_warnings():  # views of the read-only mmap; only ever copied from
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
        blocks = torch.empty(rows, cols // block * size, dtype=torch.uint8, device=device)
        blocks.copy_(raw.reshape(rows, -1))
        if ggml_type == GGMLType.MXFP4:  # a NaN exponent is a named error at upload, never NaNs in a kernel
            check_mxfp4(blocks.view(-1, size))
        return cls(repack(blocks, ggml_type, cols), ggml_type, rows, cols, shape[0] if len(shape) == 3 else 1)

    @classmethod
    def concat(cls, parts: list[QWeight]) -> QWeight:
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.cols != first.cols for p in parts):
            raise ValueError("only matrices of one block type and width concatenate")
        data = torch.cat([p.data for p in parts]) if len(parts) > 1 else first.data
        return cls(data, first.ggml_type, sum(p.rows for p in parts), first.cols)


# byte offsets of the fp16 scales (d, dmin) in a block; the rest of a block is random payload
_SCALE_FIELDS = {GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2), GGMLType.IQ2_XXS: (0,)}
# std of the decoded values of uniform payload bytes per unit of d (dmin = d / 4), measured once:
# d = 1 / (this * sqrt(cols)) gives weights of std ~1/sqrt(cols), like the float tensors
_STD_PER_D = {GGMLType.Q8_0: 74.0, GGMLType.Q2_K: 12.0, GGMLType.Q4_K: 217.0, GGMLType.IQ2_XXS: 53.0}


def random_qweight(ggml_type: GGMLType, shape: tuple[int, ...], device, gen: torch.Generator) -> QWeight:
    """Random well-formed blocks: float types ~N(0, 1/cols); quant payloads uniform, scales sized alike."""
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    block, size = BLOCK_GEOMETRY[ggml_type]
    if ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}[ggml_type]
        values = torch.randn(rows, cols, device=device, generator=gen) / cols**0.5
        data = values.to(dtype).view(torch.uint8)
    elif ggml_type == GGMLType.MXFP4:
        # uniform nibbles have std 5.85 half-scales (2^(e-128)): pick e for std ~1/sqrt(cols)
        data = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, device=device, generator=gen)
        data[:, :, 0] = 128 + round(-np.log2(5.85 * cols**0.5))
        data = repack(data.view(rows, -1), ggml_type, cols)
    else:
        data = torch.randint(0, 256, (rows, cols // block * size), dtype=torch.uint8, device=device, generator=gen)
        blocks = data.view(rows, cols // block, size)
        d = 1.0 / (_STD_PER_D[ggml_type] * cols**0.5)
        scales = torch.tensor([d, d / 4], dtype=torch.float16).view(torch.uint8).to(device)
        for i, at in enumerate(_SCALE_FIELDS[ggml_type]):
            blocks[:, :, at : at + 2] = scales[2 * i : 2 * i + 2]
        data = repack(data, ggml_type, cols)
    return QWeight(data, ggml_type, rows, cols, shape[0] if len(shape) == 3 else 1)


MatrixSource = Callable[[str], "QWeight"]  # tensor name -> its blocks on the device
VectorSource = Callable[[str], torch.Tensor]  # tensor name -> float32 on the device
HCWeights = tuple["QWeight", torch.Tensor, torch.Tensor]  # mHC fn blocks, scale, base


@dataclass
class FusedLinear:
    """Several projections of one input, concatenated per block type.

    `parts` holds one (weight, [(name, rows)]) per block type in the order first seen; the outputs
    are column slices of each part's product.
    """

    parts: list[tuple[QWeight, list[tuple[str, int]]]] = field(default_factory=list)

    @classmethod
    def build(cls, named: list[tuple[str, QWeight]]) -> FusedLinear:
        by_type: dict[tuple[GGMLType, int], list[tuple[str, QWeight]]] = {}
        for name, w in named:
            by_type.setdefault((w.ggml_type, w.cols), []).append((name, w))
        parts = [(QWeight.concat([w for _, w in ws]), [(n, w.rows) for n, w in ws]) for ws in by_type.values()]
        return cls(parts)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w, _ in self.parts)


@dataclass
class LayerWeights:
    hc_attn: HCWeights  # fn [24, 4D] blocks, scale [3], base [24]
    hc_ffn: HCWeights
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    projections: dict[str, FusedLinear]  # per tensor-table `ProjectionGroup`, outputs by `Part.key`
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    sinks: torch.Tensor
    wo_a: QWeight  # [groups * o_lora, heads_per_group * head_dim], used block-diagonally
    wo_b: QWeight
    compressor: tuple[torch.Tensor, torch.Tensor] | None  # ape [ratio, width], norm [head_dim]
    indexer: tuple[torch.Tensor, torch.Tensor] | None  # ape, norm [index_head_dim]
    router: QWeight
    router_bias: torch.Tensor | None
    tid2eid: torch.Tensor | None  # int32 [vocab, k] for hash-routed layers
    # the routed experts; None where they stream from the file instead (`dwarfstar.experts`)
    gate_exps: QWeight | None
    up_exps: QWeight | None
    down_exps: QWeight | None
    gate_shared: QWeight
    up_shared: QWeight
    down_shared: QWeight


@dataclass
class ModelWeights:
    """The uploaded weights of `layer_range` (a pipeline stage's slice, or every layer), `layers` keyed
    by the global layer index; the embedding only when the range starts at layer 0, the head (its mHC
    collapse, output norm and matrix) only when it ends at the last layer."""

    args: ModelArgs
    embed: QWeight | None
    head_hc: tuple[QWeight, torch.Tensor, torch.Tensor] | None
    out_norm: torch.Tensor | None
    output: QWeight | None
    layers: dict[int, LayerWeights]
    layer_range: range

    @property
    def device(self) -> torch.device:
        return self.layers[self.layer_range.start].attn_norm.device

    @property
    def nbytes(self) -> int:
        total = sum(w.nbytes for w in (self.embed, self.output) if w is not None)
        total += 0 if self.head_hc is None else self.head_hc[0].nbytes
        for lw in self.layers.values():
            for value in vars(lw).values():
                items = value if isinstance(value, tuple) else (value,)
                for item in items:
                    if isinstance(item, dict):
                        total += sum(linear.nbytes for linear in item.values())
                    elif isinstance(item, (QWeight, FusedLinear)):
                        total += item.nbytes
                    elif isinstance(item, torch.Tensor):
                        total += item.numel() * item.element_size()
        return total


def upload(
    gguf: GGUFFile,
    args: ModelArgs,
    device: torch.device | str,
    routed_experts: bool = True,
    layer_range: range | None = None,
    host_layers: range = range(0),
) -> ModelWeights:
    """Copy every tensor of the file to `device` once, matrices as blocks, vectors as float32; without
    `routed_experts` all but the routed experts, which then stream from the file (`--ssd-streaming`);
    with `layer_range` only those layers' (and the embedding or head where the range has them); never
    the routed experts of `host_layers`, which the CPU kernels compute from the file (`--cpu-moe`).

    Tensor by tensor, each one's mapped pages released after its copy (`GGUFFile.release`): where
    the GPU shares RAM with the CPU, peak memory stays near one model instead of two.
    """

    def matrix(name: str) -> QWeight:
        info = gguf.tensors[name]
        weight = QWeight.from_bytes(gguf.raw(name), info.ggml_type, info.shape, device)
        gguf.release(name)
        return weight

    def vector(name: str) -> torch.Tensor:
        values = gguf.tensor(name).to(device)
        gguf.release(name)
        return values

    return build_weights(args, matrix, vector, routed_experts, layer_range, host_layers)


def _hc(names: tuple[str, str, str], matrix: MatrixSource, vector: VectorSource) -> HCWeights:
    fn, scale, base = names
    return matrix(fn), vector(scale), vector(base)


def _layer_weights(layer: LayerSpec, matrix: MatrixSource, vector: VectorSource, routed_experts: bool) -> LayerWeights:
    def name(role: str) -> str:
        return tt.layer_tensor(layer.index, role)

    def fused(group: tt.ProjectionGroup) -> FusedLinear:
        return FusedLinear.build([(part.key, matrix(name(part.tensor))) for part in group.present(layer)])

    def compressor(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        ape, norm = (vector(name(role)) for role in tt.compressor(kind))
        return ape, norm

    gate, up, down = (matrix(name(role)) if routed_experts else None for role in tt.EXPERTS)
    gate_shared, up_shared, down_shared = (matrix(name(role)) for role in tt.SHARED_EXPERT)
    return LayerWeights(
        hc_attn=_hc(tuple(name(role) for role in tt.hc_mix("attn")), matrix, vector),
        hc_ffn=_hc(tuple(name(role) for role in tt.hc_mix("ffn")), matrix, vector),
        attn_norm=vector(name(tt.sublayer_norm("attn"))),
        ffn_norm=vector(name(tt.sublayer_norm("ffn"))),
        projections={group.name: fused(group) for group in tt.PROJECTION_GROUPS},
        q_norm=vector(name(tt.Q_NORM)),
        kv_norm=vector(name(tt.KV_NORM)),
        sinks=vector(name(tt.SINKS)),
        wo_a=matrix(name(tt.OUT_A)),
        wo_b=matrix(name(tt.OUT_B)),
        compressor=compressor("attn") if layer.compress_ratio else None,
        indexer=compressor("indexer") if layer.has_indexer else None,
        router=matrix(name(tt.ROUTER)),
        router_bias=None if layer.hash_routed else vector(name(tt.ROUTER_BIAS)),
        tid2eid=vector(name(tt.HASH_TABLE)).to(torch.int32) if layer.hash_routed else None,
        gate_exps=gate,
        up_exps=up,
        down_exps=down,
        gate_shared=gate_shared,
        up_shared=up_shared,
        down_shared=down_shared,
    )


def build_weights(
    args: ModelArgs,
    matrix: MatrixSource,
    vector: VectorSource,
    routed_experts: bool = True,
    layer_range: range | None = None,
    host_layers: range = range(0),
) -> ModelWeights:
    """Assemble the model's weights from per-tensor sources (a file, or random synthetic blocks): of
    `layer_range` (default every layer), reading no tensor outside it."""
    held = range(args.n_layers) if layer_range is None else layer_range
    has_head = held.stop == args.n_layers
    return ModelWeights(
        args=args,
        embed=matrix(tt.EMBED) if held.start == 0 else None,
        head_hc=_hc(tt.HEAD_HC, matrix, vector) if has_head else None,
        out_norm=vector(tt.OUTPUT_NORM) if has_head else None,
        output=matrix(tt.OUTPUT) if has_head else None,
        layers={
            il: _layer_weights(args.layer(il), matrix, vector, routed_experts and il not in host_layers) for il in held
        },
        layer_range=held,
    )
