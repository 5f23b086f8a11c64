"""Decoding GGUF quant blocks inside Triton kernels, and the row gather built on it (embeddings).

`load_weight_tile` turns the raw bytes of BN weight rows into a [BN, BK] float32 tile for columns
k0..k0+BK, straight from the GGUF block layout (spec §4.5): the weights stay in their blocks in
device memory and are only ever expanded in registers. Every matrix kernel (GEMV, GEMM, experts)
calls it, so this is the one place that knows the block formats.

Each format is decoded in a [BN, blocks, elements-per-block] shape so the per-block fields (fp16
scales, packed sub-block scales) are loaded once per block and broadcast, then reshaped to
[BN, BK]. The float operations follow `dwarfstar.gguf.dequant` exactly ((d*sc)*q - dmin*m, never
accumulating in fp16), and every product there is exact in fp32, so the tiles are bit-exact against
it even where the compiler fuses a multiply-add.

Byte offsets are int64: a Flash expert tensor is over 1 GB.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, interpreting
from dwarfstar.backends.triton.weights import random_qweight
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, QK_K, GGMLType
from dwarfstar.gguf.dequant import _iq2xxs_tables, dequantize


def tile_k(ggml_type: GGMLType, k: int, gemm: bool = False) -> int:
    """Columns decoded per step: one super-block for the 256-element formats; else up to 256, or 64
    for a tensor-core GEMM, whose [BN, BK] tile also sits in registers next to the activations."""
    block, _ = BLOCK_GEOMETRY[ggml_type]
    if block == QK_K:
        return QK_K
    cap = 64 if gemm and not interpreting() else 256
    return max(32 if ggml_type == GGMLType.Q8_0 else 16, min(cap, triton.next_power_of_2(k)))


@functools.cache
def _grid_table(device: torch.device) -> torch.Tensor:
    return _iq2xxs_tables()[0].reshape(-1).to(device)


def grid_table(device: torch.device | str) -> torch.Tensor:
    """IQ2_XXS's 256 x 8 lattice as float32 (8 KB, stays in cache); a placeholder for other types."""
    return _grid_table(torch.device(device))


