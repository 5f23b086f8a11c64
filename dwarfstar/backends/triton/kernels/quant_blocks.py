"""Decoding GGUF quant blocks inside Triton kernels, and the row gather built on it (embeddings).

`load_weight_tile` turns the bytes of BN weight rows into a [BN, BK] float32 tile for columns
k0..k0+BK, straight from the GGUF blocks (spec §4.5) in the aligned layout of `weights.repack`
(each row: the quant payload of all blocks, 16-byte aligned, then the scales): the weights stay
in their blocks in device memory and are only ever expanded in registers, and the payload is read
with 128-bit loads. The matrix kernels (GEMM, prefill experts, the GEMV's super-block path) call
it; the decode GEMV reads the vector formats (F32/F16/BF16/Q8_0) through `load_vector_tile`, one
128-bit vector of a row per thread, and the decode loops of the experts use `expert_blocks`, which
decodes the quant formats straight into sums of products instead of float tiles.

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

from dwarfstar.backends.triton.runtime import BenchCase, BenchShape, dependent_launch, interpreting, wait_for_inputs
from dwarfstar.backends.triton.weights import PAYLOAD, random_qweight, unpack
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, QK_K, GGMLType
from dwarfstar.gguf.dequant import _iq2xxs_tables, dequantize


def tile_payload_bytes(ggml_type: GGMLType, bk: int) -> int:
    """Quant (or float) bytes one weight row contributes to a [rows, bk] tile: what its 128-bit
    loads cover. A GEMV tile needs 16 of them per thread for every thread to issue one."""
    block, size = BLOCK_GEOMETRY[ggml_type]
    return bk // block * (len(PAYLOAD[ggml_type]) if ggml_type in PAYLOAD else size)


@functools.cache
def warp_size() -> int:
    """Threads per warp of the target compiled for: 32 on NVIDIA, 64 on AMD CDNA (wave64)."""
    return triton.runtime.driver.active.get_current_target().warp_size


@functools.cache
def compiles_ptx() -> bool:
    """Whether kernels compile for NVIDIA, where they may hold PTX (never in the interpreter)."""
    return not interpreting() and triton.runtime.driver.active.get_current_target().backend == "cuda"


def gemv_tile(bm: int, n: int, ggml_type: GGMLType, bk: int) -> tuple[int, int]:
    """(BN, num_warps) of a GEMV tile on a GPU: bm activation rows against BN weight rows of bk columns.

    128 threads per program (4 NVIDIA warps, 2 AMD wavefronts). The [BM, BN, BK] product lives in
    registers: near 4K elements per 128 threads. For one row the tile also grows until each thread
    loads a full 128-bit vector (2-bit rows carry only 64 bytes per super-block, so they take 32
    rows); more rows get fewer warps instead.
    """
    payload = tile_payload_bytes(ggml_type, bk)
    bn = 8 if bm == 1 else max(2, 16 // bm)
    if bm == 1:
        bn = max(bn, 16 * 128 // payload)
    bn = min(triton.next_power_of_2(n), bn)
    warp = warp_size()
    return bn, max(1, min(128 // warp, bn * payload // (16 * warp)))


# GEMV tile candidates for `triton.autotune`; `gemv_search` keeps the few that suit a launch
GEMV_CANDIDATES = [
    triton.Config({"BN": bn}, num_warps=warps, num_stages=1) for bn in (4, 8, 16, 32, 64) for warps in (1, 2, 4, 8)
]


def gemv_search(
    candidates: list[triton.Config], heuristic: triton.Config, bm: int, n: int, ggml_type: GGMLType, bk: int
) -> list[triton.Config]:
    """The heuristic GEMV tile (`gemv_tile`), it with two pipeline stages, and the candidates that keep
    its guarantees: 64 to 256 threads that each load a full 128-bit vector of the weight tile, and
    no more product elements per thread than the heuristic (its registers do not spill)."""
    payload = tile_payload_bytes(ggml_type, bk)
    warp = warp_size()
    per_thread = bm * heuristic.kwargs["BN"] * bk // (heuristic.num_warps * warp)
    kept = {(heuristic.kwargs["BN"], heuristic.num_warps, stages) for stages in (1, 2)}
    for config in candidates:
        bn, threads = config.kwargs["BN"], config.num_warps * warp
        fits = 64 <= threads <= 256 and bn <= triton.next_power_of_2(n)
        if fits and bn * payload >= 16 * threads and bm * bn * bk <= per_thread * threads:
            kept.add((bn, config.num_warps, config.num_stages))
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st) for bn, w, st in sorted(kept)]


def tile_k(ggml_type: GGMLType, k: int, gemm: bool = False) -> int:
    """Columns decoded per step: one super-block for the 256-element formats; else up to 256, or 64
    for a tensor-core GEMM, whose [BN, BK] tile also sits in registers next to the activations."""
    block, _ = BLOCK_GEOMETRY[ggml_type]
    if block == QK_K:
        return QK_K
    cap = 64 if gemm and not interpreting() else 256
    return max(block if block > 1 else 16, min(cap, triton.next_power_of_2(k)))


@functools.cache
def _grid_table(device: torch.device) -> torch.Tensor:
    return _iq2xxs_tables()[0].reshape(-1).to(device)


def grid_table(device: torch.device | str) -> torch.Tensor:
    """IQ2_XXS's 256 x 8 lattice as float32 (8 KB, stays in cache); a placeholder for other types."""
    return _grid_table(torch.device(device))


@triton.jit
def _q8_0_tile(w_ptr, row_off, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    # payload: int8 q[K]; side: f16 d per 32 columns. x = d * q
    NB: tl.constexpr = BK // 32
    k = k0 + tl.arange(0, BK)
    q_ptr = (w_ptr + row_off[:, None] + k[None, :]).to(tl.pointer_type(tl.int8))
    q = tl.load(q_ptr, mask=(k < K)[None, :], other=0).to(tl.float32)
    b = k0 // 32 + tl.arange(0, NB)
    d_ptr = (w_ptr + row_off[:, None] + K + 2 * b[None, :]).to(tl.pointer_type(tl.float16))
    d = tl.load(d_ptr, mask=(b < K // 32)[None, :], other=0.0).to(tl.float32)
    return tl.reshape(tl.reshape(q, [BN, NB, 32]) * d[:, :, None], [BN, BK])


@triton.jit
def _q2_k_tile(w_ptr, row_off, sb, K, BN: tl.constexpr):
    # payload: qs[64] per super-block; side (20 B): u8 scales[16] (low nibble scale, high nibble min),
    # f16 d, f16 dmin. Element 128h + 32s + c (c < 32) is bits 2s..2s+1 of qs[32h + c], in the
    # sub-block j = 8h + 2s + c // 16: each byte is loaded once and expanded by its four shifts.
    c = tl.arange(0, 32)
    qs = (row_off + sb * 64)[:, None, None] + (32 * tl.arange(0, 2))[None, :, None] + c[None, None, :]
    qb = tl.load(w_ptr + qs)  # [BN, 2, 32]
    shift = (2 * tl.arange(0, 4)).to(tl.uint8)
    q = ((qb[:, :, None, :] >> shift[None, None, :, None]) & 3).to(tl.float32)  # [BN, 2, 4, 32]
    side = row_off + K // 4 + sb * 20
    sc = tl.load(w_ptr + side[:, None] + tl.arange(0, 16)[None, :])  # [BN, 16]
    d = tl.load((w_ptr + side + 16).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 18).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dl = tl.reshape(d[:, None] * (sc & 15).to(tl.float32), [BN, 8, 2])
    ml = tl.reshape(dmin[:, None] * (sc >> 4).to(tl.float32), [BN, 8, 2])
    x = dl[:, :, :, None] * tl.reshape(q, [BN, 8, 2, 16]) - ml[:, :, :, None]
    return tl.reshape(x, [BN, 256])


@triton.jit
def _q4_k_tile(w_ptr, row_off, sb, K, BN: tl.constexpr):
    # payload: qs[128] per super-block; side (16 B): f16 d, f16 dmin, u8 scales[12] (eight 6-bit
    # scales and mins, ggml's get_scale_min_k4 packing). Element 64p + 32n + l is nibble n of
    # qs[32p + l], in the sub-block j = 2p + n.
    l = tl.arange(0, 32)
    qs = (row_off + sb * 128)[:, None, None] + (32 * tl.arange(0, 4))[None, :, None] + l[None, None, :]
    qb = tl.load(w_ptr + qs)  # [BN, 4, 32]
    nibble = (4 * tl.arange(0, 2)).to(tl.uint8)
    q = ((qb[:, :, None, :] >> nibble[None, None, :, None]) & 15).to(tl.float32)  # [BN, 4, 2, 32]
    side = row_off + K // 2 + sb * 16
    j = tl.arange(0, 8)
    s_j = tl.load(w_ptr + side[:, None] + 4 + j[None, :])  # scales[j]
    s_j4 = tl.load(w_ptr + side[:, None] + 8 + j[None, :])  # scales[j + 4]
    s_jm4 = tl.load(w_ptr + side[:, None] + 4 + (j % 4)[None, :])  # scales[j - 4] where j >= 4
    low = (j < 4)[None, :]
    sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4)).to(tl.float32)
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4)).to(tl.float32)
    d = tl.load((w_ptr + side).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((w_ptr + side + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    dl = d[:, None] * sc
    ml = dmin[:, None] * mn
    return tl.reshape(dl[:, :, None] * tl.reshape(q, [BN, 8, 32]) - ml[:, :, None], [BN, 256])


@triton.jit
def _iq2_xxs_tile(w_ptr, grid_ptr, row_off, sb, K, BN: tl.constexpr):
    # payload (64 B per super-block): 8 groups of 32 elements, each two u32 words: the bytes of the
    # first pick lattice points (8 elements each) of the 256-entry grid, the second holds four 7-bit
    # sign patterns (bits 0-27) and a scale s (bits 28-31). The 8th sign bit makes the popcount
    # even. side: f16 d. x = (d * (0.5 + s) * 0.25) * grid * sign.
    word_ptr = (w_ptr + row_off + sb * 64).to(tl.pointer_type(tl.uint32))
    words = tl.load(word_ptr[:, None] + tl.arange(0, 16)[None, :])  # [BN, 16], one 64-byte run per row
    points, aux = tl.split(tl.reshape(words, [BN, 8, 2]))  # [BN, 8] each
    chunk = tl.arange(0, 4).to(tl.uint32)
    i = tl.arange(0, 8)
    point = ((points[:, :, None] >> (8 * chunk)[None, None, :]) & 255).to(tl.int32)  # [BN, 8, 4]
    aux = aux[:, :, None]
    scale = (aux >> 28).to(tl.float32)
    signs = (aux >> (7 * chunk)[None, None, :]) & 127  # [BN, 8, 4]
    parity = signs ^ (signs >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    signs |= (parity & 1) << 7
    negative = ((signs[:, :, :, None] >> i.to(tl.uint32)[None, None, None, :]) & 1) != 0
    values = tl.load(grid_ptr + point[:, :, :, None] * 8 + i[None, None, None, :])  # [BN, 8, 4, 8]
    d = tl.load((w_ptr + row_off + K // 4 + 2 * sb).to(tl.pointer_type(tl.float16))).to(tl.float32)
    db = d[:, None, None] * (0.5 + scale) * 0.25  # [BN, 8, 1]
    x = db[:, :, :, None] * values
    return tl.reshape(tl.where(negative, -x, x), [BN, 256])


@triton.jit
def _mxfp4_tile(w_ptr, row_off, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    # payload: 16 bytes per block of 32 columns, byte j holding element j (low nibble) and j + 16
    # (high); side: one E8M0 exponent byte e per block. A nibble is E2M1: bit 3 the sign, m = bits 0-2
    # the magnitude code, whose doubled value is m below 2 and (2 + (m & 1)) << ((m >> 1) - 1) above
    # (0, 1, 2, 3, 4, 6, 8, 12); x = 2^(e-128) * that, with 2^(e-128) built from its float32 bits as in
    # `dequant.mxfp4_half_scales` (subnormal for e < 2). Every product is exact.
    NB: tl.constexpr = BK // 32
    b = k0 // 32 + tl.arange(0, NB)
    b_ok = b < K // 32
    at = row_off[:, None, None] + (16 * b)[None, :, None] + tl.arange(0, 16)[None, None, :]
    qb = tl.load(w_ptr + at, mask=b_ok[None, :, None], other=0).to(tl.int32)  # [BN, NB, 16]
    q = tl.join(qb & 15, qb >> 4)  # [BN, NB, 16, 2]
    m = q & 7
    v = tl.where(m < 2, m, (2 + (m & 1)) << ((m >> 1) - 1))
    v = tl.where(q >= 8, -v, v).to(tl.float32)
    e = tl.load(w_ptr + row_off[:, None] + K // 2 + b[None, :], mask=b_ok[None, :], other=0).to(tl.int32)
    half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # [BN, NB]
    x = tl.permute(v, 0, 1, 3, 2) * half[:, :, None, None]  # [BN, NB, 2 (low, high nibble), 16]
    return tl.reshape(x, [BN, BK])


# The vector formats: a 128-bit load holds VECTOR_ELEMENTS of their columns (Q8_0: 16 quants of
# half a block, whose fp16 scale sits in the row's side bytes)
VECTOR_ELEMENTS = {GGMLType.F32: 4, GGMLType.F16: 8, GGMLType.BF16: 8, GGMLType.Q8_0: 16}


@triton.jit
def load_vector_tile(
    w_ptr, row_off, kv, K, k_end, WTYPE: tl.constexpr, VE: tl.constexpr, MASKED: tl.constexpr, PTX: tl.constexpr
):
    """One weight row of a vector format, at byte offset `row_off` (int64 scalar): (values, scale).

    `kv` [NV] are the first columns of NV vectors of VE consecutive columns; values are the float32
    [NV, VE] weights before the scale, scale [NV, 1] Q8_0's block scale of each vector (1.0 for the float
    formats), so a dot product over a vector is scaled once. With MASKED, columns at or past `k_end`
    read as 0. Exact: int8 and fp16/bf16 widen to float32 without rounding. PTX: compiled for NVIDIA.
    """
    col = kv[:, None] + tl.arange(0, VE)[None, :]
    row = w_ptr + row_off
    if WTYPE == 8:  # Q8_0
        q = int8_to_float(load_columns(row.to(tl.pointer_type(tl.int8)), col, k_end, MASKED), PTX)
        d = load_columns((row + K).to(tl.pointer_type(tl.float16)), kv // 32, k_end // 32, MASKED)
        return q, d.to(tl.float32)[:, None]
    elif WTYPE == 0:  # F32
        return load_columns(row.to(tl.pointer_type(tl.float32)), col, k_end, MASKED), 1.0
    elif WTYPE == 1:  # F16
        return load_columns(row.to(tl.pointer_type(tl.float16)), col, k_end, MASKED).to(tl.float32), 1.0
    else:  # BF16: the top half of a float32
        bits = load_columns(row.to(tl.pointer_type(tl.uint16)), col, k_end, MASKED).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True), 1.0


@triton.jit
def int8_to_float(q, PTX: tl.constexpr):
    """int8 -> float32, exactly, without the conversion unit (Hopper converts 16 values per clock and
    SM, about what one SM's share of HBM brings in Q8_0): q + 128 becomes the low mantissa byte of
    2^23, and 2^23 + 128 is subtracted. On NVIDIA one xor per 4 values, one byte permute and one add
    per value (PTX, 4 packed values per register, value i in byte i); elsewhere the same in Triton."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7540;
            prmt.b32 $1, t, 0x4B000000, 0x7541;
            prmt.b32 $2, t, 0x4B000000, 0x7542;
            prmt.b32 $3, t, 0x4B000000, 0x7543;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[q],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    u = (q.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint32) | 0x4B000000
    return u.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def load_columns(ptr, col, k_end, MASKED: tl.constexpr):
    """ptr[col], with MASKED the columns at or past k_end as 0."""
    if MASKED:
        return tl.load(ptr + col, mask=col < k_end, other=0)
    return tl.load(ptr + col)


@triton.jit
def load_weight_tile(w_ptr, grid_ptr, row_off, k0, K, WTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 [BN, BK] tile of the rows at byte offsets `row_off` [BN] (int64), columns k0..k0+BK.

    `w_ptr` points at uint8 bytes in the aligned layout; k0 is a multiple of BK, and for the
    256-element formats BK == 256.
    Columns at or past K read as 0 (float and Q8_0 rows may end inside a tile).
    """
    if WTYPE == 8:  # Q8_0
        return _q8_0_tile(w_ptr, row_off, k0, K, BN, BK)
    elif WTYPE == 10:  # Q2_K
        return _q2_k_tile(w_ptr, row_off, k0 // 256, K, BN)
    elif WTYPE == 12:  # Q4_K
        return _q4_k_tile(w_ptr, row_off, k0 // 256, K, BN)
    elif WTYPE == 16:  # IQ2_XXS
        return _iq2_xxs_tile(w_ptr, grid_ptr, row_off, k0 // 256, K, BN)
    elif WTYPE == 39:  # MXFP4
        return _mxfp4_tile(w_ptr, row_off, k0, K, BN, BK)
    else:
        k = k0 + tl.arange(0, BK)
        mask = (k < K)[None, :]
        # cast the row pointers before indexing in elements: unit steps of a typed pointer are what
        # the compiler's contiguity analysis sees, so the loads vectorise
        row = w_ptr + row_off[:, None]
        if WTYPE == 0:  # F32
            return tl.load(row.to(tl.pointer_type(tl.float32)) + k[None, :], mask=mask, other=0.0)
        elif WTYPE == 1:  # F16
            return tl.load(row.to(tl.pointer_type(tl.float16)) + k[None, :], mask=mask, other=0.0).to(tl.float32)
        else:  # BF16: the top half of a float32 (shifted in integers: the interpreter mishandles bf16)
            bits = tl.load(row.to(tl.pointer_type(tl.uint16)) + k[None, :], mask=mask, other=0).to(tl.uint32) << 16
            return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gather_rows_kernel(
    w_ptr, grid_ptr, ids_ptr, out_ptr, n, K, row_bytes, copies,
    WTYPE: tl.constexpr, GATHER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    # program (row block, column block): decode BN gathered rows (or rows in order), write each
    # `copies` times in the output's dtype
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ids = tl.load(ids_ptr + rows, mask=rows < n, other=0) if GATHER else tl.minimum(rows, n - 1)
    tile = load_weight_tile(w_ptr, grid_ptr, ids.to(tl.int64) * row_bytes, k0, K, WTYPE, BN, BK)
    tile = tile.to(out_ptr.dtype.element_ty)
    k = k0 + tl.arange(0, BK)
    for c in range(copies):
        out = out_ptr + (rows.to(tl.int64) * copies + c)[:, None] * K + k[None, :]
        tl.store(out, tile, mask=(rows < n)[:, None] & (k < K)[None, :])


def gather_rows(data: torch.Tensor, ggml_type: GGMLType, k: int, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """Decode rows `ids` of a [rows, row_bytes] block tensor (a `QWeight.data`, in the aligned
    layout) to float32 [len(ids), copies, k].

    The embedding lookup: `copies` = 4 writes the token's vector into all hyper-connection streams.
    """
    n = ids.numel()
    out = torch.empty(n, copies, k, device=data.device, dtype=torch.float32)
    bk = tile_k(ggml_type, k)
    bn = min(16, triton.next_power_of_2(n)) if interpreting() else 1
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _gather_rows_kernel[grid](data, grid_table(data.device), ids, out, n, k, data.shape[1], copies,
                              WTYPE=int(ggml_type), GATHER=True, BN=bn, BK=bk, **dependent_launch())  # fmt: skip
    return out


def dequantize_rows(data: torch.Tensor, ggml_type: GGMLType, out: torch.Tensor) -> torch.Tensor:
    """Decode every row of a [rows, row_bytes] block tensor into `out` [rows, k] (float32 or bfloat16)."""
    n, k = out.shape
    bk = tile_k(ggml_type, k)
    bn, warps = (min(64, triton.next_power_of_2(n)), 1) if interpreting() else gemv_tile(1, n, ggml_type, bk)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _gather_rows_kernel[grid](data, grid_table(data.device), data, out, n, k, data.shape[1], 1,
                              WTYPE=int(ggml_type), GATHER=False, BN=bn, BK=bk, num_warps=warps,
                              **dependent_launch())  # fmt: skip
    return out


def reference(data: torch.Tensor, ggml_type: GGMLType, k: int, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """The same rows decoded by the torch dequantizer (bit-exact against gguf-py)."""
    rows = unpack(data.cpu()[ids.cpu().long()], ggml_type, k)
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