@triton.jit
def _q8_0_tile(w_ptr, row_off, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    # block: f16 d, int8 q[32]; x = d * q
    NB: tl.constexpr = BK // 32
    b = k0 // 32 + tl.arange(0, NB)
    j = tl.arange(0, 32)
    block_off = row_off[:, None] + b[None, :].to(tl.int64) * 34  # [BN, NB]
    valid = (b < K // 32)[None, :]
    q = tl.load(
        (w_ptr + block_off[:, :, None] + 2 + j[None, None, :]).to(tl.pointer_type(tl.int8)),
        mask=valid[:, :, None],
        other=0,
    ).to(tl.float32)
    d = tl.load((w_ptr + block_off).to(tl.pointer_type(tl.float16)), mask=valid, other=0.0).to(tl.float32)
    return tl.reshape(q * d[:, :, None], [BN, BK])


@triton.jit
def _q2_k_tile(w_ptr, row_off, sb, BN: tl.constexpr):
    # block (84 B): u8 scales[16] (low nibble scale, high nibble min), u8 qs[64], f16 d, f16 dmin.
    # Sub-block j (16 elements) of half h = j // 8 reads qs[32h + 16(j % 2) + i] at shift 2((j % 8) // 2).
    base = row_off + sb * 84  # [BN]
    j = tl.arange(0, 16)
    i = tl.arange(0, 16)
    qbyte = 16 + 32 * (j // 8) + 16 * (j % 2)
    shift = (2 * ((j % 8) // 2)).to(tl.uint8)
    q = tl.load(w_ptr + base[:, None, None] + qbyte[None, :, None] + i[None, None, :])
    q = ((q >> shift[None, :, None]) & 3).to(tl.float32)
    sc = tl.load(w_ptr + base[:, None] + j[None, :])  # [BN, 16]
    d = tl.load((w_ptr + base + 80).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + base + 82).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dl = d[:, None] * (sc & 15).to(tl.float32)
    ml = dmin[:, None] * (sc >> 4).to(tl.float32)
    return tl.reshape(dl[:, :, None] * q - ml[:, :, None], [BN, 256])


@triton.jit
def _q4_k_tile(w_ptr, row_off, sb, BN: tl.constexpr):
    # block (144 B): f16 d, f16 dmin, u8 scales[12] (eight 6-bit scales and mins, ggml's
    # get_scale_min_k4 packing), u8 qs[128]; sub-blocks 2p and 2p+1 share qs[32p:32p+32] (low, high nibble).
    base = row_off + sb * 144
    j = tl.arange(0, 8)
    l = tl.arange(0, 32)
    s_j = tl.load(w_ptr + base[:, None] + 4 + j[None, :])  # scales[j]
    s_j4 = tl.load(w_ptr + base[:, None] + 8 + j[None, :])  # scales[j + 4]
    s_jm4 = tl.load(w_ptr + base[:, None] + 4 + (j % 4)[None, :])  # scales[j - 4] where j >= 4
    low = (j < 4)[None, :]
    sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4)).to(tl.float32)
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4)).to(tl.float32)
    q = tl.load(w_ptr + base[:, None, None] + 16 + (32 * (j // 2))[None, :, None] + l[None, None, :])
    q = ((q >> (4 * (j % 2)).to(tl.uint8)[None, :, None]) & 15).to(tl.float32)
    d = tl.load((w_ptr + base).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + base + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dl = d[:, None] * sc
    ml = dmin[:, None] * mn
    return tl.reshape(dl[:, :, None] * q - ml[:, :, None], [BN, 256])


@triton.jit
def _iq2_xxs_tile(w_ptr, grid_ptr, row_off, sb, BN: tl.constexpr):
    # block (66 B): f16 d, then 8 groups of 8 bytes for 32 elements each. Bytes 0-3 of group g pick
    # lattice points (8 elements each) of the 256-entry grid; bytes 4-7 are a u32 whose bits 0-27 hold
    # four 7-bit sign patterns and bits 28-31 a scale s. The 8th sign bit makes the popcount even.
    # x = (d * (0.5 + s) * 0.25) * grid * sign. Row c of the [32, 8] view is group c // 4, chunk c % 4.
    base = row_off + sb * 66
    c = tl.arange(0, 32)
    i = tl.arange(0, 8)
    group = base[:, None] + 2 + 8 * (c // 4)[None, :]  # [BN, 32] byte offset of the group
    point = tl.load(w_ptr + group + (c % 4)[None, :]).to(tl.int32)
    # the u32 is only 2-byte aligned (66-byte blocks): assemble it from its bytes
    aux = tl.load(w_ptr + group + 4).to(tl.uint32)
    aux |= tl.load(w_ptr + group + 5).to(tl.uint32) << 8
    aux |= tl.load(w_ptr + group + 6).to(tl.uint32) << 16
    aux |= tl.load(w_ptr + group + 7).to(tl.uint32) << 24
    scale = (aux >> 28).to(tl.float32)
    signs = (aux >> (7 * (c % 4)).to(tl.uint32)[None, :]) & 127
    parity = signs ^ (signs >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    signs |= (parity & 1) << 7
    negative = ((signs[:, :, None] >> i.to(tl.uint32)[None, None, :]) & 1) != 0
    values = tl.load(grid_ptr + point[:, :, None] * 8 + i[None, None, :])
    d = tl.load((w_ptr + base).to(tl.pointer_type(tl.float16))).to(tl.float32)
    db = d[:, None] * (0.5 + scale) * 0.25
    x = db[:, :, None] * values
    return tl.reshape(tl.where(negative, -x, x), [BN, 256])


@triton.jit
def load_weight_tile(w_ptr, grid_ptr, row_off, k0, K, WTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 [BN, BK] tile of the rows at byte offsets `row_off` [BN] (int64), columns k0..k0+BK.

    `w_ptr` points at uint8 bytes; k0 is a multiple of BK, and for the 256-element formats BK == 256.
    Columns at or past K read as 0 (float and Q8_0 rows may end inside a tile).
    """
    if WTYPE == 8:  # Q8_0
        return _q8_0_tile(w_ptr, row_off, k0, K, BN, BK)
    elif WTYPE == 10:  # Q2_K
        return _q2_k_tile(w_ptr, row_off, k0 // 256, BN)
    elif WTYPE == 12:  # Q4_K
        return _q4_k_tile(w_ptr, row_off, k0 // 256, BN)
    elif WTYPE == 16:  # IQ2_XXS
        return _iq2_xxs_tile(w_ptr, grid_ptr, row_off, k0 // 256, BN)
    else:
        k = k0 + tl.arange(0, BK)
        mask = (k < K)[None, :]
        if WTYPE == 0:  # F32
            ptr = (w_ptr + row_off[:, None] + 4 * k[None, :]).to(tl.pointer_type(tl.float32))
            return tl.load(ptr, mask=mask, other=0.0)
        elif WTYPE == 1:  # F16
            ptr = (w_ptr + row_off[:, None] + 2 * k[None, :]).to(tl.pointer_type(tl.float16))
            return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        else:  # BF16: the top half of a float32 (shifted in integers: the interpreter mishandles bf16)
            ptr = (w_ptr + row_off[:, None] + 2 * k[None, :]).to(tl.pointer_type(tl.uint16))
            bits = tl.load(ptr, mask=mask, other=0).to(tl.uint32) << 16
            return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gather_rows_kernel(
    w_ptr, grid_ptr, ids_ptr, out_ptr, n, K, row_bytes, copies,
    WTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # program (row block, column block): decode BN gathered rows, write each `copies` times
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ids = tl.load(ids_ptr + rows, mask=rows < n, other=0)
    tile = load_weight_tile(w_ptr, grid_ptr, ids.to(tl.int64) * row_bytes, k0, K, WTYPE, BN, BK)
    k = k0 + tl.arange(0, BK)
    for c in range(copies):
        out = out_ptr + (rows.to(tl.int64) * copies + c)[:, None] * K + k[None, :]
        tl.store(out, tile, mask=(rows < n)[:, None] & (k < K)[None, :])


def gather_rows(data: torch.Tensor, ggml_type: GGMLType, k: int, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """Decode rows `ids` of a [rows, row_bytes] block tensor to float32 [len(ids), copies, k].

    The embedding lookup: `copies` = 4 writes the token's vector into all hyper-connection streams.
    """
    n = ids.numel()
    out = torch.empty(n, copies, k, device=data.device, dtype=torch.float32)
    bk = tile_k(ggml_type, k)
    bn = min(16, triton.next_power_of_2(n)) if interpreting() else 1
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _gather_rows_kernel[grid](data, grid_table(data.device), ids, out, n, k, data.shape[1], copies,
                              WTYPE=int(ggml_type), BN=bn, BK=bk)  # fmt: skip
    return out


def reference(data: torch.Tensor, ggml_type: GGMLType, k: int, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """The same rows decoded by the torch dequantizer (bit-exact against gguf-py)."""
    rows = data.cpu()[ids.cpu().long()]
    flat = dequantize(rows.reshape(-1), ggml_type, rows.shape[0] * k).view(-1, 1, k)
    return flat.expand(-1, copies, -1).to(data.device)


def bench_cases(shape: BenchShape) -> list[BenchCase]:
    a = shape.args
    embed = random_qweight(GGMLType.F16, (a.vocab_size, a.dim), shape.device, shape.generator())
    ids = torch.randint(0, a.vocab_size, (shape.prefill,), device=shape.device, dtype=torch.int32)
    moved = shape.prefill * a.dim * (2 + 4 * a.hc_mult)
    return [
        BenchCase(
            "quant_blocks",
            f"embedding F16 gather {shape.prefill} x {a.dim} into {a.hc_mult} streams",
            lambda: gather_rows(embed.data, GGMLType.F16, a.dim, ids, copies=a.hc_mult),
            moved,
        )  # fmt: skip
    ]
